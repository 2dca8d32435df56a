"""Trainer time per step with and without shared-prefix packing, on traces shaped like each CLI's; and
the trainer's view of a recorded harness session (`--harness PRESET`). Run through
scripts/bench_trainer.py (`--shared-prefix compare`, `--harness PRESET`); see its docstring.

A CLI-shaped group is 8 sessions of one task: each session's trace (prefix-merged) is the CLI's
recorded first prompt (its system prompt, tools and the task, tests/fixtures/sessions), then turns of
sampled tokens (trained) and tool results (not trained), of lengths drawn from log-normal
distributions around one of two shapes: "coding", what coding sessions send (1-4 turns of a reply of
~150 tokens and a tool result of ~300), or "recorded", the turns of the CLI's recorded session itself
(each call's reply, and what the next call's prompt adds after it). The token saving sharing can give
is bounded by the shape: with coding turns, Pi's 1.5k-token prompt is under half of a session, which
caps the saving near 1.8x; the recorded sessions sample a few dozen tokens a call.
A step holds `groups` groups of different tasks: their sessions share the system prompt, a group's
also the task. The "nothing shared" case draws every session's prompt at random, at Pi's length.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from trainer.batches import pack
from trainer.grpo import LossConfig
from trainer.sequences import TrainSequence

import benchmark_common

CLIS = ("claude-code", "qwen-code", "gemini-cli", "codex", "pi")
GROUP_SIZE = 8
TASK_TOKENS = 60  # the end of the recorded prompt that stands for the task, redrawn per group
TARGETS = {"claude-code": 4.0, "pi": 2.0, "none": 1.0}  # least speed-up wanted (none: no slower)


def recorded_prompt(cli: str) -> np.ndarray:
    """The first call's prompt of the CLI's recorded session: its system prompt, tools and task."""
    from polar.trajectory import read_session

    calls, _ = read_session(benchmark_common.RECORDED_SESSIONS / f"{cli}.json.zst")
    return np.asarray(calls[0].prompt_ids, dtype=np.int64)


def _sequence(
    name: str, prompt: np.ndarray, turns: list[tuple[np.ndarray, np.ndarray]], weight: float, rng: np.random.Generator
) -> TrainSequence:
    parts, mask = [prompt], [np.zeros(len(prompt), bool)]
    for sampled, tool in turns:
        parts += [sampled, tool]
        mask += [np.ones(len(sampled), bool), np.zeros(len(tool), bool)]
    ids, mask = np.concatenate(parts), np.concatenate(mask)
    return TrainSequence(
        name=name,
        token_ids=ids,
        loss_mask=mask,
        behaviour_logprobs=np.where(mask, -rng.uniform(0.1, 3.0, len(ids)), 0).astype(np.float32),
        advantage=float(rng.normal()),
        token_weight=weight,
        temperature=np.ones(len(ids), np.float32),
        top_p=np.ones(len(ids), np.float32),
        top_k=np.zeros(len(ids), np.int32),
    )


def recorded_turns(cli: str) -> list[tuple[int, int]]:
    """(reply, tool result) lengths of each call of the CLI's recorded session; the last call's tool
    result is empty."""
    from polar.trajectory import read_session

    calls, _ = read_session(benchmark_common.RECORDED_SESSIONS / f"{cli}.json.zst")
    return [
        (len(call.sampled_ids), max(0, len(after.prompt_ids) - len(call.prompt_ids) - len(call.sampled_ids)))
        for call, after in zip(calls, calls[1:])
    ] + [(len(calls[-1].sampled_ids), 0)]


def cli_step(
    cli: str, groups: int, turns: tuple[int, int], vocab: int, seed: int = 0, shape: str = "coding"
) -> list[TrainSequence]:
    """One step's traces: `groups` groups of GROUP_SIZE sessions shaped like the CLI's ("none": every
    session's prompt drawn at random, nothing in common), with `turns` (least, most) coding turns or,
    for `shape` "recorded", the recorded session's turns."""
    rng = np.random.default_rng(seed)
    system = recorded_prompt("pi" if cli == "none" else cli)
    recorded = recorded_turns("pi" if cli == "none" else cli)
    specs = []
    for group in range(groups):
        task = np.concatenate([system[:-TASK_TOKENS], rng.integers(100, vocab, TASK_TOKENS)])
        for member in range(GROUP_SIZE):
            prompt = rng.integers(100, vocab, len(system)) if cli == "none" else task
            if shape == "recorded":
                lengths = [
                    (_length(rng, reply, 1, 10 * reply), _length(rng, tool, 1, 10 * tool) if tool else 0)
                    for reply, tool in recorded
                ]
            else:
                count = int(rng.integers(turns[0], turns[1] + 1))
                lengths = [(_length(rng, 150, 10, 1500), _length(rng, 300, 20, 3000)) for _ in range(count)]
            session = [(rng.integers(100, vocab, reply), rng.integers(100, vocab, tool)) for reply, tool in lengths]
            specs.append((f"{cli}/g{group}/s{member}", prompt, session))
    trainable = sum(len(sampled) for _, _, session in specs for sampled, _ in session)
    return [_sequence(name, prompt, session, 1.0 / trainable, rng) for name, prompt, session in specs]


def _length(rng: np.random.Generator, median: float, low: int, high: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), 0.8), low, high))


def _timed_update(backend, batches) -> float:
    cuda = backend.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    backend.update(batches, LossConfig())
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def compare(backend, sequences: list[TrainSequence], budget: int, rounds: int, profile: bool = False) -> dict:
    """Best seconds of one optimizer update with and without sharing, measured in alternating rounds
    (after one untimed update of each); `profile`: then one more update of each under torch's
    profiler, its costliest operations printed and returned."""
    layouts = {"shared": pack(sequences, budget, share_prefixes=True), "plain": pack(sequences, budget)}
    seconds = {name: float("inf") for name in layouts}
    for batches in layouts.values():
        _timed_update(backend, batches)  # warm-up: allocator, kernels
    for _ in range(rounds):
        for name, batches in layouts.items():
            seconds[name] = min(seconds[name], _timed_update(backend, batches))
    profiles = {name: _profiled_update(backend, batches) for name, batches in layouts.items()} if profile else {}
    return {
        "traces": len(sequences),
        "budget": budget,
        "tokens_represented": sum(len(s) for s in sequences),
        "tokens_computed": {name: sum(b.tokens for b in batches) for name, batches in layouts.items()},
        "micro_batches": {name: len(batches) for name, batches in layouts.items()},
        "seconds": seconds,
        "speedup": seconds["plain"] / seconds["shared"],
        **({"profile": profiles} if profile else {}),
    }


PROFILE_ROWS = 15


def _profiled_update(backend, batches) -> list[dict]:
    """One update under torch's profiler: its costliest operations by their own device time (the
    CPU's where there is no GPU), printed as the profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    cuda = backend.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        _timed_update(backend, batches)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = profiler.key_averages()
    print(averages.table(sort_by=key, row_limit=PROFILE_ROWS))
    top = sorted(averages, key=lambda event: getattr(event, key), reverse=True)
    return [
        {"name": event.key, "calls": event.count, "self_ms": getattr(event, key) / 1e3} for event in top[:PROFILE_ROWS]
    ]


def bench_shared_prefix(
    backend,
    clis: list[str],
    groups: int,
    turns: tuple[int, int],
    rounds: int,
    shapes: tuple[str, ...] = ("coding",),
    profile: bool = False,
) -> dict:
    """Per CLI and session shape ("coding", "recorded"; rows named `cli` and `cli/recorded`)."""
    vocab = backend.model_description["vocab_size"]
    results = {}
    for cli in clis:
        for shape in shapes:
            name = cli if shape == "coding" else f"{cli}/{shape}"
            sequences = cli_step(cli, groups, turns, vocab, shape=shape)
            budget = max(8192, _tree_budget(sequences))
            results[name] = compare(backend, sequences, budget, rounds, profile)
            results[name]["target"] = TARGETS.get(cli)
            _print_row(name, results[name])
    return results


def _tree_budget(sequences: list[TrainSequence]) -> int:
    """A budget that holds one group's tree (the plain layout gets the same budget)."""
    groups: dict[str, list[TrainSequence]] = {}
    for sequence in sequences:
        groups.setdefault(sequence.name.rsplit("/", 1)[0], []).append(sequence)
    total = sum(len(s) for s in sequences)
    return max(sum(b.tokens for b in pack(group, total, share_prefixes=True)) for group in groups.values())


# The tables' rows are printed as they are measured (a row takes seconds to minutes): fixed widths.
SHARING_COLUMNS = ("traces like", "traces", "tokens", "computed shared", "s shared", "s plain", "speed-up", "target")
SHARING_WIDTHS = (20, 6, 8, 15, 8, 7, 8, 7)
HARNESS_COLUMNS = (
    "builder",
    "sharing",
    "traces",
    "tokens",
    "computed",
    "trained",
    "share",
    "seconds",
    "tokens/s",
    "trained/s",
)
HARNESS_WIDTHS = (15, 7, 6, 8, 9, 8, 6, 8, 9, 9)


def print_header() -> None:
    print("  " + benchmark_common.table_row(SHARING_COLUMNS, SHARING_WIDTHS))


def _print_row(cli: str, row: dict) -> None:
    target = f">= {row['target']:.0f}x" if row.get("target") else ""
    cells = (
        cli,
        str(row["traces"]),
        str(row["tokens_represented"]),
        str(row["tokens_computed"]["shared"]),
        f"{row['seconds']['shared']:.2f}",
        f"{row['seconds']['plain']:.2f}",
        f"{row['speedup']:.2f}x",
        target,
    )
    print("  " + benchmark_common.table_row(cells, SHARING_WIDTHS), flush=True)


# -------------------------------------------------------------------------------------------------
# --harness PRESET: a recorded session's traces as the trainer packs them


def harness_traces(preset: str, builder: str, sessions: int = GROUP_SIZE, seed: int = 0) -> list[TrainSequence]:
    """A group of `sessions`: the recorded session of the preset's CLI rebuilt by `builder`, and
    `sessions - 1` more that begin with its recorded prompt, each call's reply redrawn at the recorded
    reply's length (the same calls, other samples: the shape a GRPO group of one task has)."""
    from polar.trajectory import build, read_session

    calls, _ = read_session(benchmark_common.RECORDED_SESSIONS / f"{preset}.json.zst")
    rng = np.random.default_rng(seed)
    variants = [list(calls)]
    for _ in range(sessions - 1):
        redrawn, carried = [], {}  # recorded prompt + reply -> the same with the reply redrawn
        for call in calls:
            prompt = tuple(call.prompt_ids.tolist())
            for old in sorted(carried, key=len, reverse=True):  # a later prompt holds earlier replies
                if prompt[: len(old)] == old:
                    prompt = carried[old] + prompt[len(old) :]
                    break
            sampled = tuple(rng.integers(100, 49000, len(call.sampled_ids)).tolist())
            redrawn.append(replace(call, prompt_ids=np.asarray(prompt), sampled_ids=np.asarray(sampled)))
            carried[tuple(call.prompt_ids.tolist()) + tuple(call.sampled_ids.tolist())] = prompt + sampled
        variants.append(redrawn)
    traces = [trace for variant in variants for trace in build(builder, variant).traces if trace.trainable_tokens]
    trainable = sum(trace.trainable_tokens for trace in traces)
    return [
        TrainSequence(
            name=f"{preset}/{index}",
            token_ids=np.asarray(t.token_ids, np.int64),
            loss_mask=np.asarray(t.loss_mask, bool),
            behaviour_logprobs=np.asarray(t.logprobs, np.float32),
            advantage=float(rng.normal()),
            token_weight=1.0 / trainable,
            temperature=np.ones(len(t.token_ids), np.float32),
            top_p=np.ones(len(t.token_ids), np.float32),
            top_k=np.zeros(len(t.token_ids), np.int32),
        )
        for index, t in enumerate(traces)
    ]


def bench_harness(backend, preset: str, rounds: int) -> dict:
    """Per builder (prefix merging, per request) and with and without sharing: tokens packed, the
    share of them trained, and trainer tokens/s (tokens the traces hold, per second of update)."""
    results = {}
    print("  " + benchmark_common.table_row(HARNESS_COLUMNS, HARNESS_WIDTHS, left=2))
    for builder in ("prefix_merging", "per_request"):
        sequences = harness_traces(preset, builder)
        budget = max(8192, _tree_budget(sequences))
        row = compare(backend, sequences, budget, rounds)
        trained = sum(s.trainable_tokens for s in sequences)
        for layout in ("shared", "plain"):
            seconds, computed = row["seconds"][layout], row["tokens_computed"][layout]
            results[f"{builder}/{layout}"] = point = {
                "traces": len(sequences),
                "tokens": row["tokens_represented"],
                "computed": computed,
                "trained": trained,
                "trained_share": trained / computed,
                "seconds": seconds,
                "tokens_per_s": row["tokens_represented"] / seconds,
                "trained_per_s": trained / seconds,
            }
            cells = (
                builder,
                "on" if layout == "shared" else "off",
                str(point["traces"]),
                str(point["tokens"]),
                str(computed),
                str(trained),
                f"{100 * point['trained_share']:.1f}%",
                f"{seconds:.2f}",
                f"{point['tokens_per_s']:.0f}",
                f"{point['trained_per_s']:.1f}",
            )
            print("  " + benchmark_common.table_row(cells, HARNESS_WIDTHS, left=2), flush=True)
    return results
