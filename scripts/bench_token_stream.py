"""The gateway's CPU per call when the engine decodes one token per step, by message interval.

A loaded GPU engine decodes one token per sequence per step, so the inference server has one token of
a call at a time to send; every message of the stream costs the gateway (and the server) about the
same CPU, whatever it holds. `[gateway] message_interval_s` has the server send at most one message
per interval (GenerateRequest.message_interval_seconds). This bench runs one scripted inference
server that paces each reply a token per step, and a gateway per interval in front of it (0 = a
message per token, and the default), and replays Pi's recorded first call against each, whole and
streamed, at 1 and 32 sessions: requests/s and CPU per call of the gateway and the inference server.

The step is 2 ms, far quicker than a loaded GPU's 20-50 ms, so that a window holds enough calls: a
message still holds one token at interval 0, and at 0.1 s the whole 34-token reply comes in one or
two messages, where a real engine's would come in a few. The load and the table are the gateway
benchmarks' (gateway_load.py).

    python scripts/bench_token_stream.py --quick     # under a minute on 2 CPU cores

Prints a table and writes JSON (default bench-results/token_stream.json).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from gateway.core import DEFAULT_MESSAGE_INTERVAL_S
from polar import credentials as creds
from polar.app.stack import gateway_spec, inference_spec, running
from polar.config import GatewayConfig, InferenceConfig
from polar.service_base import listening_socket

import benchmark_common
from gateway_load import Bench, Point, Settings, Target, header
from gateway_stack import (
    REPLAY_MARKERS,
    REPLY_TEXT,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    open_sessions,
    recorded_sessions,
    replay_request,
    replay_rules,
)

STEP_S = 0.002  # the scripted engine's pause before each token
INTERVALS = (0.0, DEFAULT_MESSAGE_INTERVAL_S)
SESSIONS = (1, 32)
HARNESS = "pi"


def main() -> int:
    quick = "whole replies only, short windows: under a minute"
    args = benchmark_common.parser(__doc__, quick, "token_stream.json").parse_args()
    settings = Settings(
        quick=args.quick,
        workers=len(os.sched_getaffinity(0)),
        warmup_s=0.5 if args.quick else 1.0,
        window_s=2.0 if args.quick else 4.0,
        paired_rounds=1,
        paired_warmup_s=0.0,
    )
    sessions = recorded_sessions()
    session = next(s for s in sessions if s.harness == HARNESS)
    rules = [dict(rule, delay_seconds=STEP_S) for rule in replay_rules(sessions)]
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-token-stream-") as scratch, contextlib.ExitStack() as stack:
        script = Path(scratch) / "script.json"
        script.write_text(json.dumps({"rules": rules, "outputs": [{"text": REPLY_TEXT}], "cycle": True}))
        inference_config = InferenceConfig(
            engine="scripted", port=0, script=str(script), max_batch_size=2 * max(SESSIONS)
        )
        stack.enter_context(creds.handed_to_children(None))
        inference = stack.enter_context(running(inference_spec(inference_config), STARTUP_TIMEOUT_S, STOP_TIMEOUT_S))
        bench = Bench(settings)
        stack.callback(bench.close)
        bench.processes["inference"] = inference.process.pid
        print(header())
        for interval in INTERVALS:
            http = stack.enter_context(listening_socket("127.0.0.1"))
            config = GatewayConfig(
                port=http.getsockname()[1],
                grpc_port=0,
                inference_address=inference.dial_address,
                message_interval_s=interval,
            )
            gateway = stack.enter_context(
                running(gateway_spec(config, inference_config), STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, http)
            )
            name = f"gateway_interval_{interval:g}s"
            bench.processes[name] = gateway.process.pid
            address = f"127.0.0.1:{config.port}"
            for stream in (False,) if args.quick else (False, True):
                for count in SESSIONS:
                    keys = open_sessions(gateway.dial_address, count, None)
                    payloads = tuple(replay_request(session.requests[0], stream, key, address) for key in keys)
                    marker = REPLAY_MARKERS[session.dialect][stream]
                    label = f"{HARNESS}:first interval {interval:g}s"
                    target = Target(
                        "polar", "direct", label, stream, "http", address, payloads, marker, (name, "inference")
                    )
                    points.append(bench.point(target))
    rows = _ratios(points)
    for row in rows:
        print(
            f"{row['mode']} at {row['sessions']} sessions: gateway CPU per call {row['gateway_cpu_us'][0]:,.0f} µs "
            f"at interval 0, {row['gateway_cpu_us'][1]:,.0f} µs at {DEFAULT_MESSAGE_INTERVAL_S:g} s "
            f"({row['gateway_cpu_ratio']:.2f}×); inference server {row['inference_cpu_us'][0]:,.0f} / "
            f"{row['inference_cpu_us'][1]:,.0f} µs; req/s {row['requests_per_s'][0]:,.0f} / "
            f"{row['requests_per_s'][1]:,.0f}"
        )
    report = {
        "machine": benchmark_common.machine("aiohttp", "grpcio"),
        "step_s": STEP_S,
        "intervals_s": INTERVALS,
        "harness": HARNESS,
        "ratios": rows,
        "points": [asdict(p) for p in points],
    }
    benchmark_common.write_json(report, args.out, "token_stream.json")
    return 0


def _ratios(points: list[Point]) -> list[dict]:
    """Per mode and number of sessions: each interval's figures, and the gateway's CPU at interval 0
    over its CPU at the default interval."""
    rows = []
    for stream in (False, True):
        for count in SESSIONS:
            pair = [p for p in points if p.stream == stream and p.sessions == count]
            if len(pair) != len(INTERVALS):
                continue
            gateway = [next(v for k, v in p.cpu_us_per_request.items() if k.startswith("gateway")) for p in pair]
            rows.append(
                {
                    "mode": "stream" if stream else "whole",
                    "sessions": count,
                    "gateway_cpu_us": gateway,
                    "inference_cpu_us": [p.cpu_us_per_request.get("inference") for p in pair],
                    "requests_per_s": [p.requests_per_s for p in pair],
                    "gateway_cpu_ratio": gateway[0] / gateway[1],
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
