"""Weight sync: seconds and GB/s of one sync (Pause, transfer, CommitWeights, Resume) per transport.

The trainer's side is this process (InferencePool.push of a model's tensors); the inference server
is `polar serve inference` in a process of its own, as in a run, on a model folder of the same shape
with other (random) weights.

* CPU: SmolLM2-135M's shape (fp32, 538 MB) through shared memory (what a server on the trainer's
  machine is sent), over the gRPC stream and over a gloo broadcast, side by side in alternating
  rounds with the server as it was before the stream was made copy-free (`--serve-baseline`: each
  chunk parsed by protobuf, assembled in a bytearray, then copied into the parameter), and the
  ratios. Target: >= 1 GB/s.
* --device cuda: a Qwen3-4B-shaped model (bf16, 8 GB) from tensors on the GPU to a server on the same
  GPU, over CUDA IPC buckets and over the stream; with a second GPU, also over an NCCL broadcast to a
  server on that GPU (as a server on another machine would be reached). Target: <= 2 s, >= 4 GB/s,
  on the card named.

Each collective path (gloo, nccl) runs twice, against servers of its own: as in a run, one trainer
(InferencePool) sending every sync, so its group is kept between syncs; and "(rebuilt)", a new
trainer side per sync, so each sync builds its group anew (as every sync did before groups were
kept). Their ratio is the group's set-up cost. The trainer's side of the previous group is closed
before a "(rebuilt)" sync's clock starts, so its teardown (which every sync also paid before, after
its broadcasts) is not in that time.

    python scripts/bench_weight_sync.py --quick                 # CPU, under a minute on 2 cores
    python scripts/bench_weight_sync.py --device cuda --quick   # a GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import benchmark_common

SHAPES = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen3-4b": {**benchmark_common.QWEN3_SHAPES["qwen3-4b"], "vocab_size": 151936},
}


def model_folder(shape: str, dtype: torch.dtype, device: str, tokenizer: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write a model of `shape` with random weights to `out` (for the server); return other random
    tensors of the same names on `device` (the trainer's new weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    for name in benchmark_common.TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    weights = {name: torch.randn_like(p) * 0.02 for name, p in model.named_parameters()}
    del model
    return weights


def start_server(folder: Path, device: str, baseline: bool, gpu: str = "", lora_rank: int = 0) -> subprocess.Popen:
    """A server process; `gpu`: the one GPU it sees (CUDA_VISIBLE_DEVICES), else this process's;
    `lora_rank`: it serves a zero adapter of that rank, which a push replaces."""
    command = [sys.executable, __file__, "--serve-model", str(folder), "--device", device]
    if baseline:
        command.append("--serve-baseline")
    if lora_rank:
        command += ["--serve-lora-rank", str(lora_rank)]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def second_gpu() -> str:
    """CUDA_VISIBLE_DEVICES for a process that sees only this process's second GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1] if visible else "1"


def address_of(process: subprocess.Popen) -> str:
    """The port the server prints once it serves."""
    line = process.stdout.readline()
    if not line.startswith("port "):
        raise SystemExit(f"the inference server did not start: {line!r}")
    return f"127.0.0.1:{line.split()[1]}"


def serve(folder: str, device: str, baseline: bool, lora_rank: int = 0) -> None:
    """A server subprocess: prints its port, serves until stdin closes."""
    from polar.inference import server as server_module
    from polar.inference.engines import EngineOptions, create_engine

    async def main() -> None:
        options = EngineOptions(model=folder, device=device, max_batch_size=1, lora_rank=lora_rank)
        engine = create_engine("torch", options)
        if baseline:
            server_module.InferenceServicer = _baseline_servicer(server_module.InferenceServicer)
        server, port = await server_module.start_server(engine)
        print(f"port {port}", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await server.stop(None)
        await engine.stop()

    asyncio.run(main())


def _baseline_servicer(base):
    """The server as it was: each message parsed by protobuf (a copy of the chunk's bytes, and
    another when its data is read), assembled in a bytearray (a third), then update_weights (a
    fourth, into the parameters). Its range checks are left out: they copy nothing."""
    from polar.v1 import inference_pb2

    class Baseline(base):
        async def UpdateWeights(self, request_iterator, context):
            specs = self._engine.parameter_specs()
            buffers, header = {}, None
            async for raw in request_iterator:
                message = inference_pb2.UpdateWeightsRequest.FromString(raw)
                if message.WhichOneof("payload") == "header":
                    header = message.header
                    continue
                chunk = message.chunk
                buffer = buffers.get(chunk.name)
                if buffer is None:
                    spec = specs[chunk.name]
                    buffer = buffers[chunk.name] = (
                        bytearray(spec.dtype.itemsize * int(torch.Size(spec.shape).numel())),
                        spec,
                    )
                data = chunk.data
                buffer[0][chunk.offset : chunk.offset + len(data)] = data
            tensors = {
                name: torch.frombuffer(b, dtype=spec.dtype).reshape(spec.shape)
                if b
                else torch.empty(spec.shape, dtype=spec.dtype)
                for name, (b, spec) in buffers.items()
            }
            self._staged = (header.update_id, tensors, self._staging, sum(len(b) for b, _ in buffers.values()))
            return inference_pb2.UpdateWeightsResponse(policy_version=self._engine.policy_version, staged=True)

        async def _apply(self, tensors, staging, bytes_received):
            version = await self._engine.update_weights(tensors)
            return inference_pb2.UpdateWeightsResponse(
                policy_version=version, tensors_updated=len(tensors), bytes_received=bytes_received
            )

    return Baseline


def push(pool, weights: dict[str, torch.Tensor]):
    return pool.push(lambda: weights.items(), note="bench")


def main() -> None:
    parser = benchmark_common.parser(__doc__, "fewer rounds, under a minute on 2 CPU cores", "weight_sync.json")
    parser.add_argument("--device", default="cpu", help="cpu (SmolLM2-135M shape) or cuda (Qwen3-4B shape)")
    parser.add_argument(
        "--bucket-mb", type=int, default=256, help="CUDA IPC, shared memory, NCCL, gloo: MiB of each of the two buffers"
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="folder with the tokenizer files (default: tiny's)"
    )
    parser.add_argument("--serve-model", help=argparse.SUPPRESS)
    parser.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_model:
        serve(args.serve_model, args.device, args.serve_baseline, args.serve_lora_rank)
        return

    if args.tokenizer is None:
        from polar.inference.models import resolve_model

        args.tokenizer = Path(resolve_model("tiny"))
    from trainer.weight_sync import InferencePool

    cuda = args.device.startswith("cuda")
    shape, dtype = ("qwen3-4b", torch.bfloat16) if cuda else ("smollm2-135m", torch.float32)
    rounds = 1 if args.quick else 3
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    servers = []
    pools = {}
    try:
        weights = model_folder(shape, dtype, args.device, args.tokenizer, work / shape)
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        # name -> (transport, the server as it was before, the GPU the server sees: "" for this one's,
        # a new trainer side per sync)
        if cuda:
            cases = {"cuda_ipc": ("auto", False, "", False), "stream": ("stream", False, "", False)}
            if torch.cuda.device_count() >= 2:
                cases["nccl"] = ("nccl", False, second_gpu(), False)
                cases["nccl (rebuilt)"] = ("nccl", False, second_gpu(), True)
        else:
            cases = {
                "shm": ("shm", False, "", False),
                "stream": ("stream", False, "", False),
                "gloo": ("gloo", False, "", False),
                "gloo (rebuilt)": ("gloo", False, "", True),
                "stream (before)": ("stream", True, "", False),
            }
        # The servers start together, each in a process of its own.
        servers = [start_server(work / shape, args.device, baseline, gpu) for _, baseline, gpu, _ in cases.values()]
        addresses = {name: address_of(process) for name, process in zip(cases, servers)}
        pools = {
            name: InferencePool([addresses[name]], transport=case[0], bucket_bytes=args.bucket_mb << 20)
            for name, case in cases.items()
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        used: dict[str, str] = {}
        for name in cases:  # warm-up: allocations, handles, first connection, the kept group
            used[name] = push(pools[name], weights).transport
        for _ in range(rounds):
            for name, (transport, _, _, rebuilt) in cases.items():
                if rebuilt:
                    pools[name].close()
                    pools[name] = InferencePool(
                        [addresses[name]], transport=transport, bucket_bytes=args.bucket_mb << 20
                    )
                result = push(pools[name], weights)
                times[name].append(result.seconds)
    finally:
        for pool in pools.values():
            pool.close()
        for process in servers:
            process.stdin.close() if process.stdin else None
            process.kill()
        shutil.rmtree(work, ignore_errors=True)

    machine = benchmark_common.machine("torch", device=args.device)
    results = {
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": model_bytes,
        "device": args.device,
        "card": machine["gpu"] or machine["cpu"],
        "machine": machine,
        "rounds": rounds,
        "bucket_mb": args.bucket_mb,
        "paths": {},
    }
    for name, seconds in times.items():
        best = min(seconds)
        results["paths"][name] = {
            "transport": used[name],
            "seconds": best,
            "gb_per_s": model_bytes / best / 1e9,
            "all_seconds": seconds,
        }
    print(
        f"weight sync: {shape} ({results['dtype']}, {model_bytes / 1e9:.2f} GB) on {results['card']}, {rounds} alternating rounds, best of each"
    )
    paths = results["paths"]
    rows = [(name, row["transport"], f"{row['seconds']:.3f}", f"{row['gb_per_s']:.2f}") for name, row in paths.items()]
    benchmark_common.print_table(("path", "transport", "seconds", "GB/s"), rows, left=2, indent="  ")
    if "shm" in results["paths"]:
        ratio = results["paths"]["stream"]["seconds"] / results["paths"]["shm"]["seconds"]
        results["shm_over_stream"] = ratio
        print(f"  shared memory / stream: {ratio:.2f}x faster")
    if "stream (before)" in results["paths"]:
        ratio = results["paths"]["stream (before)"]["seconds"] / results["paths"]["stream"]["seconds"]
        results["stream_speedup"] = ratio
        print(f"  stream now / before: {ratio:.2f}x faster")
    for backend in ("gloo", "nccl"):
        if f"{backend} (rebuilt)" in results["paths"]:
            ratio = results["paths"][f"{backend} (rebuilt)"]["seconds"] / results["paths"][backend]["seconds"]
            results[f"{backend}_kept_group_speedup"] = ratio
            print(f"  {backend} kept group / rebuilt: {ratio:.2f}x faster")
    benchmark_common.write_json(results, args.out, "weight_sync.json")


if __name__ == "__main__":
    main()
