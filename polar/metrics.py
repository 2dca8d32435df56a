"""Prometheus `/metrics` for every Polar service (prometheus_client's text format).

A service whose section sets `metrics_address` serves it from its own event loop, each value read at
scrape time, with a registry per service and the process's `process_*` beside. What each service
reports: docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from polar.service_base import join_host_port
from polar.v1 import rollout_pb2

if TYPE_CHECKING:
    from aiohttp import web


@dataclass
class MetricsEndpoint:
    """A started /metrics listener; `stop()` closes it."""

    host: str
    port: int
    runner: web.AppRunner

    @property
    def url(self) -> str:
        return f"http://{join_host_port(self.host, self.port)}/metrics"

    async def stop(self) -> None:
        await self.runner.cleanup()


class Collect:
    """A collector made of a function yielding metric families (prometheus_client's protocol)."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


async def start_metrics(
    address: str,
    *collectors: Callable[[], Iterable[Metric]],
    pid: int | None = None,
    appended: Callable[[], Awaitable[bytes]] | None = None,
) -> MetricsEndpoint:
    """Serve `collectors` (and the process_* metrics of process `pid`, default this one) at
    http://address/metrics, followed by what `appended` gives at each scrape (another program's
    metrics in the same text format, read before the collectors run). OSError naming the address
    when it cannot be bound; ValueError when it is not HOST:PORT."""
    # Imported here, where a section sets metrics_address: importing aiohttp costs a service start
    # about 0.3 s of CPU (it builds two SSL contexts), and the rollout server, the inference server,
    # the Envoy wrapper and the trainer need it for nothing else.
    from aiohttp import web

    host, port = _host_port(address)
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry, pid=lambda: pid if pid is not None else "self")
    for collect in collectors:
        registry.register(Collect(collect))

    async def metrics(request: web.Request) -> web.Response:
        more = await appended() if appended is not None else b""
        return web.Response(body=generate_latest(registry) + more, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_port=False)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot serve /metrics on {address}: {exc.strerror}") from None
    return MetricsEndpoint(host, runner.addresses[0][1], runner)


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics_address: {address!r} is not HOST:PORT (port 0 picks one)")
    return host, int(port)


def _gauge(name: str, help_text: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


def _labelled(kind, name: str, help_text: str, label: str, values: dict[str, float]):
    family = kind(name, help_text, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


# ------------------------------------------------------------------------------------- rollout


def rollout_metrics(servicer) -> Callable[[], Iterable[Metric]]:
    """The rollout server's: sessions per state, nodes, released groups, and the control plane's
    upstreams and each Envoy's versions."""

    def collect() -> Iterator[Metric]:
        store = servicer.store
        counts = store.session_counts()
        yield _labelled(
            GaugeMetricFamily,
            "polar_rollout_sessions",
            "sessions per state",
            "state",
            {rollout_pb2.SessionState.Name(s).removeprefix("SESSION_STATE_"): counts.get(s, 0) for s in STATES},
        )
        yield _gauge("polar_rollout_nodes", "live gateway nodes", len(store.nodes()))
        yield _counter(
            "polar_rollout_groups_released", "GRPO groups released to the results stream", store.last_release()
        )
        yield from control_plane(servicer.membership)

    return collect


def control_plane_metrics(membership) -> Callable[[], Iterable[Metric]]:
    """The control plane's (in a rollout server, or `polar serve xds`): upstreams and each Envoy's versions."""
    return lambda: control_plane(membership)


def control_plane(membership) -> Iterator[Metric]:
    """The control plane's metrics families."""
    upstreams = GaugeMetricFamily(
        "polar_xds_upstreams", "upstreams joined, per cluster", labels=["cluster", "draining"]
    )
    tally: dict[tuple[str, str], int] = {}
    for member in membership.members():
        key = (member.upstream.cluster, "true" if member.upstream.draining else "false")
        tally[key] = tally.get(key, 0) + 1
    for key, count in sorted(tally.items()):
        upstreams.add_metric(list(key), count)
    yield upstreams
    families = {
        "connected": GaugeMetricFamily(
            "polar_xds_envoy_connected", "1 while the Envoy has an ADS stream open", labels=["envoy"]
        ),
        "version": GaugeMetricFamily(
            "polar_xds_envoy_version", "N of the EPOCH.N version the Envoy should have", labels=["envoy"]
        ),
        "acknowledged": GaugeMetricFamily(
            "polar_xds_envoy_acknowledged_version",
            "N of the EPOCH.N version the Envoy acknowledged (0: none this epoch)",
            labels=["envoy"],
        ),
        "up_to_date": GaugeMetricFamily(
            "polar_xds_envoy_up_to_date", "1 when it acknowledged its current version", labels=["envoy"]
        ),
        "rejected": GaugeMetricFamily(
            "polar_xds_envoy_rejected", "1 while its latest answer was a NACK", labels=["envoy"]
        ),
    }
    cache = membership.discovery.cache
    for envoy in membership.discovery.envoys.values():
        snapshot = cache.current(envoy.node_id)
        version = snapshot.version if snapshot is not None else ""
        endpoints = envoy.endpoints()
        values = {
            "connected": float(envoy.connected),
            "version": _counter_part(version, version),
            "acknowledged": _counter_part(endpoints.accepted, version),
            "up_to_date": float(bool(version) and endpoints.accepted == version),
            "rejected": float(bool(endpoints.rejected) and endpoints.rejected == version),
        }
        for key, family in families.items():
            family.add_metric([envoy.node_id], values[key])
    yield from families.values()


STATES = [s for s in rollout_pb2.SessionState.values() if s != 0]


def _counter_part(version: str, current: str) -> float:
    """N of "EPOCH.N" when its epoch is the current version's, else 0."""
    epoch, _, n = version.partition(".")
    if not n.isdigit() or epoch != current.partition(".")[0]:
        return 0.0
    return float(n)


# ----------------------------------------------------------------------------------- inference


def inference_metrics(servicer) -> Callable[[], Iterable[Metric]]:
    """The inference server's: Generate calls, tokens, time queued, calls in flight and held by a
    pause (its queue), and the policy version it serves."""

    def collect() -> Iterator[Metric]:
        counts = servicer.counts
        yield _labelled(
            CounterMetricFamily,
            "polar_inference_calls",
            "Generate calls finished",
            "outcome",
            {"completed": counts.completed, "failed": counts.failed},
        )
        yield _counter("polar_inference_prompt_tokens", "prompt tokens of finished calls", counts.prompt_tokens)
        yield _counter(
            "polar_inference_completion_tokens", "tokens sampled by finished calls", counts.completion_tokens
        )
        yield _counter(
            "polar_inference_queue_seconds", "seconds calls waited in the engine's queue", counts.queue_seconds
        )
        gate = servicer.gate
        yield _gauge("polar_inference_in_flight", "Generate calls admitted and not finished", gate.in_flight)
        yield _gauge("polar_inference_waiting", "Generate calls held by a pause (a weight update)", gate.waiting)
        yield _gauge("polar_inference_paused", "1 while paused for a weight update", float(gate.paused))
        yield _gauge("polar_inference_policy_version", "the policy version the engine serves", servicer.policy_version)

    return collect


# ------------------------------------------------------------------------------- gateway, node


def gateway_metrics(store, started_cpu_s: float | None = None) -> Callable[[], Iterable[Metric]]:
    """The gateway's: calls recorded, their tokens, sessions open, calls in flight, and the
    process's CPU seconds per recorded call since it started."""
    start = time.process_time() if started_cpu_s is None else started_cpu_s

    def collect() -> Iterator[Metric]:
        counts = store.counts
        yield _labelled(
            CounterMetricFamily,
            "polar_gateway_calls",
            "model calls recorded",
            "outcome",
            {"completed": store.calls_total - counts.failed, "failed": counts.failed},
        )
        yield _counter("polar_gateway_prompt_tokens", "prompt tokens of recorded calls", counts.prompt_tokens)
        yield _counter("polar_gateway_completion_tokens", "sampled tokens of recorded calls", counts.completion_tokens)
        yield _gauge("polar_gateway_sessions_open", "sessions open", store.open_sessions())
        yield _gauge("polar_gateway_calls_in_flight", "calls being served", store.calls_in_flight())
        per_call = (time.process_time() - start) / store.calls_total if store.calls_total else 0.0
        yield _gauge(
            "polar_gateway_cpu_seconds_per_call", "process CPU seconds per recorded call since start", per_call
        )

    return collect


def node_metrics(node) -> Callable[[], Iterable[Metric]]:
    """A node's pools (depth and capacity: its queues) and the sessions it holds."""

    def collect() -> Iterator[Metric]:
        pools = node.pool_status()
        yield _labelled(
            GaugeMetricFamily, "polar_node_pool_depth", "work in each pool", "pool", {p.name: p.depth for p in pools}
        )
        yield _labelled(
            GaugeMetricFamily,
            "polar_node_pool_capacity",
            "each pool's capacity",
            "pool",
            {p.name: p.capacity for p in pools},
        )
        yield _gauge("polar_node_sessions", "sessions the node holds", len(node.runs))

    return collect


# ------------------------------------------------------------------------------------- trainer


def trainer_metrics(run) -> Callable[[], Iterable[Metric]]:
    """The trainer's: step, policy version, what it consumed, and its latest metrics row."""

    def collect() -> Iterator[Metric]:
        state = run.state
        with run.status_lock:
            last = dict(run.last_metrics)
        yield _gauge("polar_trainer_step", "steps done", state.step)
        yield _gauge("polar_trainer_policy_version", "the policy version last pushed", state.policy_version)
        yield _counter("polar_trainer_trained_tokens", "tokens trained on", state.trained_tokens)
        yield _counter(
            "polar_trainer_groups_consumed", "GRPO groups taken from the results stream", state.groups_consumed
        )
        numbers = {k: float(v) for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        yield _labelled(
            GaugeMetricFamily, "polar_trainer_last", "the latest step's metrics.jsonl values", "metric", numbers
        )

    return collect


# --------------------------------------------------------------------------------------- envoy


class EnvoyStats:
    """Envoy's own statistics beside its service's: `read` (blocking, bounded by its own timeout)
    returns the admin interface's /stats/prometheus text, or None when Envoy does not answer.
    `text` reads it for a scrape, to append; `collect` then says whether that scrape has it."""

    def __init__(self, read: Callable[[], str | None]) -> None:
        self._read = read
        self.available = False  # whether the latest read got Envoy's answer

    async def text(self) -> bytes:
        stats = await asyncio.to_thread(self._read)
        self.available = stats is not None
        return stats.encode() if stats is not None else b""

    def collect(self) -> Iterator[Metric]:
        # A scrape reads, then collects without yielding to the loop: the value is that read's.
        yield _gauge(
            "polar_envoy_stats_available",
            "1 when this scrape holds Envoy's own statistics (envoy_*); 0 when"
            " its admin interface did not answer in time",
            float(self.available),
        )
