"""Training throughput of the megatron backend (TP=1, TP=2, TP=1 x DP=2) against the torch backend on
one shape.

One point is one backend at one layout (tensor-parallel size x data-parallel replicas): a full GRPO step (forward, backward and the
AdamW step over `--micro-batches` micro-batches, each one packed row of `--tokens` tokens made of
sequences of `--sequence-length` tokens) on a random-initialised Qwen3-4B-shaped model (hidden 2560,
36 layers, 32 query / 8 KV heads of 128, MLP 9728, vocabulary 151936, tied embeddings), in bf16.
Half of each sequence is prompt (no loss), half is trainable; the output layer runs only on the
trainable positions, in both backends.

    MFU = model FLOPs per step / (step seconds * peak bf16 FLOP/s of the GPUs used)
    model FLOPs per step = 3 * forward FLOPs (backward = 2 * forward; recomputation is not counted)
    forward FLOPs = sum over layers and tokens of 2 * (matmul parameters of the layer)
                  + sum over layers and sequences of 2 * 2 * heads * head_dim * s^2 / 2
                    (QK^T and AV, causal: half of the s x s scores)
                  + 2 * hidden * vocabulary per trainable position (the output layer)

Peak: 989 TFLOP/s dense bf16 for an H100 SXM or H200 (--peak-tflops for other cards). With data
parallelism the step's micro-batches are split over the replicas; MFU is per GPU. Each point runs
in fresh processes (one per GPU; rank 0 leads, the others follow, as under torchrun), so one point's
memory does not weigh on the next. A point that runs out of memory is reported as such. The CUDA
allocator runs with expandable segments (less fragmentation), and with tensor parallelism
CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue: the TP all-reduces run in issue order), as
scripts/launch_megatron.sh sets them; a value already in the environment is kept.

    python scripts/bench_megatron.py --quick          # a small model, under a minute
    python scripts/bench_megatron.py                  # Qwen3-4B shape, 8k-token packed rows
    python scripts/bench_megatron.py --device cpu --quick   # the script's own check, on gloo

Prints a table and writes JSON (default bench-results/megatron.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.batches import pack
from trainer.grpo import LossConfig
from trainer.sequences import TrainSequence

import benchmark_common

SKIPPED = "skipped"  # a point's error when the machine lacks its GPUs: not a failure
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense, SXM

QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QUICK = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Point:
    backend: str  # "megatron" or "torch"
    tp: int  # tensor-parallel size
    dp: int  # data-parallel replicas (GPUs used: tp * dp)
    card: str  # the GPU's name, or the CPU's model
    tokens_per_step: int
    trainable_tokens_per_step: int
    step_seconds: float  # median over the timed steps
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs / step seconds / GPUs
    mfu: float  # 0 where the card's peak is unknown
    peak_memory_gib: float  # rank 0's peak allocated memory (0 on the CPU)
    error: str = ""  # "out of memory" or the exception, when the point did not run


def step_flops(config: dict, sequence_lengths: list[int], trainable: int) -> float:
    """Model FLOPs of one training step (forward + backward) over sequences of these lengths."""
    hidden, heads, kv_heads, head_dim = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    layer_matmul_params = (
        hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * config["intermediate_size"]  # gate, up, down
    )
    tokens = sum(sequence_lengths)
    attention = sum(2 * 2 * heads * head_dim * s * s / 2 for s in sequence_lengths)
    forward = config["num_hidden_layers"] * (2 * layer_matmul_params * tokens + attention)
    forward += 2 * hidden * config["vocab_size"] * trainable
    return 3 * forward


def micro_batches(config: dict, tokens: int, sequence_length: int, count: int, seed: int = 0):
    """`count` packed rows of `tokens` tokens, each of sequences of `sequence_length` (the last one
    shorter when it does not divide), the second half of each sequence trainable."""
    rng = np.random.default_rng(seed)
    lengths = [sequence_length] * (tokens // sequence_length)
    if tokens % sequence_length:
        lengths.append(tokens % sequence_length)
    sequences = []
    for row in range(count):
        for index, length in enumerate(lengths):
            mask = np.zeros(length, dtype=bool)
            mask[length // 2 :] = True
            sequences.append(
                TrainSequence(
                    name=f"r{row}/s{index}",
                    token_ids=rng.integers(0, config["vocab_size"], length),
                    loss_mask=mask,
                    behaviour_logprobs=np.where(mask, -rng.uniform(0.1, 5.0, length), 0).astype(np.float32),
                    advantage=float(rng.normal()),
                    token_weight=1.0 / (count * len(lengths) * int(mask.sum())),
                    temperature=np.ones(length, dtype=np.float32),
                    top_p=np.ones(length, dtype=np.float32),
                    top_k=np.zeros(length, dtype=np.int32),
                )
            )
    batches = pack(sequences, tokens)
    assert len(batches) == count, [b.sequence_lengths for b in batches]
    return batches, lengths


def _peak_tflops(card: str, override: float) -> float:
    if override:
        return override
    return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in card), 0.0)


def _make_model_folder(config: dict, folder: Path, device: str = "cpu") -> None:
    """A random-initialised HF Qwen3 folder (bf16 safetensors, config, no tokenizer needed), its
    weights drawn on `device` (a 4B model's take minutes on a CPU, a second on a GPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf_config = Qwen3Config(**config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)


def _copy_tokenizer_stub(folder: Path) -> None:
    """The torch backend loads a tokenizer with the model; a word-level one stands in for Qwen's."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    stub = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=stub, unk_token="<unk>").save_pretrained(folder)


def _run_point(rank: int, tp: int, dp: int, port: int, backend_name: str, args: dict, out: str) -> None:
    """One rank of one point; rank 0 times the steps and writes the Point as JSON to `out`."""
    world = tp * dp
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if tp > 1:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # read when CUDA starts, which is later
    config, device = args["config"], args["device"]
    batches, lengths = micro_batches(config, args["tokens"], args["sequence_length"], args["micro_batches"])
    trainable = sum(b.trainable_tokens for b in batches)
    tokens = sum(b.tokens for b in batches)
    card = _card(device)
    backend = None
    try:
        if backend_name == "megatron":
            from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions

            backend = MegatronBackend(
                MegatronBackendOptions(
                    model=args["folder"],
                    tp_size=tp,
                    dtype=args["dtype"],
                    recompute=args["recompute"],
                    fused_swiglu=args["fused_swiglu"],
                    fused_rope=args["fused_rope"],
                    lr=1e-6,
                )
            )
            if rank != 0:
                backend.follow()
                return
        else:
            from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

            checkpointing = "on" if args["recompute"] == "full" else "off"
            backend = TorchBackend(
                TorchBackendOptions(
                    model=args["folder"],
                    device=device,
                    dtype=args["dtype"],
                    lr=1e-6,
                    gradient_checkpointing=checkpointing,
                )
            )
        loss = LossConfig()
        seconds = []
        for step in range(args["warmup"] + args["steps"]):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            backend.update(batches, loss)  # returns floats: the step has finished on the device
            if step >= args["warmup"]:
                seconds.append(time.perf_counter() - started)
        step_seconds = statistics.median(seconds)
        flops = step_flops(config, lengths * args["micro_batches"], trainable)
        per_gpu = flops / step_seconds / world
        peak = _peak_tflops(card, args["peak_tflops"]) * 1e12 if device == "cuda" else 0.0
        point = Point(
            backend=backend_name,
            tp=tp,
            dp=dp,
            card=card,
            tokens_per_step=tokens,
            trainable_tokens_per_step=trainable,
            step_seconds=step_seconds,
            tokens_per_s=tokens / step_seconds,
            tflops_per_gpu=per_gpu / 1e12,
            mfu=per_gpu / peak if peak else 0.0,
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
        )
    except torch.OutOfMemoryError:
        point = _failed(backend_name, tp, dp, card, "out of memory")
    except Exception as exc:  # reported in the table; the other points still run
        traceback.print_exc()
        point = _failed(backend_name, tp, dp, card, f"{type(exc).__name__}: {exc}")
    Path(out).write_text(json.dumps(asdict(point)))
    if point.error and world > 1:
        # The followers may wait in a collective that will never come: exiting with an error makes
        # spawn end them.
        os._exit(1)
    if backend_name == "megatron" and backend is not None:
        backend.close()


def _card(device: str) -> str:
    """The GPU's name on cuda (naming it starts CUDA in this process), else the CPU's model."""
    facts = benchmark_common.machine(device=device)
    return facts["gpu"] or facts["cpu"]


def _failed(backend: str, tp: int, dp: int, card: str, error: str) -> Point:
    return Point(
        backend=backend,
        tp=tp,
        dp=dp,
        card=card,
        tokens_per_step=0,
        trainable_tokens_per_step=0,
        step_seconds=0.0,
        tokens_per_s=0.0,
        tflops_per_gpu=0.0,
        mfu=0.0,
        peak_memory_gib=0.0,
        error=error,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = benchmark_common.parser(__doc__, "a small model and 2k-token rows: under a minute", "megatron.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--layouts",
        default="1x1,2x1,1x2",
        help="megatron points as TPxDP: tensor-parallel size x data-parallel replicas",
    )
    parser.add_argument("--backends", default="megatron,torch", help="torch runs on one GPU only")
    parser.add_argument("--tokens", type=int, help="tokens per packed row (default 8192, 2048 with --quick)")
    parser.add_argument(
        "--sequence-length", type=int, help="tokens per packed sequence (default 2048, 512 with --quick)"
    )
    parser.add_argument(
        "--micro-batches", type=int, default=0, help="rows per optimizer step (default 4, 2 with --quick)"
    )
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default 5, 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first (default 2, 1 with --quick)")
    parser.add_argument(
        "--recompute",
        default="none",
        choices=("none", "selective", "full"),
        help="megatron's recomputation; full also turns on the torch backend's gradient checkpointing",
    )
    parser.add_argument(
        "--fused-swiglu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="megatron: SwiGLU through torch.compile (default: on a GPU)",
    )
    parser.add_argument(
        "--fused-rope",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="megatron: RoPE through torch.compile (default: on a GPU)",
    )
    parser.add_argument("--model", help="a Hugging Face Qwen3 folder to use instead of a random one of the shape")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense bf16 TFLOP/s of one GPU")
    args = parser.parse_args()

    config = dict(QUICK if args.quick else QWEN3_4B)
    tokens = args.tokens or (2048 if args.quick else 8192)
    sequence_length = args.sequence_length or (512 if args.quick else 2048)
    device = args.device
    if device == "cpu" and not args.quick:
        parser.error("the CPU runs --quick only (it checks the script, it measures nothing useful)")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    points_wanted = []
    for name in args.backends.split(","):
        layouts = args.layouts.split(",") if name == "megatron" else ["1x1"]
        for layout in layouts:
            try:
                tp, dp = (int(part) for part in layout.split("x"))
            except ValueError:
                parser.error(f"--layouts: {layout!r} is not TPxDP (say 2x1)")
            points_wanted.append((name, tp, dp))
    # Read by the CUDA allocator of the spawned ranks.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    scratch = Path(tempfile.mkdtemp(prefix="bench-megatron-"))
    try:
        if args.model:
            folder = Path(args.model)
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(folder)
            config = {key: getattr(hf, key, None) for key in QWEN3_4B}
        else:
            folder = scratch / "model"
            started = time.perf_counter()
            _make_model_folder(config, folder)
            _copy_tokenizer_stub(folder)
            print(f"random model written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        shared = {
            "config": config,
            "device": device,
            "folder": str(folder),
            "tokens": tokens,
            "sequence_length": sequence_length,
            "micro_batches": args.micro_batches or (2 if args.quick else 4),
            "steps": args.steps or (2 if args.quick else 5),
            "warmup": args.warmup or (1 if args.quick else 2),
            "recompute": args.recompute,
            "peak_tflops": args.peak_tflops,
            "fused_swiglu": device == "cuda" if args.fused_swiglu is None else args.fused_swiglu,
            "fused_rope": device == "cuda" if args.fused_rope is None else args.fused_rope,
            "dtype": "bfloat16" if device == "cuda" else "float32",
        }
        points = []
        for name, tp, dp in points_wanted:
            if device == "cuda" and tp * dp > gpus:
                points.append(_failed(name, tp, dp, _card(device), f"{SKIPPED}: needs {tp * dp} GPUs, {gpus} visible"))
                continue
            result = scratch / f"{name}-{tp}x{dp}.json"
            try:
                torch.multiprocessing.spawn(
                    _run_point, args=(tp, dp, _free_port(), name, shared, str(result)), nprocs=tp * dp
                )
            except Exception as exc:  # a rank died (out of memory on a follower, say): others still run
                if not result.exists():
                    failed = _failed(name, tp, dp, _card(device), f"a rank failed: {exc}")
                    result.write_text(json.dumps(asdict(failed)))
            points.append(Point(**json.loads(result.read_text())))
            print("  ".join(_cells(points[-1])), file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    _print_table(points, shared)
    settings = {k: v for k, v in shared.items() if k not in ("config", "folder")}
    # Only now: naming the GPU starts CUDA in this process, which would hold memory on it while ranks run.
    machine = benchmark_common.machine("torch", "megatron-core", device=device)
    report = {"machine": machine, "shape": config, "settings": settings, "points": [asdict(p) for p in points]}
    benchmark_common.write_json(report, args.out, "megatron.json")
    return 0 if all(not p.error or p.error.startswith(SKIPPED) for p in points) else 1


def _cells(p: Point) -> tuple[str, ...]:
    if p.error:
        return (p.backend, str(p.tp), str(p.dp), p.error)
    return (
        p.backend,
        str(p.tp),
        str(p.dp),
        f"{p.step_seconds * 1e3:.0f}",
        f"{p.tokens_per_s:.0f}",
        f"{p.tflops_per_gpu:.1f}",
        f"{100 * p.mfu:.1f}",
        f"{p.peak_memory_gib:.1f}",
    )


def _print_table(points: list[Point], settings: dict) -> None:
    print(
        f"{settings['micro_batches']} rows x {settings['tokens']} tokens (sequences of {settings['sequence_length']}) "
        f"per step, recompute={settings['recompute']}, fused_swiglu={settings['fused_swiglu']}, "
        f"fused_rope={settings['fused_rope']}, {points[0].card if points else ''}"
    )
    header = ("backend", "tp", "dp", "step ms", "tok/s", "TFLOP/s", "MFU %", "peak GiB")
    benchmark_common.print_table(header, [_cells(p) for p in points if not p.error])
    for p in points:
        if p.error:
            print(f"{p.backend} tp={p.tp} dp={p.dp}: {p.error}")


if __name__ == "__main__":
    sys.exit(main())
