"""The gateway benchmarks' load: points, the load worker processes that make them, and their table.

A point is one target (a system at an address: the gateway, via Envoy or direct, LiteLLM's proxy, or
a baseline) loaded by a number of concurrent sessions: each session has its own keep-alive connection
(or, for gRPC, the worker's one channel, as the gateway has one) and loops its requests for a warm-up
and then a fixed window. Requests that complete inside the window count; requests/s is those over the
window; latency is a request's send to its last byte. The load is spread over worker processes (HTTP
through http_client: pre-encoded requests, no SDK, no JSON parsing; a reply counts when its status is
200 and it holds its dialect's final marker; gRPC through grpc.aio). All processes share the
machine's cores: a point reports each named process's CPU time per request (its threads' time on a
CPU, in nanoseconds where the kernel keeps schedstats), and a bench's report the machine's 1-minute
load average before the run, how busy other work kept it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc

from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

import benchmark_common
from http_client import HttpConnection

# Slow targets (LiteLLM streaming, replayed harness-sized requests at 64 sessions: over a second a
# request here) get a warm-up and window long enough for every session to finish requests inside
# the window, even with --quick.
SLOW_WARMUP_S = 2.0
SLOW_WINDOW_S = 3.0
DRAIN_TIMEOUT_S = 30.0  # how long requests in flight at a window's end may take to finish
STOP_TIMEOUT_S = 10.0
LATENCY_NOTE = (
    "Added latency is the gateway's at 1 session: its p50 minus the baseline's, both pooled over rounds "
    "that alternate between them. "
    "At 64 and 256 sessions every point is CPU-bound on the shared cores, so latency there is mostly "
    "queueing, and the gRPC baseline's own Python client costs more CPU per request than the HTTP load "
    "generator: added latency there can be negative and is not the gateway's cost; compare requests/s and "
    "CPU µs/request instead."
)


def parser(doc: str, quick: str, out: str, credentials: bool = True) -> argparse.ArgumentParser:
    """benchmark_common's parser with the gateway benchmarks' own flags: --workers and, unless the bench
    decides itself, --credentials."""
    result = benchmark_common.parser(doc, quick, out)
    result.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="load generator processes (default: one per core, %(default)s)",
    )
    if credentials:
        result.add_argument(
            "--credentials",
            choices=("on", "off"),
            default="on",
            help="run the services with the stack's credentials (on, as `polar up`) or without them (off)",
        )
    return result


@dataclass
class Point:
    """One measurement: a target at one number of concurrent sessions."""

    system: str  # polar, litellm, or the baseline: inference (gRPC) / backend (LiteLLM's)
    route: str  # envoy, direct (to the gateway or proxy), grpc (baseline)
    dialect: str
    stream: bool
    sessions: int
    seconds: float  # the measurement window
    requests: int  # completed well-formed inside the window
    errors: int  # completed inside the window with another status or without the final marker
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float = math.nan  # over the baseline at the same number of sessions
    added_p99_ms: float = math.nan
    baseline_p50_ms: float = math.nan  # the baseline's figures they are over
    baseline_p99_ms: float = math.nan
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)  # per process: gateway, envoy, …
    # Paired points: per process, the least CPU per request of any round, the one the machine's
    # other work disturbed least (pooled figures carry its drift, ±30% here from minute to minute).
    quietest_round_cpu_us: dict[str, float] = field(default_factory=dict)
    first_error: str = ""

    def over(self, baseline: Point) -> None:
        """Set the added latency over the baseline's."""
        self.baseline_p50_ms, self.baseline_p99_ms = baseline.p50_ms, baseline.p99_ms
        self.added_p50_ms = self.p50_ms - baseline.p50_ms
        self.added_p99_ms = self.p99_ms - baseline.p99_ms


@dataclass(frozen=True)
class Target:
    """What a point loads: a system at an address, its requests (one per session) and its final marker."""

    system: str
    route: str
    dialect: str
    stream: bool
    kind: str  # "http" or "grpc"
    address: str
    payloads: tuple[Payload, ...]
    marker: bytes | tuple[bytes, ...]
    cpu_of: tuple[str, ...]  # the processes whose CPU time the point reports
    metadata: tuple[tuple[str, str], ...] = ()  # gRPC: sent with every call (a role's credential)


# A session's requests: one, looped, or a sequence replayed in order, then again from its start.
Payload = bytes | tuple[bytes, ...]


def _good(body: bytes, marker: bytes | tuple[bytes, ...]) -> bool:
    """Whether a reply holds its final marker (any of them, for a target that mixes dialects)."""
    return any(m in body for m in marker) if isinstance(marker, tuple) else marker in body


@dataclass(frozen=True)
class Job:
    """What one worker process runs for a point."""

    kind: str  # "http" or "grpc"
    address: str  # host:port
    payloads: tuple[Payload, ...]  # one per session: whole HTTP requests, or a serialized GenerateRequest
    marker: bytes | tuple[bytes, ...]  # HTTP: what a good reply holds
    start_at: float  # time.monotonic() (one clock for every process) when sessions start
    warmup_s: float
    window_s: float
    metadata: tuple[tuple[str, str], ...] = ()  # gRPC: sent with every call


@dataclass
class JobResult:
    latencies_ms: list[float]
    errors: int
    first_error: str


def _worker_main(conn: Connection) -> None:
    """A load worker: run each Job it is sent, answer its JobResult; None ends it."""
    while (job := conn.recv()) is not None:
        conn.send(asyncio.run(_run_job(job)))


async def _run_job(job: Job) -> JobResult:
    result = JobResult([], 0, "")
    if not job.payloads:
        return result
    window_start = job.start_at + job.warmup_s
    window_end = window_start + job.window_s
    open_sessions = _grpc_sessions if job.kind == "grpc" else _http_sessions
    sessions, close = await open_sessions(job, result, window_start, window_end)
    try:
        await asyncio.sleep(max(0.0, job.start_at - time.monotonic()))
        tasks = [asyncio.ensure_future(session) for session in sessions]
        # Requests in flight when the window ends no longer count but are let finish: a client that
        # leaves mid-request is another workload (the server aborts and records the call). Only a
        # hung target is given up on.
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, window_end - time.monotonic()) + DRAIN_TIMEOUT_S)
        for task in pending:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception):  # not the cancellation: a session that broke down
                result.errors += 1
                result.first_error = result.first_error or f"a session failed: {outcome!r}"
    finally:
        await close()
    return result


# A job's sessions (coroutines, started together) and how to close what they hold.
Sessions = tuple[list[Coroutine[Any, Any, None]], Callable[[], Awaitable[None]]]


async def _http_sessions(job: Job, result: JobResult, window_start: float, window_end: float) -> Sessions:
    host, _, port = job.address.rpartition(":")
    loop = asyncio.get_running_loop()
    # Connections are made before the start, so the window measures requests, not handshakes.
    connections = [(await loop.create_connection(HttpConnection, host, int(port)))[1] for _ in job.payloads]

    async def session(index: int, payload: Payload) -> None:
        requests = payload if isinstance(payload, tuple) else (payload,)
        turn = 0
        while (started := time.monotonic()) < window_end:
            request, turn = requests[turn], (turn + 1) % len(requests)
            try:
                status, body = await connections[index].request(request)
            except ConnectionError as exc:
                status, body = 0, str(exc).encode()
                connections[index] = (await loop.create_connection(HttpConnection, host, int(port)))[1]
            done = time.monotonic()
            if window_start <= done <= window_end:
                if status == 200 and _good(body, job.marker):
                    result.latencies_ms.append((done - started) * 1000)
                else:
                    result.errors += 1
                    result.first_error = result.first_error or f"HTTP {status}: {body[:300]!r}"

    async def close() -> None:
        for connection in connections:
            connection.close()

    return [session(i, p) for i, p in enumerate(job.payloads)], close


async def _grpc_sessions(job: Job, result: JobResult, window_start: float, window_end: float) -> Sessions:
    channel = grpc.aio.insecure_channel(job.address)
    await channel.channel_ready()
    stub = inference_pb2_grpc.InferenceServiceStub(channel)

    async def session(request: inference_pb2.GenerateRequest) -> None:
        metadata = (("x-polar-session", request.session_id), *job.metadata)  # as the gateway sends it
        while (started := time.monotonic()) < window_end:
            finish = 0
            try:
                async for message in stub.Generate(request, metadata=metadata):
                    finish = message.finish_reason or finish
            except grpc.aio.AioRpcError as exc:
                result.first_error = result.first_error or f"gRPC {exc.code().name}: {exc.details()}"
            done = time.monotonic()
            if window_start <= done <= window_end:
                if finish == common_pb2.FINISH_REASON_STOP:
                    result.latencies_ms.append((done - started) * 1000)
                else:
                    result.errors += 1

    requests = [inference_pb2.GenerateRequest.FromString(p) for p in job.payloads]
    return [session(r) for r in requests], channel.close


@dataclass
class Settings:
    """How a bench loads its points."""

    quick: bool
    workers: int  # load worker processes
    warmup_s: float
    window_s: float
    paired_rounds: int  # paired points: rounds alternating with the baseline, window_s split over them
    paired_warmup_s: float  # each round's warm-up


class Bench:
    """The load workers and the processes whose CPU time a point reports."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs gRPC threads
        self._workers: list[tuple[multiprocessing.Process, Connection]] = []
        for _ in range(settings.workers):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(child,), daemon=True)
            process.start()
            self._workers.append((process, parent))
        self.processes: dict[str, int] = {}  # name → pid, for CPU accounting

    def close(self) -> None:
        for process, conn in self._workers:
            conn.send(None)
            process.join(STOP_TIMEOUT_S)

    def measure(self, target: Target, warmup_s: float, window_s: float) -> Measurement:
        """Load the target for a warm-up and a window; what completed inside the window."""
        payloads = target.payloads
        # Far enough ahead for every worker to connect its sessions first.
        start_at = time.monotonic() + 0.05 + 0.002 * len(payloads)
        shares = [payloads[i :: len(self._workers)] for i in range(len(self._workers))]
        for (_, conn), share in zip(self._workers, shares):
            job = Job(
                target.kind, target.address, tuple(share), target.marker, start_at, warmup_s, window_s, target.metadata
            )
            conn.send(job)
        pids = {name: self.processes[name] for name in target.cpu_of}
        pids |= {f"load{i}": process.pid for i, (process, _) in enumerate(self._workers) if shares[i]}
        time.sleep(max(0.0, start_at + warmup_s - time.monotonic()))
        before = {name: benchmark_common.thread_cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(max(0.0, start_at + warmup_s + window_s - time.monotonic()))
        cpu = {name: benchmark_common.thread_cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        measured = Measurement(window_s)
        for _, conn in self._workers:
            result: JobResult = conn.recv()
            measured.latencies_ms += result.latencies_ms
            measured.errors += result.errors
            measured.first_error = measured.first_error or result.first_error
        load = sum(v for k, v in cpu.items() if k.startswith("load"))
        measured.cpu_s = {k: v for k, v in cpu.items() if not k.startswith("load")} | {"load": load}
        return measured

    def point(self, target: Target, baseline: Point | None = None, slow: bool = False, show: bool = True) -> Point:
        """One point, printed unless `show` is off; `slow` for a target whose requests may outlast
        --quick's warm-up and window."""
        warmup, window = self.settings.warmup_s, self.settings.window_s
        if slow:
            warmup, window = max(warmup, SLOW_WARMUP_S), max(window, SLOW_WINDOW_S)
        point = self.measure(target, warmup, window).point(target, len(target.payloads))
        if baseline is not None:
            point.over(baseline)
        if show:
            print(row(point), flush=True)
        return point

    def paired(self, *pairs: tuple[Target, Target]) -> list[tuple[Point, Point]]:
        """Each (target, baseline) pair measured in alternating rounds (baseline, target, the next
        pair's baseline and target, …, then the first pair again) and each side pooled over its
        rounds: other work on a shared machine drifts by more than a millisecond from one second to
        the next, and every side sees the same drift, so targets measured together compare. Each
        target's point is printed with its added latency over its pooled baseline; returned as
        (baseline, target) points."""
        rounds = self.settings.paired_rounds
        warmup, window = self.settings.paired_warmup_s, self.settings.window_s / rounds
        pooled = [(Measurement(0.0), Measurement(0.0), dict[str, float]()) for _ in pairs]
        for _ in range(rounds):
            for (target, baseline), (pooled_target, pooled_baseline, quietest) in zip(pairs, pooled):
                pooled_baseline.add(self.measure(baseline, warmup, window))
                measured = self.measure(target, warmup, window)
                pooled_target.add(measured)
                for name, us in measured.point(target, len(target.payloads)).cpu_us_per_request.items():
                    quietest[name] = min(quietest.get(name, math.inf), us)
        results = []
        for (target, baseline), (pooled_target, pooled_baseline, quietest) in zip(pairs, pooled):
            reference = pooled_baseline.point(baseline, len(baseline.payloads))
            point = pooled_target.point(target, len(target.payloads))
            point.quietest_round_cpu_us = quietest
            point.over(reference)
            print(row(point), flush=True)
            results.append((reference, point))
        return results


@dataclass
class Measurement:
    """What one or more windows on one target measured."""

    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, over the windows

    def add(self, other: Measurement) -> None:
        self.seconds += other.seconds
        self.latencies_ms += other.latencies_ms
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error
        for name, seconds in other.cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds

    def point(self, target: Target, sessions: int) -> Point:
        requests = len(self.latencies_ms)
        return Point(
            target.system,
            target.route,
            target.dialect,
            target.stream,
            sessions,
            self.seconds,
            requests,
            self.errors,
            requests / self.seconds,
            percentile(self.latencies_ms, 50),
            percentile(self.latencies_ms, 99),
            cpu_us_per_request={k: v / requests * 1e6 if requests else math.nan for k, v in self.cpu_s.items()},
            first_error=self.first_error,
        )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


COLUMNS = (
    "system",
    "route",
    "dialect",
    "stream",
    "sess",
    "req/s",
    "p50 ms",
    "p99 ms",
    "+p50",
    "+p99",
    "err",
    "CPU µs/req",
)
WIDTHS = (9, 6, 16, 6, 4, 8, 7, 7, 7, 7, 4, 0)


def header() -> str:
    """The table's header: its rows are printed as their points are measured, so its widths are fixed."""
    return benchmark_common.table_row(COLUMNS, WIDTHS, left=4)


def row(p: Point) -> str:
    def ms(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.2f}"

    cpu = " ".join(f"{k}={v:.0f}" for k, v in p.cpu_us_per_request.items() if not math.isnan(v))
    cells = (
        p.system,
        p.route,
        p.dialect,
        "yes" if p.stream else "no",
        str(p.sessions),
        f"{p.requests_per_s:,.0f}",
        ms(p.p50_ms),
        ms(p.p99_ms),
        ms(p.added_p50_ms),
        ms(p.added_p99_ms),
        str(p.errors),
        cpu,
    )
    return benchmark_common.table_row(cells, WIDTHS, left=4)


def find(points: list[Point], system: str, route: str, dialect: str, stream: bool, sessions: int) -> Point | None:
    """The point of this target and number of sessions, if it was measured."""
    wanted = (system, route, dialect, stream, sessions)
    return next((p for p in points if (p.system, p.route, p.dialect, p.stream, p.sessions) == wanted), None)


def print_failures(points: list[Point]) -> None:
    """A line for each point with errors or without a good request."""
    for p in points:
        if p.errors or not p.requests:
            print(
                f"{p.system} {p.route} {p.dialect} stream={p.stream} {p.sessions} sessions: {p.errors} errors, "
                f"{p.requests} good; first error: {p.first_error or '-'}"
            )
