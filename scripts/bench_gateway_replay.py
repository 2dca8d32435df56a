"""The gateway under real harness traffic: the recorded sessions of tests/fixtures/sessions replayed as
load, each in its own dialect.

The sessions are Claude Code's, Codex's, Qwen Code's, Gemini CLI's and Pi's (1.5k to 20k-token
prompts); each replayed session sends its recorded requests in order, the scripted engine answering
each prompt with its recorded output (so later calls extend earlier ones, as they did when recorded).
The stack is `polar up`'s (gateway_stack.py), loaded through its direct gateway (gateway_load.py).

Per harness at 1 session it reports the gateway's CPU (pooled over the rounds, and in the round least
disturbed by the machine's other work), the time to the prompt ids from the call records, and the
added latency of a first call (its prompt already seen by the gateway, as when another session of the
harness sent it) and of the session's last call (extending the calls before it), each measured on its
own in rounds alternating with the inference server called alone on the same prompt. For Claude Code,
call 40 of its session carried on past the recording (each call echoes the reply before it and adds a
tool's output) must cost about what its call 3 costs, which adds as much: a later call pays for what
it adds, not for the conversation before it (the two are measured together, in alternating rounds, so
the machine's drift does not enter their ratio). At 64 sessions: requests/s of every harness at once
and, beside LiteLLM's proxy (litellm_proxy.py; --no-litellm leaves it out), of the sessions whose
dialect LiteLLM translates here (Anthropic Messages, Chat Completions).

    python scripts/bench_gateway_replay.py --quick     # under a minute on 2 CPU cores

`--credentials off` runs the services without the stack's credentials (on by default, as `polar up`
runs them).

Prints a table and writes JSON (default bench-results/gateway_replay.json).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from polar import credentials as creds
from polar.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

import benchmark_common
from gateway_load import LATENCY_NOTE, Bench, Point, Settings, Target, find, header, percentile, print_failures
from gateway_load import parser as gateway_parser
from gateway_stack import (
    REPLAY_MARKERS,
    PolarStack,
    RecordedSession,
    generate_request,
    open_sessions,
    polar_stack,
    recorded_sessions,
    replay_request,
    replay_rules,
    reply_pieces,
    sharing_note,
)
from http_client import http_request, send_once
from litellm_proxy import LITELLM_DIALECTS, LITELLM_MODEL, LiteLLM

MANY_SESSIONS = 64  # the sessions replaying harnesses at once, beside LiteLLM
# Sessions a replayed harness's first (or last) call is sent to in turn: each receives a few dozen
# calls in a window, far below [gateway] max_session_body_bytes.
CALL_POINT_SESSIONS = 32
# The call of a long session measured beside its call 3: Claude Code's recorded session
# carried on (an echo of each reply and a user turn with a tool's output, ~150 tokens a call), so that
# its conversation is twice its first call's text and its prompt 25k tokens, within the tiny model's 128k.
LONG_SESSION_CALLS = 40
LONG_TURN_TEXT = "$ sed -n 1,5p src/parser.py\n" + "".join(
    f"{n:>4}  def rule_{n}(tokens): return tokens[{n}:] if tokens else []  # grammar rule {n}\n" for n in range(1, 6)
)
# A later call costs what its new tokens cost: call LONG_SESSION_CALLS of the carried-on session may
# cost at most this much more gateway CPU than its first carried-on call, which adds as much.
TARGET_LONG_CALL_GROWTH = 1.25
# Gateway CPU for a session's first call whose prompt (up to Claude Code's 20k tokens) it has seen.
TARGET_FIRST_CALL_CPU_US = 2000
TARGET_REPLAY_SPEEDUP = 5.0


def main() -> int:
    parser = gateway_parser(__doc__, "two harnesses at 1 session, short windows: under a minute", "gateway_replay.json")
    parser.add_argument("--no-litellm", action="store_true", help="measure Polar only")
    args = parser.parse_args()
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
    pieces = reply_pieces()
    with tempfile.TemporaryDirectory(prefix="polar-bench-gateway-") as scratch, contextlib.ExitStack() as stack:
        issued = creds.ensure(Path(scratch) / "credentials") if args.credentials == "on" else None
        bench = Bench(settings)
        stack.callback(bench.close)
        proxy = None
        if args.no_litellm:
            litellm = {"status": "skipped", "reason": "--no-litellm"}
        else:
            # LiteLLM starts first, in the background: its start-up (seconds of imports) overlaps Polar's.
            proxy = stack.enter_context(LiteLLM.started(Path(scratch), pieces))
        recorded = recorded_sessions()
        polar = stack.enter_context(polar_stack(Path(scratch), replay_rules(recorded), issued))
        bench.processes |= polar.pids
        if proxy is not None:
            if not proxy.error:
                # Ready before any measurement: its start-up would take CPU from Polar's points.
                proxy.wait_ready()
            if proxy.error:
                litellm = {"status": "unavailable", "reason": proxy.error}
                proxy = None
            else:
                bench.processes |= proxy.pids
        print(f"\nmachine: {machine['cpu']} ({machine['cpu_cores']} cores), load average before: {load_before:.2f}")
        print(header(), flush=True)
        points, rows = _replay_points(bench, polar, proxy, recorded, MANY_SESSIONS)
        if proxy is not None:
            litellm = {"version": proxy.version, "startup_s": proxy.startup_s, "status": "ran", "reason": ""}
    load_after = os.getloadavg()[0]  # the bench's own load included
    comparison = _replay_comparison(points)
    print()
    if litellm["status"] != "ran":
        print(f"LiteLLM {litellm['status']}: {litellm['reason']}")
    print_failures(points)
    print("\n" + LATENCY_NOTE)
    _print_replay_summary(rows, comparison)
    print(f"load average: {load_before:.2f} before the run, {load_after:.2f} after it")
    report = {
        "machine": machine,
        "settings": asdict(settings)
        | {
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_after,
            "reply_tokens": len(pieces) + 1,
            "credentials": args.credentials,
        },
        "shares_the_cpu": sharing_note(settings.workers, "LiteLLM and its backend, "),
        "latency_note": LATENCY_NOTE,
        "litellm": litellm,
        "replay": {"harnesses": rows, "comparison": comparison},
        "points": [asdict(p) for p in points],
    }
    benchmark_common.write_json(report, args.out, "gateway_replay.json")
    return 0


def _replay_points(
    bench: Bench, polar: PolarStack, proxy: LiteLLM | None, sessions: list[RecordedSession], many: int
) -> tuple[list[Point], list[dict]]:
    """Replayed harness traffic, through the direct gateway. Per harness at 1 session (with --quick,
    the harnesses of the longest and the shortest prompt): its first call, then its last call, each
    looped over many sessions (`_call_point`). At `many` sessions, each replaying one harness (round
    robin): every harness (not with --quick), then those whose dialect LiteLLM speaks, beside LiteLLM."""
    points: list[Point] = []
    rows: list[dict] = []
    address, cpu_of = polar.gateway_http, ("gateway_direct", "inference")
    by_prompt = sorted(sessions, key=lambda s: len(s.records[0].prompt_token_ids))
    one_session = [by_prompt[-1], by_prompt[0]] if bench.settings.quick else sessions
    for stream in (False, True):
        for session in one_session:
            first_point, first_render = _call_point(bench, polar, session, 0, stream)
            later_point, later_render = _call_point(bench, polar, session, len(session.requests) - 1, stream)
            first_cpu = first_point.cpu_us_per_request.get("gateway_direct", math.nan)
            rows.append(
                {
                    "harness": session.harness,
                    "dialect": session.dialect,
                    "stream": stream,
                    "prompt_tokens": [len(r.prompt_token_ids) for r in session.records],
                    "first_call_gateway_cpu_us": first_cpu,
                    "first_call_quietest_round_cpu_us": first_point.quietest_round_cpu_us.get(
                        "gateway_direct", math.nan
                    ),
                    "first_call_meets_target": first_cpu < TARGET_FIRST_CALL_CPU_US,
                    "later_call_gateway_cpu_us": later_point.cpu_us_per_request.get("gateway_direct", math.nan),
                    "later_call_quietest_round_cpu_us": later_point.quietest_round_cpu_us.get(
                        "gateway_direct", math.nan
                    ),
                    # From arrival to the prompt ids (parse, render, sampling), as the call records say.
                    "first_call_render_ms": first_render,
                    "later_call_render_ms": later_render,
                    "first_call_added_p50_ms": first_point.added_p50_ms,
                    "first_call_added_p99_ms": first_point.added_p99_ms,
                    "later_call_added_p50_ms": later_point.added_p50_ms,
                    "later_call_added_p99_ms": later_point.added_p99_ms,
                }
            )
            points += [first_point, later_point]
            if session.dialect == "anthropic" and not (stream and bench.settings.quick):
                short_call = len(session.requests) + 1
                short_pair, _, _ = _carried_on_call(polar, session, stream, short_call)
                long_pair, long_key, long_prompt = _carried_on_call(polar, session, stream, LONG_SESSION_CALLS)
                # Measured together, in alternating rounds: their ratio is not the machine's drift
                # between two points measured seconds apart.
                [(_, short_point), (_, long_point)] = bench.paired(short_pair, long_pair)
                # The measured call's renders: not the calls before it, each the first sight of its new turn.
                _, long_render = _render_ms(
                    polar.gateway_direct, long_key, polar.credentials, skip=LONG_SESSION_CALLS - 1
                )
                long_cpu = long_point.cpu_us_per_request.get("gateway_direct", math.nan)
                short_cpu = short_point.cpu_us_per_request.get("gateway_direct", math.nan)
                growth = long_cpu / short_cpu
                rows[-1].update(
                    {
                        "short_call": short_call,
                        "short_call_gateway_cpu_us": short_cpu,
                        "long_call": LONG_SESSION_CALLS,
                        "long_call_prompt_tokens": long_prompt,
                        "long_call_gateway_cpu_us": long_cpu,
                        "long_call_quietest_round_cpu_us": long_point.quietest_round_cpu_us.get(
                            "gateway_direct", math.nan
                        ),
                        "long_call_render_ms": long_render,
                        "long_call_added_p50_ms": long_point.added_p50_ms,
                        "long_call_growth": growth,
                        "long_call_meets_target": growth <= TARGET_LONG_CALL_GROWTH,
                    }
                )
                points += [short_point, long_point]
        for subset in ("litellm",) if bench.settings.quick else ("all", "litellm"):
            chosen = [s for s in sessions if subset == "all" or s.dialect in LITELLM_DIALECTS]
            keys = open_sessions(polar.gateway_direct, many, polar.credentials)
            harnesses = [chosen[i % len(chosen)] for i in range(many)]
            payloads = tuple(
                tuple(replay_request(r, stream, key, address) for r in s.requests) for s, key in zip(harnesses, keys)
            )
            markers = tuple({REPLAY_MARKERS[s.dialect][stream] for s in chosen})
            name = "replay:" + ("every harness" if subset == "all" else "+".join(s.harness for s in chosen))
            target = Target("polar", "direct", name, stream, "http", address, payloads, markers, cpu_of)
            points.append(bench.point(target, slow=True))
            if subset == "litellm" and proxy is not None and not proxy.error:
                payloads = tuple(
                    tuple(replay_request(r, stream, proxy.key, proxy.address, LITELLM_MODEL) for r in s.requests)
                    for s in harnesses
                )
                for payload in payloads[: len(chosen)]:  # LiteLLM builds its clients on first use
                    for request in payload:
                        send_once(proxy.address, request)
                target = Target(
                    "litellm", "direct", name, stream, "http", proxy.address, payloads, markers, ("litellm", "backend")
                )
                points.append(bench.point(target, slow=True))
    return points, rows


def _call_point(
    bench: Bench, polar: PolarStack, session: RecordedSession, index: int, stream: bool
) -> tuple[Point, float]:
    """Call `index` of a recorded session, sent by many sessions in turn, paired with the inference
    server alone on the same prompt (for the added latency); and the median time from arrival to the
    prompt ids, from the call records.

    Each session is one the gateway has already served the calls before `index`, so call `index`
    renders as it did when recorded: the first call fresh, a later one extending the call before it.
    The first call was sent once before, as another session of the harness would have sent it: the
    point measures a first call, not the gateway's first sight of a 20k-token prompt. The calls before
    a later one are the same in every session, so its new messages were seen too: the point measures
    what a later call costs beyond tokenizing them, the part that must not grow with the prompt.
    Many sessions rather than one: a session that sent the same call again and again would hold
    megabytes of bodies, which real sessions never do.
    """
    address = polar.gateway_http
    marker = REPLAY_MARKERS[session.dialect][stream]
    keys = open_sessions(polar.gateway_direct, CALL_POINT_SESSIONS, polar.credentials)
    # The calls each session has sent already; before the first call, one session sent it once.
    primed = [(key, session.requests[:index]) for key in keys] if index else [(keys[-1], session.requests[:1])]
    for key, before in primed:
        for request in before:
            status, body = send_once(address, replay_request(request, stream, key, address))
            _check_reply(session, status, body)
    calls = tuple(replay_request(session.requests[index], stream, key, address) for key in keys)
    label = f"{session.harness}:{'first' if index == 0 else 'later'}"
    prompt = tuple(session.records[index].prompt_token_ids)
    [(_, point)] = bench.paired(_call_pair(polar, label, stream, calls, marker, prompt))
    fresh, extending = _render_ms(polar.gateway_direct, keys[0], polar.credentials)
    return point, extending if index else fresh


def _call_pair(
    polar: PolarStack, label: str, stream: bool, calls: tuple[bytes, ...], marker: bytes, prompt: Sequence[int]
) -> tuple[Target, Target]:
    """`calls` (one per session) looped through the direct gateway, and its baseline: the inference
    server alone on `prompt`."""
    target = Target(
        "polar", "direct", label, stream, "http", polar.gateway_http, (calls,), marker, ("gateway_direct", "inference")
    )
    baseline = Target(
        "inference",
        "grpc",
        label,
        True,
        "grpc",
        polar.inference,
        (generate_request(prompt, "baseline-0").SerializeToString(),),
        b"",
        ("inference",),
        polar.node,
    )
    return target, baseline


def _carried_on_call(
    polar: PolarStack, session: RecordedSession, stream: bool, call: int
) -> tuple[tuple[Target, Target], str, int]:
    """Call `call` of an Anthropic harness's session carried on past its recording, to be sent by many
    sessions in turn as `_call_point` sends a recorded call: its target and baseline, the first
    session's key and the call's prompt length. Each session sends the recorded calls, then calls that
    echo the reply before them and add a user turn with a tool's output (LONG_TURN_TEXT), each
    extending the last, all whole; the measured call is the next one, whole or streamed."""
    address = polar.gateway_http
    headers = {"anthropic-version": "2023-06-01"}
    keys = open_sessions(polar.gateway_direct, CALL_POINT_SESSIONS, polar.credentials)
    calls = []
    for key in keys:
        for request in session.requests:
            status, reply = send_once(address, replay_request(request, False, key, address))
            _check_reply(session, status, reply)
        body = json.loads(session.requests[-1].body)
        messages = body["messages"]
        for turn in range(len(session.requests), call):
            echo = {"role": "assistant", "content": json.loads(reply)["content"]}
            messages = [
                *messages,
                echo,
                {"role": "user", "content": [{"type": "text", "text": f"({turn}) {LONG_TURN_TEXT}"}]},
            ]
            payload = dict(body, messages=messages, stream=turn == call - 1 and stream)
            request = http_request(address, session.requests[-1].target, {**headers, "x-api-key": key}, payload)
            if turn == call - 1:
                calls.append(request)
            else:
                status, reply = send_once(address, request)
                _check_reply(session, status, reply)
    status, reply = send_once(address, calls[0])  # its prompt, for the baseline
    _check_reply(session, status, reply)
    prompt = _last_prompt(polar.gateway_direct, keys[0], polar.credentials)
    label = f"{session.harness}:call {call}"
    pair = _call_pair(polar, label, stream, tuple(calls), REPLAY_MARKERS[session.dialect][stream], prompt)
    return pair, keys[0], len(prompt)


def _check_reply(session: RecordedSession, status: int, reply: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"the gateway answered a replayed {session.harness} call with {status}: {reply[:300]!r}")


def _last_prompt(gateway: str, key: str, issued: creds.Credentials | None) -> tuple[int, ...]:
    """The prompt ids of the session's last call, from its record."""
    return tuple(_session_calls(gateway, key, issued)[-1].prompt_token_ids)


def _session_calls(gateway: str, key: str, issued: creds.Credentials | None) -> list[common_pb2.CallRecord]:
    """The session's call records, in call order."""
    # Each record holds its request body: hundreds of harness-sized ones pass gRPC's 4 MiB default.
    options = [("grpc.max_receive_message_length", -1)]
    with creds.channel(gateway, creds.OPERATOR, issued, options) as channel:
        calls = gateway_pb2_grpc.GatewayServiceStub(channel).GetSession(gateway_pb2.GetSessionRequest(key=key)).calls
    return sorted(calls, key=lambda call: call.call_id)


def _render_ms(gateway: str, key: str, issued: creds.Credentials | None, skip: int = 0) -> tuple[float, float]:
    """The median render time (ms) of the session's calls rendered fresh, and of those that extend
    an earlier call; past its first `skip` calls."""
    calls = _session_calls(gateway, key, issued)[skip:]
    fresh = [c.timings.render_seconds * 1000 for c in calls if not c.extends_call_id]
    extending = [c.timings.render_seconds * 1000 for c in calls if c.extends_call_id]
    return percentile(fresh, 50), percentile(extending, 50)


def _replay_comparison(points: list[Point]) -> list[dict]:
    """Polar vs LiteLLM on the same replayed sessions, per streaming mode."""
    rows = []
    for theirs in (p for p in points if p.system == "litellm" and p.dialect.startswith("replay:")):
        ours = find(points, "polar", "direct", theirs.dialect, theirs.stream, theirs.sessions)
        if ours is None or not theirs.requests_per_s:
            continue
        ratio = ours.requests_per_s / theirs.requests_per_s
        rows.append(
            {
                "sessions": theirs.dialect,
                "stream": theirs.stream,
                "concurrent": theirs.sessions,
                "polar_requests_per_s": ours.requests_per_s,
                "litellm_requests_per_s": theirs.requests_per_s,
                "speedup": ratio,
                "target": TARGET_REPLAY_SPEEDUP,
                "meets_target": ratio >= TARGET_REPLAY_SPEEDUP,
                "polar_gateway_cpu_us_per_request": ours.cpu_us_per_request.get("gateway_direct"),
                "litellm_cpu_us_per_request": theirs.cpu_us_per_request.get("litellm"),
            }
        )
    return rows


def _print_replay_summary(rows: list[dict], comparison: list[dict]) -> None:
    print(
        "\nreplayed harness sessions at 1 session, a session's first call and its last (which extends the "
        "ones before): gateway CPU per call pooled over the rounds, and in the round the machine's other work "
        "disturbed least; render: the median time from arrival to the prompt ids, from the call records; "
        "added latency:"
    )
    for row in rows:
        print(
            f"  {row['harness']:12s} {'stream' if row['stream'] else 'whole '} prompts {row['prompt_tokens']} tokens: "
            f"first call {row['first_call_gateway_cpu_us']:,.0f} µs "
            f"({'meets' if row['first_call_meets_target'] else 'misses'} < {TARGET_FIRST_CALL_CPU_US:,} µs; "
            f"quietest round {row['first_call_quietest_round_cpu_us']:,.0f} µs; "
            f"render {row['first_call_render_ms']:.2f} ms), "
            f"+p50 {row['first_call_added_p50_ms']:.2f} ms +p99 {row['first_call_added_p99_ms']:.2f} ms; "
            f"later call {row['later_call_gateway_cpu_us']:,.0f} µs (quietest round "
            f"{row['later_call_quietest_round_cpu_us']:,.0f} µs; render {row['later_call_render_ms']:.2f} ms), "
            f"+p50 {row['later_call_added_p50_ms']:.2f} ms +p99 {row['later_call_added_p99_ms']:.2f} ms"
        )
        if "long_call" in row:
            print(
                f"  {'':12s} {'':6s} call {row['long_call']} of the session carried on, prompt "
                f"{row['long_call_prompt_tokens']:,} tokens: {row['long_call_gateway_cpu_us']:,.0f} µs (quietest round "
                f"{row['long_call_quietest_round_cpu_us']:,.0f} µs; render {row['long_call_render_ms']:.2f} ms), "
                f"{row['long_call_growth']:.2f}× call {row['short_call']} ({row['short_call_gateway_cpu_us']:,.0f} µs) "
                f"({'meets' if row['long_call_meets_target'] else 'misses'} ≤ {TARGET_LONG_CALL_GROWTH:g}×: a later "
                f"call costs what it adds), +p50 {row['long_call_added_p50_ms']:.2f} ms"
            )
    for row in comparison:
        verdict = "meets" if row["meets_target"] else "misses"
        print(
            f"{row['sessions']} {'stream' if row['stream'] else 'whole'} at {row['concurrent']} sessions: "
            f"Polar {row['polar_requests_per_s']:,.0f} req/s vs LiteLLM {row['litellm_requests_per_s']:,.0f} req/s = "
            f"{row['speedup']:.2f}× ({verdict} ≥ {TARGET_REPLAY_SPEEDUP:g}×); CPU per request: gateway "
            f"{row['polar_gateway_cpu_us_per_request']:,.0f} µs, LiteLLM {row['litellm_cpu_us_per_request']:,.0f} µs"
        )


if __name__ == "__main__":
    sys.exit(main())
