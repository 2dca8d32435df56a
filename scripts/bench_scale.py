"""Inference servers behind Envoy on its control plane: throughput as servers are added, how soon a
joining server takes calls, and what the xDS path costs against a static config.

Real processes: a rollout server (Envoy's control plane, `polar serve rollout`), scripted-engine
inference servers (`polar serve inference --rollout ...`, each joining the control plane), and the
real Envoy; the load is Generate calls of CONCURRENCY sessions at once (each with its own
x-polar-session, so Envoy's Maglev hash spreads them), made from this process as the gateway makes
them. Points:

- calls/s and p50 latency with 1, 2 and 4 servers, through Envoy on the control plane, and the p50
  of the same load sent straight to one server (what Envoy adds is the difference at 1 server);
- join → first call: from a server's ready line (it has joined) to the first call it answers, under
  load;
- xDS vs static: two servers behind an Envoy on the control plane and behind one with the same two
  endpoints fixed in its config, in alternating rounds; their calls/s ratio.

    python scripts/bench_scale.py --quick     # under a minute on 2 CPU cores

Prints a table and writes JSON (default bench-results/scale.json). On a shared machine only the
ratios measured side by side mean much.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from polar import envoy
from polar.app.stack import Service, inference_spec, rollout_spec, running
from polar.config import EnvoyConfig, InferenceConfig, RolloutConfig
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

import benchmark_common

CONCURRENCY = 32
TOKENS_PER_CALL = 8
FIRST_TOKEN = 10  # server i answers tokens starting at FIRST_TOKEN + 10 * i: a reply names its server


def main() -> int:
    args = benchmark_common.parser(
        __doc__, "short windows, 1 and 2 servers (under a minute)", "scale.json"
    ).parse_args()
    window_s, rounds = (2.0, 2) if args.quick else (8.0, 5)
    counts = (1, 2) if args.quick else (1, 2, 4)
    with tempfile.TemporaryDirectory(prefix="polar-bench-scale-") as scratch, contextlib.ExitStack() as stack:
        folder = Path(scratch)
        rollout = stack.enter_context(
            running(
                rollout_spec(RolloutConfig(port=0, store=str(folder / "rollout.db"), heartbeat_interval_s=0.2)), 60, 10
            )
        )
        control_plane = rollout.dial_address
        servers: list[Service] = []
        scaling = []
        with _envoy(EnvoyConfig(xds_address=control_plane)) as xds_envoy:
            for count in counts:
                while len(servers) < count:
                    servers.append(stack.enter_context(_inference(folder, len(servers), control_plane)))
                _wait_for_hosts(xds_envoy, count)
                rate, p50 = asyncio.run(_load(f"127.0.0.1:{xds_envoy.inference_port}", window_s))
                _, direct_p50 = asyncio.run(_load(servers[0].dial_address, window_s))
                scaling.append({"servers": count, "calls_per_s": rate, "p50_ms": p50, "direct_p50_ms": direct_p50})
            join_s = asyncio.run(_join_to_first_call(stack, folder, len(servers), control_plane, xds_envoy))
        endpoints = [s.dial_address for s in servers[:2]]
        compare: dict[str, list[float]] = {"xds": [], "static": []}
        for round_index in range(rounds):
            for setup in ("xds", "static") if round_index % 2 == 0 else ("static", "xds"):
                config = EnvoyConfig(xds_address=control_plane if setup == "xds" else "")
                with _envoy(config, [] if setup == "xds" else endpoints) as proxy:
                    _wait_for_hosts(proxy, 2)
                    compare[setup].append(asyncio.run(_load(f"127.0.0.1:{proxy.inference_port}", window_s))[0])
    report = {
        "machine": benchmark_common.machine("grpcio"),
        "window_s": window_s,
        "concurrency": CONCURRENCY,
        "scaling": scaling,
        "join_to_first_call_s": join_s,
        "xds_vs_static": {
            "xds_calls_per_s": compare["xds"],
            "static_calls_per_s": compare["static"],
            "ratio": statistics.median(x / s for x, s in zip(compare["xds"], compare["static"])),
        },
    }
    _print_table(report)
    benchmark_common.write_json(report, args.out, "scale.json")
    return 0


@contextlib.contextmanager
def _inference(folder: Path, index: int, control_plane: str) -> Iterator[Service]:
    script = folder / f"script-{index}.json"
    first = FIRST_TOKEN + 10 * index
    script.write_text(
        json.dumps({"cycle": True, "outputs": [{"token_ids": list(range(first, first + TOKENS_PER_CALL))}]})
    )
    config = InferenceConfig(engine="scripted", script=str(script), port=0, rollout_address=control_plane)
    with running(inference_spec(config), 60, 10) as service:
        yield service


@contextlib.contextmanager
def _envoy(config: EnvoyConfig, inference: list[str] | None = None) -> Iterator[envoy.RunningEnvoy]:
    config.harness_port = config.inference_port = config.admin_port = 0
    config.health_check_interval_s = 0.2
    config.access_log = os.devnull
    text = envoy.render_config(config, inference or [], "127.0.0.1:9")
    with envoy.running(text, workers=config.workers) as proxy:
        yield proxy


def _wait_for_hosts(proxy: envoy.RunningEnvoy, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        text = envoy.admin_get(proxy.admin, "/clusters") or ""
        healthy = [
            line
            for line in text.splitlines()
            if line.startswith("inference::") and line.endswith("::health_flags::healthy")
        ]
        if len(healthy) == count:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"Envoy did not have {count} healthy inference servers within {timeout_s:g} s")
        time.sleep(0.05)


async def _load(target: str, window_s: float) -> tuple[float, float]:
    """calls/s and p50 ms of CONCURRENCY sessions calling Generate back to back for window_s."""
    latencies: list[float] = []
    sessions = itertools.count()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        deadline = time.perf_counter() + window_s

        async def session() -> None:
            metadata = (("x-polar-session", f"s-{next(sessions)}"),)
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async for _ in stub.Generate(_request(), metadata=metadata, timeout=30):
                    pass
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(session() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, 1000 * statistics.median(latencies)


async def _join_to_first_call(
    stack: contextlib.ExitStack, folder: Path, index: int, control_plane: str, proxy: envoy.RunningEnvoy
) -> float:
    """Seconds from a new server's ready line (it has joined) to the first call it answers, while
    new sessions keep calling through Envoy."""
    first = FIRST_TOKEN + 10 * index
    found = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        sessions = itertools.count()

        async def caller() -> None:
            while not found.is_set():
                metadata = (("x-polar-session", f"join-{next(sessions)}"),)
                async for message in stub.Generate(_request(), metadata=metadata, timeout=30):
                    if message.token_ids and message.token_ids[0] == first:
                        found.set()

        callers = [asyncio.create_task(caller()) for _ in range(8)]
        await asyncio.to_thread(stack.enter_context, _inference(folder, index, control_plane))
        joined = time.perf_counter()
        await asyncio.wait_for(found.wait(), 30)
        took = time.perf_counter() - joined
        await asyncio.gather(*callers)
    return took


def _request() -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=TOKENS_PER_CALL, temperature=0)
    )


def _print_table(report: dict) -> None:
    rows = [
        (str(row["servers"]), f"{row['calls_per_s']:.0f}", f"{row['p50_ms']:.2f}", f"{row['direct_p50_ms']:.2f}")
        for row in report["scaling"]
    ]
    benchmark_common.print_table(("servers", "calls/s", "p50 ms", "direct p50 ms"), rows, left=0)
    print(f"join -> first call: {report['join_to_first_call_s'] * 1000:.0f} ms")
    compare = report["xds_vs_static"]
    print(
        f"xDS vs static (2 servers, alternating rounds): {statistics.median(compare['xds_calls_per_s']):.0f} vs"
        f" {statistics.median(compare['static_calls_per_s']):.0f} calls/s, median ratio {compare['ratio']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
