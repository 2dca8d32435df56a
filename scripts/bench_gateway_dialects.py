"""Gateway overhead: requests/s and added latency of every API dialect, via Envoy and direct.

The stack is `polar up`'s, each service in its own process (gateway_stack.py): a gateway behind Envoy
and one beside it, in front of an inference server whose scripted engine replies at once, loaded by
worker processes (gateway_load.py) with a harness-sized conversation (a coding agent's system prompt
and a short task, about 500 tokens) in each dialect. A point is one (route, dialect, streaming or
not, concurrent sessions); the baseline at each number of sessions is the inference server called
directly over gRPC with the prompt ids the gateway rendered (read back from the gateway's call
record). Added latency p50/p99 = the point's p50/p99 minus the baseline's at the same number of
sessions. At 1 session, the added latency is the gateway's own cost per request, and a shared machine
drifts by as much from one second to the next: those points alternate with their baseline in short
rounds (baseline, gateway, baseline, …) and pool each side's requests over the rounds. Targets: added
p50 at 1 session under 2 ms whole and 3 ms streamed.

    python scripts/bench_gateway_dialects.py --quick     # under a minute on 2 CPU cores
    python scripts/bench_gateway_dialects.py             # every point, a few minutes

Credentials: by default every Polar service runs with the stack's credentials, as `polar up` runs them
(each gRPC call carries its role's token and every server checks it; polar.credentials);
`--credentials off` runs them open. bench_gateway_credentials.py measures what the check costs.

Prints a table and writes JSON (default bench-results/gateway_dialects.json).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from polar import credentials as creds

import benchmark_common
from gateway_load import LATENCY_NOTE, Bench, Point, Settings, header, print_failures
from gateway_load import parser as gateway_parser
from gateway_stack import (
    DIALECTS,
    baseline_target,
    dialect_target,
    polar_stack,
    probe_prompt,
    reply_pieces,
    sharing_note,
)

SESSIONS = (1, 64, 256)
QUICK_SESSIONS = (1, 64)
# --quick: every point of Anthropic Messages (the dialect compared with LiteLLM), the other dialects'
# direct at PARTIAL_SESSIONS only.
QUICK_FULL_DIALECTS = ("anthropic",)
PARTIAL_SESSIONS = 64
TARGET_ADDED_P50_MS = {False: 2.0, True: 3.0}  # at 1 session: whole, streamed


def main() -> int:
    args = gateway_parser(__doc__, "fewer points, short windows: under a minute", "gateway_dialects.json").parse_args()
    settings = Settings(
        quick=args.quick,
        workers=args.workers,
        warmup_s=0.2 if args.quick else 0.5,
        window_s=0.8 if args.quick else 3.0,
        paired_rounds=3 if args.quick else 6,
        paired_warmup_s=0.1 if args.quick else 0.2,
    )
    sessions = QUICK_SESSIONS if args.quick else SESSIONS
    full_dialects = QUICK_FULL_DIALECTS if args.quick else DIALECTS
    load_before = os.getloadavg()[0]
    machine = benchmark_common.machine("aiohttp", "grpcio")
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-gateway-") as scratch, contextlib.ExitStack() as stack:
        issued = creds.ensure(Path(scratch) / "credentials") if args.credentials == "on" else None
        bench = Bench(settings)
        stack.callback(bench.close)
        polar = stack.enter_context(polar_stack(Path(scratch), (), issued))
        bench.processes |= polar.pids
        prompt = probe_prompt(polar)
        print(f"\nmachine: {machine['cpu']} ({machine['cpu_cores']} cores), load average before: {load_before:.2f}")
        print(header(), flush=True)
        baseline: dict[int, Point] = {}
        for n in sessions:
            baseline[n] = bench.point(baseline_target(polar, prompt, n))
            points.append(baseline[n])
        for dialect in DIALECTS:
            full = dialect in full_dialects
            for stream in (False, True):
                for route in ("direct", "envoy") if full else ("direct",):
                    for n in sessions if full else (PARTIAL_SESSIONS,):
                        target = dialect_target(polar, route, dialect, stream, n)
                        if n == 1:
                            # One session's added latency is the gateway's own cost: measured in
                            # rounds alternating with the baseline (its figures are in the JSON).
                            [(_, point)] = bench.paired((target, baseline_target(polar, prompt, 1)))
                            points.append(point)
                        else:
                            # With more sessions, latency is queueing: compare requests/s and CPU.
                            points.append(bench.point(target, baseline[n]))
    load_after = os.getloadavg()[0]  # the bench's own load included
    _print_summary(points)
    print(f"load average: {load_before:.2f} before the run, {load_after:.2f} after it")
    report = {
        "machine": machine,
        "settings": asdict(settings)
        | {
            "sessions": sessions,
            "full_dialects": full_dialects,
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_after,
            "reply_tokens": len(reply_pieces()) + 1,
            "credentials": args.credentials,
        },
        "shares_the_cpu": sharing_note(settings.workers),
        "latency_note": LATENCY_NOTE,
        "points": [asdict(p) for p in points],
    }
    benchmark_common.write_json(report, args.out, "gateway_dialects.json")
    return 0


def _print_summary(points: list[Point]) -> None:
    print()
    for p in points:
        if p.system == "polar" and p.sessions == 1 and not math.isnan(p.added_p50_ms):
            target = TARGET_ADDED_P50_MS[p.stream]
            verdict = "meets" if p.added_p50_ms < target else "misses"
            print(
                f"added p50 at 1 session, {p.dialect} {'stream' if p.stream else 'whole'} via {p.route}: "
                f"{p.added_p50_ms:.2f} ms ({verdict} < {target:g} ms)"
            )
    print_failures(points)
    print("\n" + LATENCY_NOTE)


if __name__ == "__main__":
    sys.exit(main())
