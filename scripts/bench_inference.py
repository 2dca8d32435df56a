"""Inference throughput through a real server: `polar serve inference` as a subprocess, driven by a
gRPC streaming client in this process.

Measured, with all streams of a point started together:
- torch engine, models tiny and smollm2-135m, at 1, 8 and 32 concurrent streams: each stream makes
  one Generate call (ignore_eos, fixed max_tokens), and tokens/s is all sampled tokens over the time
  until the last one arrived, prefill included (the speedup over one stream shows the batching). A
  point that outlasts its time cap is cut there and counts the tokens received so far.
- scripted engine (no model): the server's own streaming throughput at up to 128 streams, each
  looping calls for a fixed window, once with one token per engine chunk (the torch engine's shape:
  one chunk per decode step) and, without --quick, once with 32; plus the server's CPU time per
  token, the per-token overhead the service itself adds. The scripted engine has every chunk at
  once, and the server sends what its engine produced while the previous message was being sent
  as one message: the tok/msg column says how many tokens a message carried.

`--prefix-cache compare` measures the torch engine's prefix cache instead: 32 sessions (--quick:
8) of one CLI (--harness, default pi) start at once, each with that CLI's recorded first prompt (its
system prompt and tools, tests/fixtures/sessions) and an instruction of its own, against one server
with the cache and one without (--models, default smollm2-135m), in alternating rounds. Each
round's instructions are new: the cached server's first round computes the CLI's prompt once
(cold), later rounds find it cached by earlier sessions (warm). Reported: time to first token
(median and worst of the sessions), tokens/s (all sampled tokens over the time to the last one) and
the share of prompt tokens reused.

`--constraint compare` measures what constrained decoding costs the torch engine (or, with --engine
vllm, run from .venv-vllm, the vLLM engine): tokens/s at 1 and 32
streams (--streams) with and without a constraint, on one server, in alternating rounds (--rounds,
default 3, --quick 2; the median of each point is reported, and the cost 1 - with/without). The
constraint is a JSON schema whose reply cannot end within max_tokens (an object with a string of at
least 2,000 characters), so every step of a constrained call computes a mask (the mask of a free
string admits most of the vocabulary: the costliest case for applying it); the calls without one
ignore end-of-sequence, so both sample exactly max_tokens tokens.

    python scripts/bench_inference.py --quick              # under a minute on 2 CPU cores
    python scripts/bench_inference.py --device cuda        # on a GPU machine
    python scripts/bench_inference.py --prefix-cache compare [--quick]
    python scripts/bench_inference.py --constraint compare [--quick] [--models tiny smollm2-135m]
    .venv-vllm/bin/python scripts/bench_inference.py --constraint compare --engine vllm [--quick]

Prints a table and writes JSON (default bench-results/inference.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from polar.app.stack import Service, inference_spec, running
from polar.config import InferenceConfig
from polar.service_base import join_host_port
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

import benchmark_common

TORCH_MODELS = ("tiny", "smollm2-135m")
VLLM_MODEL = "smollm2-135m"  # vLLM's CPU attention refuses tiny's head size
TORCH_STREAMS = (1, 8, 32)
SCRIPTED_STREAMS = (1, 8, 32, 128)
SCRIPTED_TOKENS_PER_MESSAGE = (1, 32)
SCRIPTED_MAX_TOKENS = 1024
PROMPT_TOKENS = 32
STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Point:
    """One measurement: an engine and model at one number of concurrent streams."""

    engine: str
    model: str
    device: str  # as the server reports it (GetModelInfo.device); "" for the scripted engine
    card: str  # the GPU's name on cuda, else the CPU's model
    streams: int
    max_tokens: int  # per Generate call
    seconds: float  # from the start of the point until its last token (or its window or cap)
    tokens: int  # tokens received
    messages: int  # stream messages with tokens received
    tokens_per_s: float
    speedup_vs_1_stream: float  # tokens_per_s over the same engine and model's 1-stream point
    first_token_ms_p50: float  # from a call's start to its first message, median over the point's calls
    server_cpu_us_per_token: float  # the server process's CPU time during the point, per token
    client_cpu_us_per_token: float  # this process's CPU time during the point, per token


def main() -> int:
    args = _parse_args()
    machine = benchmark_common.machine("torch", "grpcio", device=args.device)
    if args.prefix_cache == "compare":
        return _prefix_cache_main(args, machine)
    if args.constraint == "compare":
        return _constraint_main(args, machine)
    # Torch points: one call per stream, capped in time. --quick keeps calls short and caps tight
    # so that the whole run stays under a minute however slow the engine is.
    max_tokens, cap = (8, 4.0) if args.quick else (128, 120.0)
    window = 1.0 if args.quick else 5.0  # scripted points: seconds of looping calls
    # --quick streams one token per chunk only: the costliest shape, and the one the target is for.
    per_message_variants = SCRIPTED_TOKENS_PER_MESSAGE[:1] if args.quick else SCRIPTED_TOKENS_PER_MESSAGE
    points: list[Point] = []
    for model in args.models:
        config = InferenceConfig(engine="torch", model=model, port=0, device=args.device, dtype=args.dtype)
        points += _bench_server(config, TORCH_STREAMS, _Work(max_tokens, calls=1, seconds=cap), machine)
    with tempfile.TemporaryDirectory() as scratch:
        for per_message in per_message_variants:
            script = Path(scratch) / f"script-{per_message}.json"
            script.write_text(json.dumps(_scripted_script(per_message)))
            # Slots for every stream, so that the widest point measures streaming, not queueing.
            config = InferenceConfig(
                engine="scripted", port=0, script=str(script), max_batch_size=max(SCRIPTED_STREAMS)
            )
            work = _Work(SCRIPTED_MAX_TOKENS, calls=None, seconds=window)
            points += _bench_server(config, SCRIPTED_STREAMS, work, machine, label=f"{per_message} tok/chunk")
    _print_table(points, machine)
    # Other work on the machine skews every figure; the load average says how much there was.
    settings = {"quick": args.quick, "prompt_tokens": PROMPT_TOKENS, "load_average_1min": os.getloadavg()[0]}
    report = {"machine": machine, "settings": settings, "points": [asdict(p) for p in points]}
    benchmark_common.write_json(report, args.out, "inference.json")
    return 0


@dataclass(frozen=True)
class _Work:
    """What each stream of a point does."""

    max_tokens: int  # per Generate call
    calls: int | None  # calls per stream; None = keep calling until `seconds` have passed
    seconds: float  # the window, or the cap on a point with a fixed number of calls


def _parse_args() -> argparse.Namespace:
    quick = "short windows: the whole run in under a minute"
    outs = "inference.json; inference-prefix-cache.json with --prefix-cache compare, inference-constraint.json with "
    parser = benchmark_common.parser(__doc__, quick, outs + "--constraint compare")
    parser.add_argument("--device", default="cpu", help="device of the torch engine: cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--dtype", default="auto", help="torch engine dtype (default: auto)")
    parser.add_argument(
        "--models",
        nargs="+",
        help=f"torch engine models (default: {' '.join(TORCH_MODELS)}; with --prefix-cache compare: {PREFIX_MODEL})",
    )
    parser.add_argument(
        "--prefix-cache", choices=("compare",), help="measure the prefix cache: sessions of one CLI with and without it"
    )
    parser.add_argument(
        "--constraint",
        choices=("compare",),
        help="measure constrained decoding: tokens/s with and without a constraint",
    )
    parser.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="--constraint: the engine measured (vllm: from .venv-vllm, on the CPU; default: %(default)s)",
    )
    parser.add_argument(
        "--streams",
        type=int,
        nargs="+",
        help=f"--constraint: concurrent streams (default: {' '.join(map(str, CONSTRAINT_STREAMS))})",
    )
    parser.add_argument(
        "--harness",
        default="pi",
        choices=HARNESSES,
        help="--prefix-cache: whose recorded prompt (default: %(default)s)",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        help=f"--prefix-cache: sessions at once (default: {PREFIX_SESSIONS}, --quick {QUICK_PREFIX_SESSIONS})",
    )
    parser.add_argument(
        "--rounds", type=int, help="--prefix-cache: rounds on each server, the first cold (default: 2, --quick 1)"
    )
    args = parser.parse_args()
    compare = args.prefix_cache == "compare"
    constraint = args.constraint == "compare"
    args.models = args.models or (
        [PREFIX_MODEL]
        if compare
        else [VLLM_MODEL]
        if constraint and args.engine == "vllm"
        else ["tiny"]
        if constraint and args.quick
        else list(TORCH_MODELS)
    )
    if args.engine != "torch" and not constraint:
        parser.error("--engine vllm is measured with --constraint compare only")
    args.streams = args.streams or list(CONSTRAINT_STREAMS)
    return args


def _scripted_script(tokens_per_message: int) -> dict:
    # No tokenizer: nothing to load, and token ids are all the server needs to stream.
    return {
        "tokenizer": None,
        "vocab_size": 50000,
        "cycle": True,
        "tokens_per_chunk": tokens_per_message,
        "outputs": [{"token_ids": [1000 + i for i in range(SCRIPTED_MAX_TOKENS)]}],
    }


def _bench_server(
    config: InferenceConfig, streams: tuple[int, ...], work: _Work, machine: dict, label: str = ""
) -> list[Point]:
    with running(inference_spec(config), STARTUP_TIMEOUT_S, stop_timeout_s=10.0) as service:
        return asyncio.run(_bench_points(service, config, streams, work, machine, label))


async def _bench_points(
    service: Service, config: InferenceConfig, streams: tuple[int, ...], work: _Work, machine: dict, label: str
) -> list[Point]:
    target = join_host_port("127.0.0.1" if config.host in ("0.0.0.0", "") else config.host, service.port)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        info = (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
        rng = random.Random(0)
        prompt = [rng.randrange(info.vocab_size) for _ in range(PROMPT_TOKENS)]
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=work.max_tokens, ignore_eos=True, seed=0),
        )
        # Warm-up: the first calls pay for lazy initialisation (allocator, kernels, connection).
        warm_up = inference_pb2.GenerateRequest()
        warm_up.CopyFrom(request)
        warm_up.sampling.max_tokens = 4
        await _run_point(stub, warm_up, streams=1, work=_Work(4, calls=1, seconds=work.seconds))
        points: list[Point] = []
        for n in streams:
            server_cpu = benchmark_common.cpu_seconds(service.process.pid)
            client_cpu = time.process_time()
            tokens, messages, seconds, first_token = await _run_point(stub, request, n, work)
            server_cpu = benchmark_common.cpu_seconds(service.process.pid) - server_cpu
            client_cpu = time.process_time() - client_cpu
            rate = tokens / seconds
            points.append(
                Point(
                    engine=info.engine,
                    model=f"{info.name} ({label})" if label else info.name,
                    device=info.device,
                    card=machine["gpu"] if info.device.startswith("cuda") else machine["cpu"],
                    streams=n,
                    max_tokens=work.max_tokens,
                    seconds=seconds,
                    tokens=tokens,
                    messages=messages,
                    tokens_per_s=rate,
                    speedup_vs_1_stream=_speedup(rate, points[0].tokens_per_s if points else rate),
                    first_token_ms_p50=statistics.median(first_token) * 1000 if first_token else float("nan"),
                    server_cpu_us_per_token=server_cpu / tokens * 1e6 if tokens else float("nan"),
                    client_cpu_us_per_token=client_cpu / tokens * 1e6 if tokens else float("nan"),
                )
            )
    return points


async def _run_point(
    stub: inference_pb2_grpc.InferenceServiceStub, request: inference_pb2.GenerateRequest, streams: int, work: _Work
) -> tuple[int, int, float, list[float]]:
    """Run `streams` clients at once; return the tokens and messages received before the work was
    done or cut off, the seconds that took, and each call's first-token latency."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + work.seconds
    tokens = messages = 0
    last = start
    first_token: list[float] = []

    async def stream() -> None:
        nonlocal tokens, messages, last
        calls = 0
        while loop.time() < end and (work.calls is None or calls < work.calls):
            calls += 1
            started = loop.time()
            call = stub.Generate(request)
            first = True
            async for response in call:
                now = loop.time()
                if now >= end:
                    call.cancel()
                    return
                if first:
                    first_token.append(now - started)
                    first = False
                if response.token_ids:  # the last message of a stream may carry only the finish reason
                    tokens += len(response.token_ids)
                    messages += 1
                    last = now

    await asyncio.gather(*(stream() for _ in range(streams)))
    seconds = work.seconds if work.calls is None or loop.time() >= end else last - start
    return tokens, messages, seconds, first_token


# ------------------------------------------------------------------------ constrained decoding compared

CONSTRAINT_STREAMS = (1, 32)
# A reply that cannot end within max_tokens: every step of a constrained call computes its mask.
LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}


@dataclass(frozen=True)
class ConstraintPoint:
    """Tokens/s of one model at one number of streams, with and without a constraint (medians of rounds)."""

    engine: str
    model: str
    device: str
    streams: int
    max_tokens: int
    rounds: int
    unconstrained_tokens_per_s: float
    constrained_tokens_per_s: float
    cost: float  # 1 - constrained / unconstrained: the share of throughput the constraint takes
    unconstrained_rounds: list[float]
    constrained_rounds: list[float]


def _constraint_main(args: argparse.Namespace, machine: dict) -> int:
    max_tokens, cap = (16, 30.0) if args.quick else (64, 300.0)
    rounds = args.rounds or (2 if args.quick else 3)
    points: list[ConstraintPoint] = []
    for model in args.models:
        config = InferenceConfig(
            engine=args.engine,
            model=model,
            port=0,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=max(args.streams),
            prefix_cache_mib=0,
        )
        with running(inference_spec(config), STARTUP_TIMEOUT_S, stop_timeout_s=10.0) as service:
            points += asyncio.run(_constraint_points(service, args.streams, _Work(max_tokens, 1, cap), rounds))
    print(
        f"constrained decoding, {machine['gpu'] or machine['cpu']}: tokens/s, "
        f"median of {rounds} alternating rounds; load average {os.getloadavg()[0]:.1f}"
    )
    header = ("engine", "model", "device", "streams", "max_tokens", "without tok/s", "with tok/s", "cost")
    rows = [
        (
            p.engine,
            p.model,
            p.device,
            str(p.streams),
            str(p.max_tokens),
            f"{p.unconstrained_tokens_per_s:.1f}",
            f"{p.constrained_tokens_per_s:.1f}",
            f"{p.cost:+.1%}",
        )
        for p in points
    ]
    benchmark_common.print_table(header, rows, left=len(header))
    settings = {
        "quick": args.quick,
        "rounds": rounds,
        "prompt_tokens": PROMPT_TOKENS,
        "schema": LONG_STRING,
        "load_average_1min": os.getloadavg()[0],
    }
    report = {"machine": machine, "settings": settings, "points": [asdict(p) for p in points]}
    benchmark_common.write_json(report, args.out, "inference-constraint.json")
    return 0


async def _constraint_points(service: Service, streams: list[int], work: _Work, rounds: int) -> list[ConstraintPoint]:
    async with grpc.aio.insecure_channel(join_host_port("127.0.0.1", service.port)) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        info = (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
        rng = random.Random(0)
        prompt = [rng.randrange(info.vocab_size) for _ in range(PROMPT_TOKENS)]
        free = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=work.max_tokens, ignore_eos=True, seed=0),
        )
        constrained = inference_pb2.GenerateRequest()
        constrained.CopyFrom(free)
        constrained.sampling.ignore_eos = False
        constrained.sampling.constraint.CopyFrom(
            common_pb2.OutputConstraint(kind="json_schema", json_schema=json.dumps(LONG_STRING))
        )
        for warm_up in (free, constrained):  # lazy initialisation: kernels, the grammar's tokenizer
            await _run_point(stub, warm_up, streams=1, work=_Work(4, calls=1, seconds=work.seconds))
        rates: dict[tuple[bool, int], list[float]] = {}
        for round_ in range(rounds):
            for n in streams:
                # Alternate which goes first, so that a drift in the machine's load hits both alike.
                for with_constraint in (round_ % 2 == 1, round_ % 2 == 0):
                    request = constrained if with_constraint else free
                    tokens, _, seconds, _ = await _run_point(stub, request, n, work)
                    if tokens < n * work.max_tokens:
                        raise RuntimeError(
                            f"{n} streams sampled {tokens} tokens, not {n * work.max_tokens}: cut at the cap"
                        )
                    rates.setdefault((with_constraint, n), []).append(tokens / seconds)
        points = []
        for n in streams:
            without, with_ = statistics.median(rates[(False, n)]), statistics.median(rates[(True, n)])
            points.append(
                ConstraintPoint(
                    engine=info.engine,
                    model=info.name,
                    device=info.device,
                    streams=n,
                    max_tokens=work.max_tokens,
                    rounds=rounds,
                    unconstrained_tokens_per_s=without,
                    constrained_tokens_per_s=with_,
                    cost=1 - with_ / without,
                    unconstrained_rounds=rates[(False, n)],
                    constrained_rounds=rates[(True, n)],
                )
            )
        return points


# ------------------------------------------------------------------------ the prefix cache compared

HARNESSES = ("pi", "codex", "gemini-cli", "qwen-code", "claude-code")
PREFIX_MODEL = "smollm2-135m"
PREFIX_SESSIONS = 32
QUICK_PREFIX_SESSIONS = 8  # fewer, and the time without the cache is too close to one prefill to tell apart
PREFIX_CACHE_MIB = InferenceConfig().prefix_cache_mib  # the default


@dataclass(frozen=True)
class PrefixRound:
    """One round: every session's first call started at once, on the server with or without the cache."""

    prefix_cache: bool
    round: int  # rounds alternate which server goes first
    warm: bool  # the cached server held the CLI's prompt from an earlier round's sessions
    sessions: int
    prompt_tokens: int  # all sessions' prompts together
    cached_prompt_tokens: int  # of those, taken from the server's prefix cache (Usage.cached_prompt_tokens)
    first_token_ms_p50: float  # from a call's start to its first token, median over the sessions
    first_token_ms_max: float
    seconds: float  # from the start of the round until its last token
    tokens_per_s: float  # sampled tokens of all sessions over `seconds`


def _prefix_cache_main(args: argparse.Namespace, machine: dict) -> int:
    from transformers import AutoTokenizer

    from polar.inference.models import resolve_model

    sessions = args.sessions or (QUICK_PREFIX_SESSIONS if args.quick else PREFIX_SESSIONS)
    rounds = args.rounds or (1 if args.quick else 2)
    max_tokens = 4 if args.quick else 32
    model = args.models[0]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    recorded, at = _recorded_first_prompt(args.harness, tokenizer)
    configs = {
        cache: InferenceConfig(
            engine="torch",
            model=model,
            port=0,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=sessions,
            prefix_cache_mib=PREFIX_CACHE_MIB if cache else 0,
        )
        for cache in (False, True)
    }
    with (
        running(inference_spec(configs[False]), STARTUP_TIMEOUT_S, stop_timeout_s=10.0) as without,
        running(inference_spec(configs[True]), STARTUP_TIMEOUT_S, stop_timeout_s=10.0) as with_cache,
    ):
        servers = {False: f"127.0.0.1:{without.port}", True: f"127.0.0.1:{with_cache.port}"}
        results, device = asyncio.run(_prefix_rounds(servers, recorded, at, tokenizer, sessions, rounds, max_tokens))
    _print_prefix_table(results, machine, args.harness, model, device, len(recorded))
    settings = {
        "quick": args.quick,
        "harness": args.harness,
        "model": model,
        "device": device,
        "recorded_prompt_tokens": len(recorded),
        "max_tokens": max_tokens,
        "prefix_cache_mib": PREFIX_CACHE_MIB,
        "load_average_1min": os.getloadavg()[0],
    }
    report = {
        "machine": machine,
        "settings": settings,
        "rounds": [asdict(r) for r in results],
        "first_token_speedup": _prefix_speedups(results),
    }
    benchmark_common.write_json(report, args.out, "inference-prefix-cache.json")
    return 0


def _recorded_first_prompt(harness: str, tokenizer) -> tuple[list[int], int]:
    """The prompt ids of the CLI's first recorded call, and the position where its last user turn's
    text begins (after the turn's header): where each session's own instruction goes."""
    from polar.trajectory.session_file import read_trajectory

    calls = sorted(
        read_trajectory(benchmark_common.RECORDED_SESSIONS / f"{harness}.json.zst").calls, key=lambda call: call.call_id
    )
    prompt = list(calls[0].prompt_token_ids)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    turns = [
        i
        for i, token in enumerate(prompt)
        if token == start and tokenizer.decode(prompt[i + 1 : i + 3]).startswith("user")
    ]
    if not turns:
        raise SystemExit(f"the first recorded {harness} prompt has no user turn")
    at = turns[-1] + 1
    while "\n" not in tokenizer.decode(prompt[turns[-1] + 1 : at]):
        at += 1
    return prompt, at


async def _prefix_rounds(
    servers: dict[bool, str], recorded: list[int], at: int, tokenizer, sessions: int, rounds: int, max_tokens: int
) -> tuple[list[PrefixRound], str]:
    channels = {cache: grpc.aio.insecure_channel(address) for cache, address in servers.items()}
    try:
        stubs = {cache: inference_pb2_grpc.InferenceServiceStub(channel) for cache, channel in channels.items()}
        info = (await stubs[True].GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
        # Warm-up: the first calls pay for lazy initialisation; a prompt of its own, so nothing is cached.
        warm_up = [recorded[0]] + tokenizer.encode("Warm up.") + [recorded[0]]
        for stub in stubs.values():
            await _prefix_calls(stub, [warm_up], 2)
        results = []
        for r in range(rounds):
            prompts = [recorded[:at] + tokenizer.encode(f"Session {r}-{i}: ") + recorded[at:] for i in range(sessions)]
            for cache in (False, True) if r % 2 == 0 else (True, False):
                started = time.perf_counter()
                first, tokens, last, cached = await _prefix_calls(stubs[cache], prompts, max_tokens)
                seconds = max(last) - started
                results.append(
                    PrefixRound(
                        prefix_cache=cache,
                        round=r,
                        warm=cache and r > 0,
                        sessions=sessions,
                        prompt_tokens=sum(map(len, prompts)),
                        cached_prompt_tokens=cached,
                        first_token_ms_p50=statistics.median(first) * 1000,
                        first_token_ms_max=max(first) * 1000,
                        seconds=seconds,
                        tokens_per_s=tokens / seconds,
                    )
                )
        return results, info.device
    finally:
        for channel in channels.values():
            await channel.close()


async def _prefix_calls(
    stub: inference_pb2_grpc.InferenceServiceStub, prompts: list[list[int]], max_tokens: int
) -> tuple[list[float], int, list[float], int]:
    """One Generate per prompt, all at once: each call's seconds to its first token, the tokens
    sampled, when each call's last token came (perf_counter), the prompt tokens the server reused."""

    async def call(i: int, prompt: list[int]) -> tuple[float, int, float, int]:
        sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
        started = time.perf_counter()
        first, tokens, last, cached = 0.0, 0, 0.0, 0
        async for response in stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)):
            now = time.perf_counter()
            if response.token_ids:
                first = first or now - started
                tokens += len(response.token_ids)
                last = now
            cached = response.usage.cached_prompt_tokens or cached
        return first, tokens, last, cached

    done = await asyncio.gather(*(call(i, prompt) for i, prompt in enumerate(prompts)))
    return [d[0] for d in done], sum(d[1] for d in done), [d[2] for d in done], sum(d[3] for d in done)


def _prefix_speedups(results: list[PrefixRound]) -> dict[str, float | None]:
    """Time to first token (median) without the cache over with it, paired by round: the cold round
    and the median of the warm ones."""
    by_round: dict[int, dict[bool, PrefixRound]] = {}
    for r in results:
        by_round.setdefault(r.round, {})[r.prefix_cache] = r
    ratios = {r: pair[False].first_token_ms_p50 / pair[True].first_token_ms_p50 for r, pair in by_round.items()}
    warm = [ratio for r, ratio in ratios.items() if r > 0]
    return {"cold": ratios.get(0), "warm": statistics.median(warm) if warm else None}


def _print_prefix_table(
    results: list[PrefixRound], machine: dict, harness: str, model: str, device: str, prompt: int
) -> None:
    cores = f"{machine['cpu']} ({machine['cpu_cores']} cores)"
    print(f"\nmachine: {cores}{', ' + machine['gpu'] if machine['gpu'] else ''}")
    sessions = results[0].sessions
    print(
        f"{sessions} sessions of {harness}'s recorded first prompt ({prompt:,} tokens) each with its own "
        f"instruction, all at once; {model} on {device}"
    )
    header = ("round", "prefix cache", "1st tok p50 ms", "1st tok max ms", "tokens/s", "prompt reused")
    rows = []
    for r in results:
        state = ("on, warm" if r.warm else "on, cold") if r.prefix_cache else "off"
        rows.append(
            (
                str(r.round),
                state,
                f"{r.first_token_ms_p50:,.0f}",
                f"{r.first_token_ms_max:,.0f}",
                f"{r.tokens_per_s:.1f}",
                f"{r.cached_prompt_tokens / r.prompt_tokens:.0%}",
            )
        )
    benchmark_common.print_table(header, rows, left=2)
    speedups = _prefix_speedups(results)
    parts = [f"{kind} {ratio:.1f}×" for kind, ratio in speedups.items() if ratio is not None]
    print(f"time to first token (median), without the cache over with it, same round: {', '.join(parts)}")


def _speedup(rate: float, one_stream_rate: float) -> float:
    return rate / one_stream_rate if one_stream_rate else float("nan")


def _print_table(points: list[Point], machine: dict) -> None:
    gpu = f", {machine['gpu']}" if machine["gpu"] else ""
    print(f"\nmachine: {machine['cpu']} ({machine['cpu_cores']} cores){gpu}")
    header = (
        "engine",
        "model",
        "device",
        "streams",
        "tok/msg",
        "tokens/s",
        "vs 1",
        "1st tok ms",
        "srv µs/tok",
        "cli µs/tok",
    )
    rows = []
    for p in points:
        rows.append(
            (
                p.engine,
                p.model,
                p.device or "-",
                str(p.streams),
                f"{p.tokens / p.messages:.1f}" if p.messages else "-",
                f"{p.tokens_per_s:,.0f}" if p.tokens_per_s >= 100 else f"{p.tokens_per_s:.1f}",
                f"{p.speedup_vs_1_stream:.2f}×",
                f"{p.first_token_ms_p50:.1f}",
                f"{p.server_cpu_us_per_token:.1f}",
                f"{p.client_cpu_us_per_token:.1f}",
            )
        )
    benchmark_common.print_table(header, rows, left=3)


if __name__ == "__main__":
    sys.exit(main())
