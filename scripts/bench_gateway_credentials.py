"""What the credential check costs the gateway: the same points on a stack with the stack's
credentials and on one without, side by side.

Every Polar service checks each gRPC call's credential (polar.credentials), as `polar up` runs them.
Two stacks (gateway_stack.py), one with credentials and one without, are loaded with the same points
(gateway_load.py): Anthropic Messages at 64 sessions, whole and streamed, via Envoy and (without
--quick) direct, and the gRPC baseline, in rounds that alternate which stack goes first, so that drift
on a shared machine falls on both. Per point: the median requests/s of each side and their ratio
(budget: the check costs at most 2%), the CPU time per request of the gateway (or the inference server
for the baseline) pooled over the rounds, the steadier figure on a busy machine, and the check's own
time as a share of it.

    python scripts/bench_gateway_credentials.py --quick     # under a minute on 2 CPU cores

Prints a table and writes JSON (default bench-results/gateway_credentials.json).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from polar import credentials as creds

import benchmark_common
from gateway_load import Bench, Measurement, Settings, Target, percentile
from gateway_load import parser as gateway_parser
from gateway_stack import baseline_target, dialect_target, polar_stack, probe_prompt

SESSIONS = 64
DIALECT = "anthropic"
CREDENTIAL_BUDGET_PCT = 2.0  # what the credential check may cost in requests/s
SETUPS = ("open", "checked")  # the stack without credentials, and with them


def main() -> int:
    """The same points on a stack without credentials and one with them, in rounds that alternate
    which goes first; medians of requests/s per side, CPU per request pooled."""
    quick = "fewer points, short windows: under a minute"
    args = gateway_parser(__doc__, quick, "gateway_credentials.json", credentials=False).parse_args()
    settings = Settings(
        quick=args.quick,
        workers=args.workers,
        warmup_s=0.2 if args.quick else 0.5,
        window_s=0.8 if args.quick else 3.0,
        paired_rounds=1,  # no paired points here: the two stacks alternate instead
        paired_warmup_s=0.0,
    )
    rounds = 6 if args.quick else 8
    routes = ("envoy",) if args.quick else ("envoy", "direct")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="polar-bench-gateway-") as scratch, contextlib.ExitStack() as stack:
        issued = creds.ensure(Path(scratch) / "credentials")
        bench = Bench(settings)
        stack.callback(bench.close)
        stacks = {
            setup: stack.enter_context(polar_stack(Path(scratch) / setup, (), issued if setup == "checked" else None))
            for setup in SETUPS
        }
        for setup, polar in stacks.items():
            bench.processes |= {f"{setup}/{name}": pid for name, pid in polar.pids.items()}
        prompt = probe_prompt(stacks["open"])
        # What each point loads, per stack: (label, the process whose CPU it is about, targets by setup).
        baselines = {setup: baseline_target(polar, prompt, SESSIONS, f"{setup}/") for setup, polar in stacks.items()}
        points: list[tuple[str, str, dict[str, Target]]] = [
            (f"inference gRPC, {SESSIONS} sessions", "inference", baselines)
        ]
        for route in routes:
            for stream in (False, True):
                label = f"{DIALECT} {'stream' if stream else 'whole'} via {route}, {SESSIONS} sessions"
                targets = {
                    setup: dialect_target(polar, route, DIALECT, stream, SESSIONS, f"{setup}/")
                    for setup, polar in stacks.items()
                }
                points.append((label, f"gateway_{route}", targets))
        measured: dict[str, dict[str, list[Measurement]]] = {label: {s: [] for s in SETUPS} for label, _, _ in points}
        for round_index in range(rounds):
            order = SETUPS if round_index % 2 == 0 else SETUPS[::-1]
            for label, _, targets in points:
                for setup in order:
                    measured[label][setup].append(bench.measure(targets[setup], settings.warmup_s, settings.window_s))
            print(f"  round {round_index + 1}/{rounds} done", flush=True)
    rows = [_credential_row(label, process, measured[label]) for label, process, _ in points]
    check_us = _check_microseconds(issued)
    for row in rows:
        # The check's own time is the one certain part of its cost: as a share of the process's CPU
        # per request, it is what wall-clock figures on a shared machine cannot resolve.
        row["check_share_pct"] = 100 * check_us / row["checked"]["cpu_us_per_request"]
    report = {
        "machine": benchmark_common.machine("aiohttp", "grpcio"),
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
        "rounds": rounds,
        "warmup_s": settings.warmup_s,
        "window_s": settings.window_s,
        "budget_pct": CREDENTIAL_BUDGET_PCT,
        "check_us_per_call": check_us,
        "points": rows,
    }
    _print_table(report)
    benchmark_common.write_json(report, args.out, "gateway_credentials.json")
    return 0


def _check_microseconds(issued: creds.Credentials) -> float:
    """The credential check's own time per Generate call, in-process: the inference server's
    interceptor (polar.grpc_server.CallerCheck) admitting a node's call with the metadata a gateway
    sends, its continuation answering at once."""
    from bench_credentials import CallDetails, interceptor_microseconds

    from polar.grpc_server import CallerCheck
    from polar.inference.server import SERVICE_NAME, InferenceServicer

    check = CallerCheck({SERVICE_NAME: InferenceServicer.roles}, issued)
    metadata = (("x-polar-session", "s-bench"), *issued.metadata(creds.NODE), ("user-agent", "grpc-python"))
    return interceptor_microseconds(check, CallDetails(f"/{SERVICE_NAME}/Generate", metadata))


def _credential_row(label: str, process: str, by_setup: dict[str, list[Measurement]]) -> dict:
    """One point's figures, open vs checked: median requests/s over the rounds, and the CPU time per
    request of `process` pooled over them."""
    row: dict[str, Any] = {"point": label, "process": process}
    for setup, measurements in by_setup.items():
        rates = [len(m.latencies_ms) / m.seconds for m in measurements]
        requests = sum(len(m.latencies_ms) for m in measurements)
        cpu = sum(m.cpu_s.get(f"{setup}/{process}", 0.0) for m in measurements)
        row[setup] = {
            "requests_per_s": statistics.median(rates),
            "requests_per_s_rounds": rates,
            "cpu_us_per_request": cpu / requests * 1e6 if requests else math.nan,
            "p50_ms": percentile([x for m in measurements for x in m.latencies_ms], 50),
            "errors": sum(m.errors for m in measurements),
            "first_error": next((m.first_error for m in measurements if m.first_error), ""),
        }
    open_, checked = row["open"], row["checked"]
    open_rate = open_["requests_per_s"]
    row["throughput_ratio"] = checked["requests_per_s"] / open_rate if open_rate else math.nan
    row["throughput_cost_pct"] = 100 * (1 - row["throughput_ratio"])
    row["cpu_cost_pct"] = 100 * (checked["cpu_us_per_request"] / open_["cpu_us_per_request"] - 1)
    return row


def _print_table(report: dict) -> None:
    print(
        f"\ncredential check cost: median of {report['rounds']} alternating rounds of {report['window_s']:g} s "
        f"({report['machine']['cpu_cores']} cores, load {report['load_average_1min_before']:.2f} before)"
    )
    header = ("point", "req/s open", "checked", "ratio", "CPU µs/req open", "checked", "change")
    rows = [
        (
            row["point"],
            f"{row['open']['requests_per_s']:,.0f}",
            f"{row['checked']['requests_per_s']:,.0f}",
            f"{row['throughput_ratio']:.3f}",
            f"{row['open']['cpu_us_per_request']:,.0f}",
            f"{row['checked']['cpu_us_per_request']:,.0f}",
            f"{row['cpu_cost_pct']:+.1f}%",
        )
        for row in report["points"]
    ]
    benchmark_common.print_table(header, rows, indent="  ")
    for row in report["points"]:
        for setup in SETUPS:
            if row[setup]["errors"]:
                print(f"  {row['point']}, {setup}: {row[setup]['errors']} errors; first: {row[setup]['first_error']}")
    shares = ", ".join(f"{row['check_share_pct']:.2f}%" for row in report["points"])
    print(
        f"ratio: requests/s with credentials over without (budget: at least {1 - report['budget_pct'] / 100:.2f}); "
        "CPU: the named process (the gateway, or the inference server for the gRPC baseline) per request\n"
        f"the check itself: {report['check_us_per_call']:.2f} µs per call, one call per request: {shares} of each "
        "point's CPU per request"
    )


if __name__ == "__main__":
    sys.exit(main())
