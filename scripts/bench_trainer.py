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

With --lora compare, instead: full training against a LoRA adapter of --lora-rank on every
projection, each in a process of its own, side by side: a step's seconds on the example's traces,
peak memory (the process's on a CPU, the GPU's allocations on a GPU), and one weight push (bytes and
seconds, to a server on loopback; on a GPU a server process on the same card, over CUDA IPC). The
JSON's `lora.full` and `lora.adapter` hold them.

With --shared-prefix compare (scripts/bench_shared_prefix.py), instead: trainer time per step (one
optimizer update, gradient checkpointing on) with and without shared-prefix packing, on steps of
groups of 8 sessions shaped like each CLI's (its recorded first prompt from tests/fixtures/sessions,
then turns of sampled tokens and tool results of log-normal lengths), and on sessions that share
nothing; the two layouts alternate, round by round, and the best time of each counts. With
--harness PRESET: a group of the preset's recorded session and seven more with its calls' replies
redrawn, rebuilt by prefix merging and per request; per builder, with and without sharing: tokens
packed, the share of them trained, trainer tokens/s.

Targets: packed >= 2x padded on the example's traces; weight sync >= 1 GB/s; the trainer idle under
30% of a run's wall clock; sharing >= 4x less trainer time on Claude Code-shaped groups, >= 2x on
Pi-shaped ones, no slower where nothing is shared.

    python scripts/bench_trainer.py --quick                     # under a minute on 2 CPU cores
    python scripts/bench_trainer.py --run-dir runs/train        # after `polar train examples/train.toml`
    python scripts/bench_trainer.py --device cuda --model smollm2-135m
    python scripts/bench_trainer.py --shared-prefix compare [--quick]   # --quick: Pi's recorded shape and
                                                                # nothing shared, SmolLM2 cut to 1 layer
    python scripts/bench_trainer.py --harness claude-code
    python scripts/bench_trainer.py --shared-prefix compare --backend megatron --shape qwen3-4b --device cuda
    python scripts/bench_trainer.py --shared-prefix compare --profile ...   # where each layout's time goes
    python scripts/bench_trainer.py --lora compare [--quick]    # full against LoRA: step, memory, push
    python scripts/bench_trainer.py --lora compare --shape qwen3-4b --device cuda
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import torch
from bench_shared_prefix import CLIS, bench_harness, bench_shared_prefix, print_header

from polar.rollout.tasks import parse_task_lines
from trainer.batches import pack, pad
from trainer.grpo import LossConfig
from trainer.metrics import read_metrics
from trainer.sequences import TrainSequence

import benchmark_common

EXAMPLE_TASKS = benchmark_common.ROOT / "examples" / "train" / "tasks-train.jsonl"
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


def bench_weight_sync(backend, model: str, repeats: int, **engine_options) -> dict:
    """Push the backend's weights to an inference server of the same model (with `engine_options`:
    an adapter's, for a LoRA backend), in-process on loopback."""
    from polar.inference.engines import EngineOptions, create_engine
    from polar.inference.server import start_server
    from trainer.weight_sync import InferencePool

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        engine = create_engine("torch", EngineOptions(model=model, device="cpu", max_batch_size=1, **engine_options))
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


def lora_mode(mode: str, model: str, device: str, rank: int, quick: bool) -> dict:
    """One side of --lora compare, in a process of its own (so that its peak memory is its own): a
    step's best seconds on the example's traces, the process's (or the GPU's) peak memory over the
    steps, and one weight push (its bytes and seconds)."""
    import resource

    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    torch.manual_seed(0)
    lora_options = {"lora_rank": rank} if mode == "adapter" else {}
    backend = TorchBackend(TorchBackendOptions(model=model, device=device, lr=1e-6, **lora_options))
    if backend.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(backend.device)
    sequences = example_traces(model, EXAMPLE_TASKS, tasks=2 if quick else 8, seed=0)
    seconds = time_layout(backend, pack(sequences, 4096), repeats=1 if quick else 3)
    if backend.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(backend.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result = {
        "step_seconds": seconds,
        "peak_memory_bytes": peak,
        "trained_parameters": sum(p.numel() for p in backend.optimizer.param_groups[0]["params"]),
        "push_bytes": sum(t.numel() * t.element_size() for _, t in backend.hf_weights()),
    }
    if backend.device.type == "cpu":
        engine = {"lora_rank": rank} if mode == "adapter" else {}
        sync = bench_weight_sync(backend, model, repeats=2 if quick else 3, **engine)
    else:
        sync = bench_weight_sync_gpu(backend, model, rank if mode == "adapter" else 0, repeats=2 if quick else 3)
    result.update(push_bytes=sync["bytes"], push_seconds=sync["seconds"])
    return result


def bench_weight_sync_gpu(backend, model: str, lora_rank: int, repeats: int) -> dict:
    """Push the backend's weights to an inference server of the same model on the same GPU, a
    process of its own as in a run (so the push goes over CUDA IPC); `lora_rank`: an adapter's."""
    import bench_weight_sync as weight_sync

    from trainer.weight_sync import InferencePool

    server = weight_sync.start_server(Path(model), "cuda", baseline=False, lora_rank=lora_rank)
    try:
        pool = InferencePool([weight_sync.address_of(server)])
        try:
            results = [pool.push(backend.hf_weights, note="bench") for _ in range(repeats)]
        finally:
            pool.close()
    finally:
        server.stdin.close()
        server.wait(timeout=120)
    best = min(results, key=lambda r: r.seconds)
    return {"bytes": best.bytes_sent, "seconds": best.seconds}


def lora_main(args) -> None:
    """--lora compare: full training against a LoRA adapter, each in a fresh process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    model = sharing_model(args) if args.shape or args.layers else args.model
    if args.random_init:
        model = random_weights(model)
    machine = benchmark_common.machine("torch", device=args.device)
    results: dict = {
        "model": args.shape or args.model,
        "device": args.device,
        "card": machine["gpu"] or machine["cpu"],
        "machine": machine,
        "lora": {"rank": args.lora_rank},
    }
    for mode in ("full", "adapter"):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results["lora"][mode] = pool.submit(
                lora_mode, mode, model, args.device, args.lora_rank, args.quick
            ).result()
    print(
        f"trainer benchmark, LoRA rank {args.lora_rank} against full training: {results['model']} on {results['card']}"
    )
    rows = []
    for mode in ("full", "adapter"):
        row = results["lora"][mode]
        push = f"{row['push_seconds']:.3f}" if "push_seconds" in row else "-"
        figures = (
            f"{row['trained_parameters']:,}",
            f"{row['step_seconds']:.2f}",
            f"{row['peak_memory_bytes'] / 2**20:.0f}",
        )
        rows.append((mode, *figures, f"{row['push_bytes'] / 1e6:.2f}", push))
    header = ("training", "trained parameters", "step s", "peak MiB", "push MB", "push s")
    benchmark_common.print_table(header, rows, indent="  ")
    benchmark_common.write_json(results, args.out, "trainer.json")


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
                name=f"s{index}",
                token_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=np.where(mask, -2.0, 0.0).astype(np.float32),
                advantage=float(rng.normal()),
                token_weight=1.0 / (mask.sum() * (tokens // length)),
                temperature=np.ones(length, np.float32),
                top_p=np.ones(length, np.float32),
                top_k=np.zeros(length, np.int32),
            )
        )
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
    parser = benchmark_common.parser(__doc__, "a smaller run, under a minute on 2 CPU cores", "trainer.json")
    parser.add_argument("--model", default="smollm2-135m", help="tiny, smollm2-135m or a Hugging Face folder")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--tasks", type=Path, default=EXAMPLE_TASKS, help="task file the traces are shaped after")
    parser.add_argument("--run-dir", type=Path, help="a finished `polar train` run to read stage shares from")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="the card's dense bf16 peak")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="the model's architecture and tokenizer with random weights (speed does not depend on them)",
    )
    parser.add_argument("--shared-prefix", choices=("compare",), help="time steps with and without shared prefixes")
    parser.add_argument("--harness", choices=CLIS, help="a preset's recorded session as the trainer packs it")
    parser.add_argument("--clis", default=",".join((*CLIS, "none")), help="--shared-prefix: the CLI shapes to run")
    parser.add_argument("--groups", type=int, default=2, help="--shared-prefix: groups (tasks) per step")
    parser.add_argument(
        "--session-shape",
        help="--shared-prefix: the sessions' turns, coding and/or recorded (comma-separated; "
        "default both, --quick: recorded)",
    )
    parser.add_argument(
        "--layers", type=int, default=0, help="the model's shape cut to this many layers (random weights)"
    )
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch", help="--shared-prefix, --harness")
    parser.add_argument("--shape", choices=("qwen3-4b",), help="a random model of this shape instead of --model")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="--shared-prefix: one more update per layout under torch's profiler, its costliest operations",
    )
    parser.add_argument("--lora", choices=("compare",), help="full training against a LoRA adapter, side by side")
    parser.add_argument("--lora-rank", type=int, default=8, help="--lora: the adapter's rank")
    args = parser.parse_args()
    if args.lora:
        lora_main(args)
        return
    if args.shared_prefix or args.harness:
        sharing_main(args)
        return

    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    torch.manual_seed(0)
    model = random_weights(args.model) if args.random_init else args.model
    backend = TorchBackend(TorchBackendOptions(model=model, device=args.device, lr=1e-6))
    repeats = 1 if args.quick else 3
    results: dict = {
        "model": args.model,
        "device": str(backend.device),
        "threads": torch.get_num_threads(),
        "machine": benchmark_common.machine("torch", device=str(backend.device)),
    }
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
    rows = []
    for name in ("packed", "padded"):
        row = layouts[name]
        figures = (str(row["micro_batches"]), str(row["positions"]), f"{row['seconds']:.2f}")
        rows.append((name, *figures, f"{row['tokens_per_s']:.0f}"))
    benchmark_common.print_table(("layout", "micro-batches", "positions", "seconds", "tokens/s"), rows, indent="  ")
    print(
        f"  packed / padded: {layouts['packed_over_padded']:.2f}x on {layouts['traces']} traces, {layouts['tokens']} tokens"
    )
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
    benchmark_common.write_json(results, args.out, "trainer.json")


def sharing_model(args) -> str:
    """The model folder the sharing benches train: --model, or a random one of --shape, or of
    --model's shape cut to --layers (--quick: 1) layers."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from polar.inference.models import resolve_model

    if args.shape:
        from bench_megatron import QWEN3_4B, _make_model_folder

        folder = Path(tempfile.mkdtemp(prefix="bench-trainer-")) / args.shape
        _make_model_folder(dict(QWEN3_4B), folder, device="cuda" if args.device.startswith("cuda") else "cpu")
        # SmolLM2's tokenizer (the tiny model's): the chat format the traces are rendered with needs
        # its special tokens, and its 49k ids lie within Qwen3's vocabulary.
        AutoTokenizer.from_pretrained(resolve_model("tiny")).save_pretrained(folder)
        return str(folder)
    layers = args.layers or (1 if args.quick else 0)
    if not layers:
        return args.model
    source = resolve_model(args.model)
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    folder = Path(tempfile.mkdtemp(prefix="bench-trainer-")) / f"{Path(source).name}-{layers}-layers"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def sharing_main(args) -> None:
    """--shared-prefix compare and --harness PRESET."""
    model = sharing_model(args)
    if args.backend == "megatron":
        from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions

        backend = MegatronBackend(
            MegatronBackendOptions(
                model=model,
                lr=1e-6,
                recompute="full" if torch.cuda.is_available() else "none",
                fused_swiglu=torch.cuda.is_available(),
                fused_rope=torch.cuda.is_available(),
            )
        )
    else:
        from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

        backend = TorchBackend(
            TorchBackendOptions(model=model, device=args.device, lr=1e-6, gradient_checkpointing="on")
        )
    machine = benchmark_common.machine("torch", device=str(backend.device))
    card = machine["gpu"] or machine["cpu"]
    results: dict = {
        "model": args.shape or args.model,
        "layers": backend.model_description["num_hidden_layers"],
        "backend": args.backend,
        "device": str(backend.device),
        "card": card,
        "threads": torch.get_num_threads(),
        "machine": machine,
    }
    rounds = 1 if args.quick else 2
    print(
        f"trainer benchmark, shared prefixes: {results['model']} ({results['layers']} layers) through the "
        f"{args.backend} backend on {card} ({results['threads']} threads)"
    )
    if args.shared_prefix:
        clis = ["pi", "none"] if args.quick else args.clis.split(",")
        groups, turns = (1, (1, 2)) if args.quick else (args.groups, (1, 4))
        print_header()
        shapes = tuple((args.session_shape or ("recorded" if args.quick else "coding,recorded")).split(","))
        if not set(shapes) <= {"coding", "recorded"}:
            raise SystemExit(f"--session-shape: coding and/or recorded, not {args.session_shape!r}")
        results["shared_prefix"] = bench_shared_prefix(backend, clis, groups, turns, rounds, shapes, args.profile)
    if args.harness:
        results["harness"] = {args.harness: bench_harness(backend, args.harness, rounds)}
    benchmark_common.write_json(results, args.out, "trainer.json")


if __name__ == "__main__":
    main()
