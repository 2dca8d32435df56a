"""Weight sync on a GPU: the trainer (this process) pushes new weights to an inference server (a
process of its own, on the same GPU) over CUDA IPC buckets and over the stream; afterwards the
server's logprobs of its own samples equal the trainer's bf16 logprobs within the spread of bf16.

Runs on the device machine only (`python -m pytest -m gpu tests/gpu/test_weight_sync_cuda.py`);
skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.served_weights import assert_serves_the_pushed_weights, serving_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def address():
    with serving_tiny_model() as served:
        yield served


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_after_a_sync_the_server_scores_as_the_trainer(address, transport):
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
    from trainer.weight_sync import InferencePool

    backend = TorchBackend(TorchBackendOptions(model="tiny", device="cuda", dtype="bfloat16"))
    generator = torch.Generator(device="cuda").manual_seed(len(transport))
    with torch.no_grad():
        for parameter in backend.model.parameters():
            parameter.add_(torch.randn(parameter.shape, device="cuda", generator=generator) * 0.02)
    # 1 MiB buckets: the embedding (and more) goes in pieces over several buckets.
    pool = InferencePool([address], transport=transport, bucket_bytes=1 << 20)
    try:
        expected = "cuda_ipc" if transport == "auto" else "stream"
        assert pool.transports() == [expected]
        result = pool.push(backend.hf_weights, note="step 1")
    finally:
        pool.close()
    assert result.transport == expected
    assert result.bytes_sent == sum(t.numel() * 2 for _, t in backend.hf_weights())
    assert_serves_the_pushed_weights(address, backend.model, result.policy_version, "cuda")
