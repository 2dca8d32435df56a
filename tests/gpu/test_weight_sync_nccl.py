"""Weight sync over NCCL between two GPUs: the trainer (this process, cuda:0) broadcasts new weights
to an inference server (a process of its own, on the second GPU) over a group set up through the server's
UpdateWeightsCollective stream; afterwards the server's logprobs of its own samples equal the
trainer's within the spread of bf16 itself.

Runs on a machine with two GPUs (`python -m pytest -m gpu tests/gpu/test_weight_sync_nccl.py`);
skipped with fewer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

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


def second_gpu() -> str:
    """CUDA_VISIBLE_DEVICES for a process that sees only this process's second GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1] if visible else "1"


@pytest.fixture(scope="module")
def address():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": second_gpu()}
    process = subprocess.Popen([sys.executable, "-c", _SERVE], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    assert line.startswith("port "), line
    yield f"127.0.0.1:{line.split()[1]}"
    process.stdin.close()
    process.wait(timeout=60)


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


def _trainer_logprobs(model: torch.nn.Module, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tuple(tokens)], device="cuda:0")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(ids).logits.float()[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPT) :, None])[:, 0].cpu()


def test_after_an_nccl_sync_the_server_on_the_other_gpu_scores_as_the_trainer(address):
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
    from trainer.weight_sync import InferencePool

    torch.cuda.set_device(0)
    backend = TorchBackend(TorchBackendOptions(model="tiny", device="cuda:0", dtype="bfloat16"))
    generator = torch.Generator(device="cuda:0").manual_seed(7)
    with torch.no_grad():
        for parameter in backend.model.parameters():
            parameter.add_(torch.randn(parameter.shape, device="cuda:0", generator=generator) * 0.02)
    # 1 MiB buckets: the embedding (and more) goes in pieces over several broadcasts.
    pool = InferencePool([address], transport="nccl", bucket_bytes=1 << 20, timeout_s=60)
    try:
        assert pool.transports() == ["nccl"]
        results = [pool.push(backend.hf_weights, note=f"step {step}") for step in (1, 2)]  # a new group each sync
    finally:
        pool.close()
    result = results[-1]
    assert result.transport == "nccl" and result.policy_version == results[0].policy_version + 1
    assert result.bytes_sent == sum(t.numel() * 2 for _, t in backend.hf_weights())
    tokens, served, version = _sample(address, seed=3)
    assert version == result.policy_version
    served = torch.tensor(served)
    # What the server should say: the pushed bf16 weights, computed in fp32 ...
    reference = backend.model.to(torch.bfloat16).float()
    truth = _trainer_logprobs(reference, tokens, torch.float32)
    # ... and the spread of bf16 itself: the trainer's bf16 computation against that truth.
    spread = (_trainer_logprobs(reference, tokens, torch.bfloat16) - truth).abs().max().item()
    error = (served - truth).abs().max().item()
    assert error <= 2 * spread + 0.02, (error, spread)
