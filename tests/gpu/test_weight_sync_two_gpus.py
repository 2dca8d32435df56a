"""Weight sync from a trainer on one GPU to an inference server on another, both on one machine (the
layout `scripts/bench_loop.py --device cuda:0 --trainer-device cuda:1` runs): the trainer (this
process, on cuda:1, its InferencePool told so as a run's is) pushes over CUDA IPC buckets it holds
on its own GPU, which the server (a process of its own, its engine on cuda:0) opens there and copies
to its GPU; afterwards the server's logprobs of its own samples equal the trainer's within the
spread of bf16 itself. A server that does not see the trainer's GPU refuses the buckets, and the
trainer streams that update instead.

Runs on a machine with two GPUs (`python -m pytest -m gpu tests/gpu/test_weight_sync_two_gpus.py`);
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

BUCKET_BYTES = 1 << 20  # the embedding (and more) goes in pieces over several buckets


@pytest.fixture
def backend():
    """The tiny model's trainer on cuda:1 (not this process's current CUDA device), its weights moved
    off the server's."""
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    trainer = TorchBackend(TorchBackendOptions(model="tiny", device="cuda:1", dtype="bfloat16"))
    generator = torch.Generator(device="cuda:1").manual_seed(11)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn(parameter.shape, device="cuda:1", generator=generator) * 0.02)
    return trainer


def test_a_server_on_the_other_gpu_takes_the_push_over_cuda_ipc_from_buckets_on_the_trainer_s_gpu(backend):
    from trainer.weight_sync import InferencePool

    with serving_tiny_model() as address:  # sees both GPUs, its engine on cuda:0
        before = {}
        for gpu in (0, 1):
            torch.cuda.reset_peak_memory_stats(gpu)
            before[gpu] = torch.cuda.memory_allocated(gpu)
        pool = InferencePool([address], transport="auto", bucket_bytes=BUCKET_BYTES, device=backend.device)
        try:
            assert pool.transports() == ["cuda_ipc"]
            result = pool.push(backend.hf_weights, note="step 1")
        finally:
            pool.close()
        assert result.transport == "cuda_ipc"
        assert result.bytes_sent == sum(t.numel() * 2 for _, t in backend.hf_weights())
        # The two buckets were on the trainer's GPU: this process put nothing on the server's.
        assert torch.cuda.max_memory_allocated(0) == before[0]
        assert torch.cuda.max_memory_allocated(1) >= before[1] + 2 * BUCKET_BYTES
        assert_serves_the_pushed_weights(address, backend.model, result.policy_version, "cuda:1")


def test_a_server_that_does_not_see_the_trainer_s_gpu_is_sent_the_stream(backend):
    from trainer.weight_sync import InferencePool

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first_gpu = visible.split(",")[0] if visible else "0"
    with serving_tiny_model(environment_with_repository(CUDA_VISIBLE_DEVICES=first_gpu)) as address:
        pool = InferencePool([address], transport="auto", bucket_bytes=BUCKET_BYTES, device=backend.device)
        try:
            assert pool.transports() == ["cuda_ipc"]  # offered, and on this machine
            result = pool.push(backend.hf_weights, note="step 1")
            # Later syncs take the next transport it offers rather than buckets it cannot open.
            assert pool.transports() == ["nccl"]
        finally:
            pool.close()
        assert result.transport == "stream"
        assert_serves_the_pushed_weights(address, backend.model, result.policy_version, "cuda:1")
