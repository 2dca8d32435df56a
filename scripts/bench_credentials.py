"""What the credential check costs: the same servers with and without the stack's credentials.

Every Polar gRPC server checks each call's `authorization` metadata in one interceptor
(polar.grpc_server.CallerCheck); clients send their role's token with every call. Both happen once per
call, never per streamed message, so the gateway's throughput (one inference Generate per harness
request) and the rollout server's (a handful of unary calls per session: heartbeats, the report) pay
it per call. Measured here on real servers (`polar serve ...` subprocesses), alternating the two
setups round by round so that drift on a shared machine falls on both; each point gives calls/s
(wall clock, at the mercy of whatever else runs) and the server process's CPU time per call (the
steadier figure on a busy machine), and the check itself is timed in-process:

- inference (scripted engine): Generate calls/s at 32 concurrent streams, each call a short
  stream of tokens, as the gateway makes them;
- rollout: unary calls/s (GetTaskStatus as the operator) at 32 concurrent callers;
- the interceptor alone: microseconds per allowed call (`CallerCheck.intercept_service`).

    python scripts/bench_credentials.py --quick     # under a minute on 2 CPU cores

Prints a table and writes JSON (default bench-results/credentials.json).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from polar import credentials
from polar.app.stack import inference_spec, rollout_spec, running
from polar.config import InferenceConfig, RolloutConfig
from polar.grpc_server import CallerCheck
from polar.rollout.server import RolloutServicer
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2, rollout_pb2_grpc

import benchmark_common

CONCURRENCY = 32
TOKENS_PER_CALL = 16


def main() -> int:
    quick = "2 s windows instead of 10, 5 rounds instead of 7"
    args = benchmark_common.parser(__doc__, quick, "credentials.json").parse_args()
    window_s, rounds = (2.0, 5) if args.quick else (10.0, 7)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {
        "inference Generate": {"open": [], "checked": []},
        "rollout unary": {"open": [], "checked": []},
    }
    with tempfile.TemporaryDirectory(prefix="polar-bench-credentials-") as scratch:
        scratch_path = Path(scratch)
        issued = credentials.ensure(scratch_path / "credentials")
        script = scratch_path / "script.json"
        script.write_text(json.dumps({"cycle": True, "outputs": [{"token_ids": list(range(5, 5 + TOKENS_PER_CALL))}]}))
        for round_index in range(rounds):
            # Alternate which setup goes first, so a trend on the machine does not favour one.
            order = ("open", "checked") if round_index % 2 == 0 else ("checked", "open")
            for setup in order:
                given = issued if setup == "checked" else None
                results["inference Generate"][setup].append(_inference_rate(script, given, window_s))
                results["rollout unary"][setup].append(
                    _rollout_rate(scratch_path / f"r{round_index}{setup}.db", given, window_s)
                )
    report = {
        "machine": benchmark_common.machine("grpcio"),
        "window_s": window_s,
        "rounds": rounds,
        "concurrency": CONCURRENCY,
        "check_us": _check_microseconds(issued),
        "points": [_point(what, rates) for what, rates in results.items()],
    }
    _print_table(report)
    benchmark_common.write_json(report, args.out, "credentials.json")
    return 0


def _point(what: str, rates: dict[str, list[tuple[float, float]]]) -> dict:
    median = {
        setup: (statistics.median(r for r, _ in runs), statistics.median(c for _, c in runs))
        for setup, runs in rates.items()
    }
    return {
        "what": what,
        "open_per_s": median["open"][0],
        "checked_per_s": median["checked"][0],
        "throughput_overhead_pct": 100 * (1 - median["checked"][0] / median["open"][0]),
        "open_server_cpu_us_per_call": median["open"][1],
        "checked_server_cpu_us_per_call": median["checked"][1],
        "cpu_overhead_pct": 100 * (median["checked"][1] / median["open"][1] - 1),
        "open_rounds": rates["open"],
        "checked_rounds": rates["checked"],
    }


def _check_microseconds(issued: credentials.Credentials) -> float:
    """The interceptor's own time for an allowed call of the rollout server (the operator's)."""
    check = CallerCheck({"polar.v1.RolloutService": RolloutServicer.roles}, issued)
    metadata = issued.metadata(credentials.OPERATOR) + (("user-agent", "grpc-python"),)
    return interceptor_microseconds(check, CallDetails("/polar.v1.RolloutService/GetTaskStatus", metadata))


def interceptor_microseconds(check: CallerCheck, details: CallDetails, calls: int = 20000) -> float:
    """Microseconds per call of `check` admitting `details`, its continuation answering at once."""

    async def continuation(_):
        return None

    async def run() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            await check.intercept_service(continuation, details)
        return (time.perf_counter() - started) / calls * 1e6

    return asyncio.run(run())


@dataclass(frozen=True)
class CallDetails:
    """What grpc hands an interceptor about a call (grpc.HandlerCallDetails' two fields)."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


def _measured(pid: int, run) -> tuple[float, float]:
    """(calls/s, the server's CPU microseconds per call) of one point; `run` returns (calls/s, calls)."""
    cpu_before = benchmark_common.cpu_seconds(pid)
    rate, calls = run()
    return rate, (benchmark_common.cpu_seconds(pid) - cpu_before) / calls * 1e6


def _inference_rate(script: Path, given: credentials.Credentials | None, window_s: float) -> tuple[float, float]:
    spec = inference_spec(InferenceConfig(engine="scripted", script=str(script), port=0))
    with credentials.handed_to_children(given), running(spec, startup_timeout_s=120, stop_timeout_s=10) as server:
        metadata = credentials.metadata(credentials.NODE, given)
        return _measured(
            server.process.pid, lambda: asyncio.run(_generate_loop(server.dial_address, metadata, window_s))
        )


async def _generate_loop(address: str, metadata, window_s: float) -> tuple[float, int]:
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=list(range(32)), sampling=common_pb2.SamplingParams(max_tokens=TOKENS_PER_CALL, temperature=0)
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        async for _ in stub.Generate(request, timeout=30, metadata=metadata):  # warm up
            pass
        return await _count_calls(lambda: _drain(stub.Generate(request, timeout=30, metadata=metadata)), window_s)


async def _drain(call) -> None:
    async for _ in call:
        pass


def _rollout_rate(store: Path, given: credentials.Credentials | None, window_s: float) -> tuple[float, float]:
    spec = rollout_spec(RolloutConfig(port=0, store=str(store)))
    with credentials.handed_to_children(given), running(spec, startup_timeout_s=120, stop_timeout_s=10) as server:
        metadata = credentials.metadata(credentials.OPERATOR, given)
        return _measured(server.process.pid, lambda: asyncio.run(_unary_loop(server.dial_address, metadata, window_s)))


async def _unary_loop(address: str, metadata, window_s: float) -> tuple[float, int]:
    request = rollout_pb2.GetTaskStatusRequest()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.GetTaskStatus(request, timeout=30, metadata=metadata)
        return await _count_calls(lambda: stub.GetTaskStatus(request, timeout=30, metadata=metadata), window_s)


async def _count_calls(make_call, window_s: float) -> tuple[float, int]:
    """(calls completed per second, calls) by CONCURRENCY callers, each looping calls for window_s."""
    done = 0
    deadline = time.monotonic() + window_s

    async def caller() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await make_call()
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
    return done / (time.monotonic() - started), done


def _print_table(report: dict) -> None:
    print(
        f"credential check cost, {report['concurrency']} concurrent callers, median of {report['rounds']} rounds "
        f"of {report['window_s']:g} s ({report['machine']['cpu_cores']} cores)"
    )
    header = ("what", "calls/s open", "checked", "change", "server CPU us/call open", "checked", "change")
    rows = [
        (
            p["what"],
            f"{p['open_per_s']:.0f}",
            f"{p['checked_per_s']:.0f}",
            f"{-p['throughput_overhead_pct']:+.1f}%",
            f"{p['open_server_cpu_us_per_call']:.0f}",
            f"{p['checked_server_cpu_us_per_call']:.0f}",
            f"{p['cpu_overhead_pct']:+.1f}%",
        )
        for p in report["points"]
    ]
    benchmark_common.print_table(header, rows, indent="  ")
    print(f"  the check itself: {report['check_us']:.2f} us per allowed call")


if __name__ == "__main__":
    sys.exit(main())
