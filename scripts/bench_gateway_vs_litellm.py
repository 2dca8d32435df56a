"""Polar's gateway against LiteLLM's proxy: requests/s and CPU per request of Anthropic Messages
requests at 64 concurrent sessions, whole and streamed.

Polar's side is `polar up`'s stack, each service in its own process (gateway_stack.py): its gateway
via Envoy and direct, with the inference server called over gRPC as their baseline. LiteLLM's side
is its proxy translating /v1/messages to chat completions for a scripted backend with the same reply,
and that backend called directly as its baseline (litellm_proxy.py). The load is the same
harness-sized conversation (gateway_load.py: worker processes, each session looping its request for a
warm-up and a window). Per streaming mode and Polar route: the ratio of Polar's requests/s to
LiteLLM's (target: at least 3×), and each one's CPU time per request, the figure other work on a
shared machine disturbs least.

    python scripts/bench_gateway_vs_litellm.py --quick   # under a minute on 2 CPU cores

LiteLLM runs from its own virtual environment (.venv-litellm; create it with
`python3 -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'`); without it, or if
it fails to start, the report says why and Polar's figures stand alone. `--credentials off` runs
Polar's services without the stack's credentials (on by default, as `polar up` runs them).

Prints a table and writes JSON (default bench-results/gateway_vs_litellm.json).
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
from gateway_load import Bench, Point, Settings, Target, find, header, print_failures
from gateway_load import parser as gateway_parser
from gateway_stack import (
    FINAL_MARKERS,
    baseline_target,
    dialect_request,
    dialect_target,
    polar_stack,
    probe_prompt,
    reply_pieces,
    sharing_note,
)
from http_client import send_once
from litellm_proxy import LITELLM_MODEL, LiteLLM, backend_request

SESSIONS = 64
DIALECT = "anthropic"  # the dialect LiteLLM's proxy translates here
TARGET_SPEEDUP = 3.0


def main() -> int:
    args = gateway_parser(__doc__, "short windows: under a minute", "gateway_vs_litellm.json").parse_args()
    settings = Settings(
        quick=args.quick,
        workers=args.workers,
        warmup_s=0.2 if args.quick else 0.5,
        window_s=0.8 if args.quick else 3.0,
        paired_rounds=3 if args.quick else 6,
        paired_warmup_s=0.1 if args.quick else 0.2,
    )
    load_before = os.getloadavg()[0]
    machine = benchmark_common.machine("aiohttp", "grpcio")
    litellm: dict = {"status": "not run", "reason": ""}
    points: list[Point] = []
    pieces = reply_pieces()
    with tempfile.TemporaryDirectory(prefix="polar-bench-gateway-") as scratch, contextlib.ExitStack() as stack:
        issued = creds.ensure(Path(scratch) / "credentials") if args.credentials == "on" else None
        bench = Bench(settings)
        stack.callback(bench.close)
        # LiteLLM starts first, in the background: its start-up (seconds of imports) overlaps Polar's.
        proxy = stack.enter_context(LiteLLM.started(Path(scratch), pieces))
        polar = stack.enter_context(polar_stack(Path(scratch), (), issued))
        bench.processes |= polar.pids
        if not proxy.error:
            # Ready before any measurement: its start-up would take CPU from Polar's points.
            proxy.wait_ready()
        if proxy.error:
            litellm = {"status": "unavailable", "reason": proxy.error}
        else:
            bench.processes |= proxy.pids
        prompt = probe_prompt(polar)
        print(f"\nmachine: {machine['cpu']} ({machine['cpu_cores']} cores), load average before: {load_before:.2f}")
        print(header(), flush=True)
        baseline = bench.point(baseline_target(polar, prompt, SESSIONS))
        points.append(baseline)
        for stream in (False, True):
            for route in ("direct", "envoy"):
                points.append(bench.point(dialect_target(polar, route, DIALECT, stream, SESSIONS), baseline))
        if not proxy.error:
            litellm = {"version": proxy.version, "startup_s": proxy.startup_s}
            try:
                points += _litellm_points(bench, proxy)
                litellm |= {"status": "ran", "reason": ""}
            except (RuntimeError, OSError) as exc:  # Polar's figures stand without it
                litellm |= {"status": "failed", "reason": str(exc)}
    load_after = os.getloadavg()[0]  # the bench's own load included
    comparison = _comparison(points)
    _print_summary(points, comparison, litellm)
    print(f"load average: {load_before:.2f} before the run, {load_after:.2f} after it")
    report = {
        "machine": machine,
        "settings": asdict(settings)
        | {
            "sessions": SESSIONS,
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_after,
            "reply_tokens": len(pieces) + 1,
            "credentials": args.credentials,
        },
        "shares_the_cpu": sharing_note(settings.workers, "LiteLLM and its backend, "),
        "litellm": litellm,
        "comparison": comparison,
        "points": [asdict(p) for p in points],
    }
    benchmark_common.write_json(report, args.out, "gateway_vs_litellm.json")
    return 0


def _litellm_points(bench: Bench, proxy: LiteLLM) -> list[Point]:
    """LiteLLM's /v1/messages and its backend alone."""
    n = SESSIONS
    points: list[Point] = []
    for stream in (False, True):
        # Warm-up request: LiteLLM builds its clients on first use.
        request = dialect_request(DIALECT, stream, LITELLM_MODEL, proxy.key, proxy.address)
        status, body = send_once(proxy.address, request)
        if status != 200:
            raise RuntimeError(f"LiteLLM answered the warm-up request with {status}: {body[:500]!r}")
        backend = Target(
            "backend",
            "direct",
            "openai_chat",
            stream,
            "http",
            proxy.backend,
            (backend_request(stream, proxy.backend),) * n,
            FINAL_MARKERS["openai_chat"][stream],
            ("backend",),
        )
        baseline = bench.point(backend)
        litellm = Target(
            "litellm",
            "direct",
            DIALECT,
            stream,
            "http",
            proxy.address,
            (request,) * n,  # one key: LiteLLM has no sessions
            FINAL_MARKERS[DIALECT][stream],
            ("litellm", "backend"),
        )
        points += [baseline, bench.point(litellm, baseline, slow=True)]
    return points


def _comparison(points: list[Point]) -> list[dict]:
    """Polar's /v1/messages vs LiteLLM's, per streaming mode and Polar route."""
    rows = []
    for stream in (False, True):
        theirs = find(points, "litellm", "direct", DIALECT, stream, SESSIONS)
        for route in ("direct", "envoy"):
            ours = find(points, "polar", route, DIALECT, stream, SESSIONS)
            if ours is None:
                continue
            ratio = ours.requests_per_s / theirs.requests_per_s if theirs and theirs.requests_per_s else math.nan
            # CPU per request is the figure other work on the machine disturbs least.
            our_cpu = ours.cpu_us_per_request.get(f"gateway_{route}", math.nan)
            their_cpu = theirs.cpu_us_per_request.get("litellm", math.nan) if theirs else math.nan
            rows.append(
                {
                    "stream": stream,
                    "polar_route": route,
                    "sessions": SESSIONS,
                    "polar_requests_per_s": ours.requests_per_s,
                    "litellm_requests_per_s": theirs.requests_per_s if theirs else None,
                    "speedup": None if math.isnan(ratio) else ratio,
                    "target": TARGET_SPEEDUP,
                    "meets_target": None if math.isnan(ratio) else ratio >= TARGET_SPEEDUP,
                    "polar_gateway_cpu_us_per_request": None if math.isnan(our_cpu) else our_cpu,
                    "litellm_cpu_us_per_request": None if math.isnan(their_cpu) else their_cpu,
                }
            )
    return rows


def _print_summary(points: list[Point], comparison: list[dict], litellm: dict) -> None:
    print()
    if litellm["status"] != "ran":
        print(f"LiteLLM {litellm['status']}: {litellm['reason']}")
    for row in comparison:
        if row["speedup"] is None:
            continue
        verdict = "meets" if row["meets_target"] else "misses"
        print(
            f"/v1/messages {'stream' if row['stream'] else 'whole'} at {row['sessions']} sessions: "
            f"Polar ({row['polar_route']}) "
            f"{row['polar_requests_per_s']:,.0f} req/s vs LiteLLM {row['litellm_requests_per_s']:,.0f} req/s = "
            f"{row['speedup']:.2f}× ({verdict} ≥ {TARGET_SPEEDUP:g}×); CPU per request: gateway "
            f"{row['polar_gateway_cpu_us_per_request']:,.0f} µs, LiteLLM {row['litellm_cpu_us_per_request']:,.0f} µs"
        )
    print_failures(points)


if __name__ == "__main__":
    sys.exit(main())
