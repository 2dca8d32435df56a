"""Weight sync over NCCL between two GPUs: the trainer (this process, cuda:0) broadcasts new weights
to an inference server (a process of its own, on the second GPU) over a group set up through the server's
UpdateWeightsCollective stream, built for the first sync and kept for the second; afterwards the
server's logprobs of its own samples equal the trainer's within the spread of bf16 itself.

Runs on a machine with two GPUs (`python -m pytest -m gpu tests/gpu/test_weight_sync_nccl.py`);
skipped with fewer.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.served_weights import (
    assert_serves_the_pushed_weights,
    environment_with_repository,
    serving_tiny_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def second_gpu() -> str:
    """CUDA_VISIBLE_DEVICES for a process that sees only this process's second GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1] if visible else "1"


@pytest.fixture(scope="module")
def address():
    with serving_tiny_model(environment_with_repository(CUDA_VISIBLE_DEVICES=second_gpu())) as served:
        yield served


def test_after_an_nccl_sync_the_server_on_the_other_gpu_scores_as_the_trainer(address):
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
    from trainer.weight_sync import InferencePool

    torch.cuda.set_device(0)
    backend = TorchBackend(TorchBackendOptions(model="tiny", device="cuda:0", dtype="bfloat16"))
    generator = torch.Generator(device="cuda:0").manual_seed(7)
    # 1 MiB buckets: the embedding (and more) goes in pieces over several broadcasts.
    pool = InferencePool([address], transport="nccl", bucket_bytes=1 << 20, timeout_s=60)
    results = []
    try:
        assert pool.transports() == ["nccl"]
        for step in (1, 2):  # other weights each step: the second sync goes over the kept group
            with torch.no_grad():
                for parameter in backend.model.parameters():
                    parameter.add_(torch.randn(parameter.shape, device="cuda:0", generator=generator) * 0.02)
            results.append(pool.push(backend.hf_weights, note=f"step {step}"))
    finally:
        pool.close()
    assert [[s.group for s in r.servers] for r in results] == [["new"], ["kept"]]
    result = results[-1]
    assert result.transport == "nccl" and result.policy_version == results[0].policy_version + 1
    assert result.bytes_sent == sum(t.numel() * 2 for _, t in backend.hf_weights())
    assert_serves_the_pushed_weights(address, backend.model, result.policy_version, "cuda:0")
