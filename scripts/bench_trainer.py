"""The trainer's speed: packed vs padded micro-batches, weight sync, and where a run's time goes.

Measures, in one run:

* trainer tokens/s (forward + backward + optimizer step of the GRPO loss) on the same traces in the
  packed layout (several traces per row, no padding) and the padded one (one trace per row, padded
  to the longest of its micro-batch); the traces have the shape of the example task set's: each task
  rendered by the gateway's chat format, a group of replies of random length up to the task's cap;
* weight sync GB/s: the backend's weights pushed to one inference server on this machine (Pause,
  UpdateWeights, Resume), model bytes over wall-clock seconds;
* with --run-dir, the share of a finished `polar train` run's wall clock per stage (rollout wait,
  train, weight sync), from its metrics.jsonl: the trainer is idle while it waits for rollouts;
* with --device cuda, tokens/s and model FLOPs utilisation of the torch backend on an 8k-token packed
  micro-batch: MFU = (6 * parameters * tokens + 6 * layers * hidden * sum over traces of len^2 / 2
  [causal attention, forward and backward]) / seconds / peak bf16 FLOP/s of the card (--peak-tflops).

Targets: packed >= 2x padded on the example's traces; weight sync >= 1 GB/s; the trainer idle under
30% of a run's wall clock.

    python scripts/bench_trainer.py --quick                     # under a minute on 2 CPU cores
    python scripts/bench_trainer.py --run-dir runs/train        # after `polar train examples/train.toml`
    python scripts/bench_trainer.py --device cuda --model smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import threading
import time
from pathlib import Path

import numpy as np
import torch

from polar.rollout.tasks import parse_task_lines
from trainer.batches import TrainSequence, pack, pad
from trainer.grpo import LossConfig
from trainer.metrics import read_metrics

EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "examples" / "train" / "tasks-train.jsonl"
H100_BF16_TFLOPS = 989.0


def example_traces(model: str, tasks_file: Path, tasks: int, seed: int) -> list[TrainSequence]:
    """Traces shaped like the example's: the task's prompt as the gateway renders it, then a reply of
    1..cap tokens (a group of group_size replies per task)."""
    from transformers import AutoTokenizer

    from gateway.chat_format import get_chat_format
    from gateway.conversation import Conversation, Message
    from polar.inference.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    chat_format = get_chat_format("hermes", tokenizer)
    rng = np.random.default_rng(seed)
    sequences = []
    for index, task in enumerate(parse_task_lines(tasks_file.read_text(), str(tasks_file))[:tasks]):
        prompt = chat_format.render_prompt(Conversation(messages=(Message(role="user", content=task.instruction),)))
        cap = task.sampling.max_tokens_per_call or 64
        for member in range(task.group_size or 8):
            reply = rng.integers(100, 40000, size=int(rng.integers(1, cap + 1)))
            ids = np.concatenate([np.asarray(prompt, dtype=np.int64), reply])
            mask = np.zeros(len(ids), dtype=bool)
            mask[len(prompt) :] = True
            sequences.append(
                TrainSequence(
                    name=f"task{index}/{member}",
                    token_ids=ids,
                    loss_mask=mask,
                    behaviour_logprobs=np.where(mask, -2.0, 0.0).astype(np.float32),
                    advantage=float(rng.normal()),
                    token_weight=1.0,
                    temperature=np.ones(len(ids), dtype=np.float32),
                    top_p=np.ones(len(ids), dtype=np.float32),
                    top_k=np.zeros(len(ids), dtype=np.int32),
                )
            )
    total = sum(int(s.loss_mask.sum()) for s in sequences)
    return [TrainSequence(**{**s.__dict__, "token_weight": 1.0 / total}) for s in sequences]


def random_weights(model: str) -> str:
    """A folder with the model's config and tokenizer and freshly initialised weights."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from polar.inference.models import resolve_model

    folder = resolve_model(model)
    out = Path(tempfile.mkdtemp(prefix="bench-trainer-")) / Path(folder).name
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return str(out)


def time_layout(backend, batches, repeats: int) -> float:
    """Best seconds of one optimizer update over these micro-batches."""
    best = float("inf")
    backend.update(batches, LossConfig())  # warm-up: allocator, kernels, optimizer state
    for _ in range(repeats):
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        backend.update(batches, LossConfig())
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def bench_layouts(backend, sequences, budget: int, repeats: int) -> dict:
    tokens = sum(len(s) for s in sequences)
    result = {"traces": len(sequences), "tokens": tokens, "budget": budget}
    for name, layout in (("packed", pack), ("padded", pad)):
        batches = layout(sequences, budget)
        seconds = time_layout(backend, batches, repeats)
        result[name] = {
            "micro_batches": len(batches),
            "positions": sum(b.padded_tokens for b in batches),
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }
    result["packed_over_padded"] = result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]
    return result


def bench_weight_sync(backend, model: str, repeats: int) -> dict:
    """Push the backend's weights to an inference server of the same model, in-process on loopback."""
    from polar.inference.engines import EngineOptions, create_engine
    from polar.inference.server import start_server
    from trainer.weight_sync import InferencePool

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        engine = create_engine("torch", EngineOptions(model=model, device="cpu", max_batch_size=1))
        server, port = await start_server(engine)
        holder.update(server=server, port=port, engine=engine)
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=300)
    started.wait()
    pool = InferencePool([f"127.0.0.1:{holder['port']}"])
    try:
        results = [pool.push(backend.hf_weights, note="bench") for _ in range(repeats)]
    finally:
        pool.close()
        asyncio.run_coroutine_threadsafe(holder["server"].stop(None), loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(holder["engine"].stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
    best = min(results, key=lambda r: r.seconds)
    return {"bytes": best.bytes_sent, "seconds": best.seconds, "gb_per_s": best.bytes_sent / best.seconds / 1e9}


def stage_shares(run_dir: Path) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise SystemExit(f"no metrics in {run_dir / 'metrics.jsonl'}: run `polar train` with that --run-dir first")
    elapsed = rows[-1]["elapsed_s"] - (rows[0]["elapsed_s"] - sum(rows[0][k] for k in _STAGES.values()))
    shares = {name: sum(r[key] for r in rows) / elapsed for name, key in _STAGES.items()}
    return {"steps": len(rows), "elapsed_s": elapsed, "shares": shares, "idle_share": shares["rollout wait"]}


_STAGES = {"rollout wait": "seconds_rollout_wait", "train": "seconds_train", "weight sync": "seconds_weight_sync"}


def bench_mfu(backend, tokens: int, repeats: int, peak_tflops: float) -> dict:
    config = backend.model.config
    parameters = sum(p.numel() for p in backend.model.parameters())
    length = 1024
    rng = np.random.default_rng(0)
    sequences = []
    for index in range(tokens // length):
        ids = rng.integers(100, config.vocab_size - 1, size=length)
        mask = np.zeros(length, dtype=bool)
        mask[length // 4 :] = True
        sequences.append(
            TrainSequence(
                name=f"s{index}", token_ids=ids, loss_mask=mask,
                behaviour_logprobs=np.where(mask, -2.0, 0.0).astype(np.float32), advantage=float(rng.normal()),
                token_weight=1.0 / (mask.sum() * (tokens // length)), temperature=np.ones(length, np.float32),
                top_p=np.ones(length, np.float32), top_k=np.zeros(length, np.int32),
            )
        )  # fmt: skip
    batches = pack(sequences, tokens)
    seconds = time_layout(backend, batches, repeats)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    flops = 6 * parameters * tokens + 6 * layers * hidden * len(sequences) * length * length / 2
    return {
        "tokens": tokens,
        "trace_length": length,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": flops / seconds / (peak_tflops * 1e12),
        "peak_tflops": peak_tflops,
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run, under a minute on 2 CPU cores")
    parser.add_argument("--model", default="smollm2-135m", help="tiny, smollm2-135m or a Hugging Face folder")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--tasks", type=Path, default=EXAMPLE_TASKS, help="task file the traces are shaped after")
    parser.add_argument("--run-dir", type=Path, help="a finished `polar train` run to read stage shares from")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="the card's dense bf16 peak")
    parser.add_argument(
        "--random-init", action="store_true",
        help="the model's architecture and tokenizer with random weights (speed does not depend on them)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-results/trainer.json"))
    args = parser.parse_args()

    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    torch.manual_seed(0)
    model = random_weights(args.model) if args.random_init else args.model
    backend = TorchBackend(TorchBackendOptions(model=model, device=args.device, lr=1e-6))
    repeats = 1 if args.quick else 3
    results: dict = {"model": args.model, "device": str(backend.device), "machine": platform.machine(),
                     "threads": torch.get_num_threads()}  # fmt: skip
    sequences = example_traces(model, args.tasks, tasks=2 if args.quick else 8, seed=0)
    results["layouts"] = bench_layouts(backend, sequences, budget=4096, repeats=repeats)
    if backend.device.type == "cpu":
        results["weight_sync"] = bench_weight_sync(backend, model, repeats=2 if args.quick else 3)
    if args.run_dir:
        results["run"] = stage_shares(args.run_dir)
    if backend.device.type == "cuda":
        results["mfu"] = bench_mfu(backend, tokens=8192, repeats=repeats, peak_tflops=args.peak_tflops)

    layouts = results["layouts"]
    print(f"trainer benchmark: {args.model} on {results['device']} ({results['threads']} threads)")
    print(f"  {'layout':<8} {'micro-batches':>13} {'positions':>10} {'seconds':>8} {'tokens/s':>10}")
    for name in ("packed", "padded"):
        row = layouts[name]
        print(f"  {name:<8} {row['micro_batches']:>13} {row['positions']:>10} {row['seconds']:>8.2f} {row['tokens_per_s']:>10.0f}")
    print(f"  packed / padded: {layouts['packed_over_padded']:.2f}x on {layouts['traces']} traces, {layouts['tokens']} tokens")
    if "weight_sync" in results:
        sync = results["weight_sync"]
        print(f"  weight sync: {sync['bytes'] / 1e6:.0f} MB in {sync['seconds']:.2f} s = {sync['gb_per_s']:.2f} GB/s")
    if "run" in results:
        run = results["run"]
        shares = ", ".join(f"{name} {100 * share:.0f}%" for name, share in run["shares"].items())
        print(f"  run of {run['steps']} steps, {run['elapsed_s']:.0f} s: {shares}; idle {100 * run['idle_share']:.0f}%")
    if "mfu" in results:
        mfu = results["mfu"]
        print(f"  {mfu['card']}: {mfu['tokens_per_s']:.0f} tokens/s, MFU {100 * mfu['mfu']:.1f}% (8k packed tokens)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"  figures in {args.out}")


if __name__ == "__main__":
    main()
