"""Prefix merging vs one trace per request, on generated 30-turn tool-using sessions.

Measures, in one run and on the same sessions:

* trainer tokens (sum of trace lengths) and traces of each builder;
* the trainer's forward + backward time over each builder's traces (a Hugging Face causal LM, the tiny
  model by default; logprobs are computed only at trainable positions, as the trainer does);
* reconstruction throughput of both builders, in session tokens (prompt + sampled over all calls) per
  second, from CallViews and from CallRecord protobufs.

Targets: at least 5.39x less trainer time than per_request; building faster than 1M tokens/s.

    python scripts/bench_merge.py --quick            # under a minute on 2 CPU cores
    python scripts/bench_merge.py --device cuda --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from polar.inference.models import resolve_model
from polar.testing.trajectories import BENCH_SHAPE, SessionShape, tool_session
from polar.trajectory import BUILDERS, build, verify_or_raise, views_from_protos

import benchmark_common

# Half the size of BENCH_SHAPE so that --quick stays under a minute on 2 CPU cores. Much smaller
# sessions would mislead: with the tiny model's 49k-token vocabulary and 64-wide layers, the output
# projection at trainable positions (the same work for both builders) would dominate the time.
QUICK_SHAPE = SessionShape(
    system_tokens=1_000,
    task_tokens=(50, 150),
    tool_tokens=(25, 200),
    sample_tokens=(15, 100),
    max_tokens=100,
    summary_tokens=(50, 150),
)
TRAINER_TARGET = 5.39
BUILD_TARGET = 1_000_000


def parse_args() -> argparse.Namespace:
    parser = benchmark_common.parser(__doc__, "smaller sessions, finishes in under a minute", "merge.json")
    parser.add_argument("--sessions", type=int, help="sessions to generate (default 4, quick 1)")
    parser.add_argument(
        "--rounds", type=int, help="timed rounds, builders alternating; the fastest counts (default 3, quick 1)"
    )
    parser.add_argument("--turns", type=int, default=30, help="calls per session")
    parser.add_argument("--model", default="tiny", help="model alias or Hugging Face folder")
    parser.add_argument("--device", default="cpu", help="torch device for forward+backward (cpu, cuda)")
    parser.add_argument("--build-repeats", type=int, default=20, help="builds timed per builder")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_throughput(sessions, records, repeats: int) -> dict[str, dict[str, float]]:
    """Session tokens per second for each builder, from views and from protobuf records."""
    tokens = sum(sum(c.total_tokens for c in calls) for calls in sessions)
    results = {}
    for name in BUILDERS:
        start = time.perf_counter()
        for _ in range(repeats):
            for calls in sessions:
                build(name, calls)
        from_views = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(repeats):
            for session in records:
                build(name, views_from_protos(session))
        from_records = time.perf_counter() - start
        results[name] = {
            "tokens_per_s_from_views": tokens * repeats / from_views,
            "tokens_per_s_from_records": tokens * repeats / from_records,
        }
    return results


def forward_backward_seconds(model, traces, device: torch.device) -> float:
    """Wall clock of forward + backward over every trace, one sequence at a time."""
    base = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()

    def step(trace) -> None:
        tokens = torch.tensor(trace.token_ids, dtype=torch.long, device=device)  # (T,)
        # A token at position i is predicted from the hidden state at i - 1.
        targets = torch.tensor(np.flatnonzero(trace.loss_mask[1:]) + 1, device=device)  # (n,)
        behaviour = torch.tensor(trace.logprobs, device=device)[targets]  # (n,)
        hidden = base(input_ids=tokens[None]).last_hidden_state[0]  # (T, H)
        logits = head(hidden[targets - 1]).float()  # (n, V): only trainable positions
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[targets][:, None])[:, 0]  # (n,)
        ratio = torch.exp(logprobs - behaviour)  # (n,)
        loss = -(ratio * trace.weight).sum() / max(len(targets), 1)
        loss.backward()

    step(traces[0])  # warm-up: kernels, allocator
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for trace in traces:
        step(trace)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    args = parse_args()
    shape = QUICK_SHAPE if args.quick else BENCH_SHAPE
    n_sessions = args.sessions or (1 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 3)
    sessions = [tool_session(args.turns, args.seed + i, shape) for i in range(n_sessions)]
    records = [[c.to_proto() for c in calls] for calls in sessions]

    results = {name: [build(name, calls) for calls in sessions] for name in BUILDERS}
    for built in results.values():
        for calls, result in zip(sessions, built):
            verify_or_raise(calls, result.traces)

    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).to(device)
    model.train()

    rows = {}
    for name, built in results.items():
        traces = [t for result in built for t in result.traces]
        rows[name] = {
            "traces": len(traces),
            "trainer_tokens": sum(len(t.token_ids) for t in traces),
            "trainable_tokens": sum(t.trainable_tokens for t in traces),
            "forward_backward_s": float("inf"),
        }
    # Alternate the builders so that load from other processes hits both alike.
    for round_index in range(rounds):
        names = list(results) if round_index % 2 == 0 else list(reversed(results))
        for name in names:
            traces = [t for result in results[name] for t in result.traces]
            seconds = forward_backward_seconds(model, traces, device)
            rows[name]["forward_backward_s"] = min(rows[name]["forward_backward_s"], seconds)
    throughput = build_throughput(sessions, records, max(1, args.build_repeats // (4 if args.quick else 1)))
    for name in BUILDERS:
        rows[name].update(throughput[name])

    base, merged = rows["per_request"], rows["prefix_merging"]
    ratios = {
        "traces": base["traces"] / merged["traces"],
        "trainer_tokens": base["trainer_tokens"] / merged["trainer_tokens"],
        "forward_backward_s": base["forward_backward_s"] / merged["forward_backward_s"],
    }
    slowest_build = min(merged["tokens_per_s_from_views"], base["tokens_per_s_from_views"])
    report = {
        "sessions": n_sessions,
        "turns": args.turns,
        "quick": args.quick,
        "rounds": rounds,
        "session_tokens": sum(sum(c.total_tokens for c in calls) for calls in sessions),
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "machine": benchmark_common.machine("torch", device=args.device),
        "builders": rows,
        "ratios_per_request_over_prefix_merging": ratios,
        "targets": {
            "trainer_time_ratio": TRAINER_TARGET,
            "trainer_time_ratio_met": ratios["forward_backward_s"] >= TRAINER_TARGET,
            "build_tokens_per_s": BUILD_TARGET,
            "build_tokens_per_s_met": slowest_build > BUILD_TARGET,
        },
    }

    print(
        f"{n_sessions} generated {args.turns}-turn tool sessions, {report['session_tokens']:,} session tokens; "
        f"model {args.model} on {report['device']}"
    )
    table = []
    for key, label, fmt in (
        ("traces", "traces", "{:,.0f}"),
        ("trainer_tokens", "trainer tokens", "{:,.0f}"),
        ("trainable_tokens", "trainable tokens", "{:,.0f}"),
        ("forward_backward_s", "forward+backward (s)", "{:.3f}"),
        ("tokens_per_s_from_views", "build, views (M tokens/s)", None),
        ("tokens_per_s_from_records", "build, protobufs (M tokens/s)", None),
    ):
        a, b = base[key], merged[key]
        if fmt is None:
            table.append((label, f"{a / 1e6:.1f}", f"{b / 1e6:.1f}", ""))
        else:
            ratio = f"{a / b:.2f}x" if key != "trainable_tokens" else ""
            table.append((label, fmt.format(a), fmt.format(b), ratio))
    benchmark_common.print_table(("", "per_request", "prefix_merging", "ratio"), table)
    targets = report["targets"]
    trainer_met = "met" if targets["trainer_time_ratio_met"] else "NOT met"
    build_met = "met" if targets["build_tokens_per_s_met"] else "NOT met"
    print(
        f"trainer time ratio {ratios['forward_backward_s']:.2f}x (target >= {TRAINER_TARGET}x: {trainer_met}); "
        f"slowest build {slowest_build / 1e6:.1f}M tokens/s (target > 1M: {build_met})"
    )

    benchmark_common.write_json(report, args.out, "merge.json")


if __name__ == "__main__":
    main()
