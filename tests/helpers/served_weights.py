"""For the GPU weight-sync tests: an inference server in a process of its own, and the check that after
a push it scores its own samples as the trainer's weights do, within the spread of bf16 itself."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (1, 9690, 28, 905, 17, 42)
_SERVE = """
import asyncio, sys
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.server import start_server
async def main():
    engine = create_engine("torch", EngineOptions(model="tiny", device="cuda", dtype="bfloat16", max_batch_size=4))
    server, port = await start_server(engine)
    print("port", port, flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(None)
    await engine.stop()
asyncio.run(main())
"""


@contextlib.contextmanager
def serving_tiny_model(env: dict[str, str] | None = None) -> Iterator[str]:
    """The tiny model served in bf16 on CUDA by a process of its own (`env`: its environment); yields
    its address. It stops when its stdin closes."""
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    line = process.stdout.readline()
    assert line.startswith("port "), line
    yield f"127.0.0.1:{line.split()[1]}"
    process.stdin.close()
    process.wait(timeout=60)


def environment_with_repository(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _sample(address: str, seed: int) -> tuple[list[int], list[float], int]:
    from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True),
        )
        tokens, logprobs, versions = [], [], set()
        for message in stub.Generate(request, timeout=120):
            tokens += message.token_ids
            logprobs += message.logprobs
            versions.add(message.policy_version)
    assert len(versions) == 1
    return tokens, logprobs, versions.pop()


def _trainer_logprobs(model: torch.nn.Module, tokens: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tuple(tokens)], device=device)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(ids).logits.float()[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPT) :, None])[:, 0].cpu()


def assert_serves_the_pushed_weights(address: str, model: torch.nn.Module, policy_version: int, device: str) -> None:
    """The server, at `policy_version`, scores its own sample as `model`'s bf16 weights do, within twice
    the spread of bf16 itself (the trainer's bf16 computation against fp32 on the same weights)."""
    tokens, served, version = _sample(address, seed=3)
    assert version == policy_version
    served = torch.tensor(served)
    reference = model.to(torch.bfloat16).float()
    truth = _trainer_logprobs(reference, tokens, torch.float32, device)
    spread = (_trainer_logprobs(reference, tokens, torch.bfloat16, device) - truth).abs().max().item()
    error = (served - truth).abs().max().item()
    assert error <= 2 * spread + 0.02, (error, spread)
