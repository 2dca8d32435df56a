"""The megatron backend against the torch backend on the same tiny models and tokens (CPU, gloo, fp32).

At TP=1 (in this process) and TP=2 (two spawned processes: rank 0 leads, rank 1 follows) the
logprobs, the GRPO loss, the gradient norm and the weights after one optimizer step match the torch
backend's; the saved folder loads in transformers. Skipped when megatron-core is not installed.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'polar[megatron]')")

from megatron_fixtures import micro_batches, save_tiny_model  # noqa: E402

from trainer.backends.base import BackendError  # noqa: E402
from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions, TruncatedSamplingError  # noqa: E402
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions  # noqa: E402
from trainer.grpo import LossConfig  # noqa: E402

pytestmark = pytest.mark.slow

ATOL = 1e-5  # fp32, two implementations of the same model (summation orders differ)
# AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps, rounding-level
# differences in g change that element's step by a visible fraction. So one element may differ by up
# to 10% of a step, and the mean by 0.1%; a wrongly mapped gradient moves many elements a whole step
# (or two, the other way).
WEIGHT_MAX_STEPS, WEIGHT_MEAN_STEPS = 0.1, 1e-3
LOSS = LossConfig(clip_low=0.2, clip_high=0.28, importance_cap=2.0)
LR = 1e-3  # large enough that a wrongly mapped gradient moves a weight visibly


def _torch_reference(folder: Path):
    backend = TorchBackend(TorchBackendOptions(model=str(folder), device="cpu", dtype="float32", lr=LR))
    batches = micro_batches()
    logprobs = backend.logprobs(batches)
    result = backend.update(batches, LOSS)
    return logprobs, result, {name: t.clone() for name, t in backend.hf_weights()}


def _assert_matches(reference, logprobs, result, weights):
    ref_logprobs, ref_result, ref_weights = reference
    for ours, theirs in zip(logprobs, ref_logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert result.loss == pytest.approx(ref_result.loss, abs=ATOL)
    assert result.grad_norm == pytest.approx(ref_result.grad_norm, rel=1e-5)
    assert result.stats["clip_fraction"] == pytest.approx(ref_result.stats["clip_fraction"])
    assert (result.tokens, result.trainable_tokens) == (ref_result.tokens, ref_result.trainable_tokens)
    assert set(weights) == set(ref_weights)
    for name, tensor in ref_weights.items():
        difference = (weights[name] - tensor).abs()
        assert float(difference.max()) <= WEIGHT_MAX_STEPS * LR, f"{name}: {float(difference.max())}"
        assert float(difference.mean()) <= WEIGHT_MEAN_STEPS * LR, f"{name}: {float(difference.mean())}"


@pytest.mark.parametrize("model_type,tied", [("qwen3", False), ("qwen2", True), ("llama", False)])
def test_tp1_matches_the_torch_backend(tmp_path, model_type, tied):
    folder = save_tiny_model(tmp_path / "model", model_type, tied)
    reference = _torch_reference(folder)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", lr=LR))
    assert backend.model_description["vocab_size"] == 300
    batches = micro_batches()
    logprobs = backend.logprobs(batches)
    result = backend.update(batches, LOSS)
    _assert_matches(reference, logprobs, result, {name: t.clone() for name, t in backend.hf_weights()})


def test_saved_folder_loads_in_transformers_and_optimizer_state_restores(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "model", "qwen3", False)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", lr=LR))
    backend.update(micro_batches(), LOSS)
    backend.save(tmp_path / "saved", tmp_path / "optimizer.pt")
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").named_parameters())
    for name, tensor in backend.hf_weights():
        assert torch.equal(loaded[name], tensor), name
    reloaded = MegatronBackend(MegatronBackendOptions(model=str(tmp_path / "saved"), dtype="float32", lr=LR))
    reloaded.load_optimizer(tmp_path / "optimizer.pt")
    assert reloaded.optimizer.state_dict()["state"][0]["step"] == 1


def test_truncated_sampling_is_refused_before_any_work(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama", False)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32"))
    batch = micro_batches()[0]
    batch.top_k[batch.loss_mask] = 40
    with pytest.raises(TruncatedSamplingError, match="top_k"):
        backend.logprobs([batch])
    with pytest.raises(BackendError, match="reference"):
        backend.update([batch], LossConfig(kl_coef=0.1))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tp_rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """One rank of a TP job, as torchrun would start it: rank 0 drives the backend, the rest follow."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = MegatronBackend(MegatronBackendOptions(model=folder, dtype="float32", lr=LR))
    if rank != 0:
        backend.follow()
        return
    out = Path(out)
    batches = micro_batches()
    logprobs = backend.logprobs(batches)
    result = backend.update(batches, LOSS)
    weights = {name: t.clone() for name, t in backend.hf_weights()}
    backend.save(out / "saved", out / "optimizer.pt")
    backend.load_optimizer(out / "optimizer.pt")
    backend.close()
    torch.save({"logprobs": logprobs, "result": result, "weights": weights}, out / "rank0.pt")


@pytest.mark.parametrize("model_type,tied", [("qwen3", False), ("qwen2", True)])
def test_tp2_on_gloo_matches_the_torch_backend(tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "model", model_type, tied)
    reference = _torch_reference(folder)
    torch.multiprocessing.spawn(_tp_rank, args=(2, _free_port(), str(folder), str(tmp_path)), nprocs=2)
    ours = torch.load(tmp_path / "rank0.pt", weights_only=False)
    _assert_matches(reference, ours["logprobs"], ours["result"], ours["weights"])
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").named_parameters())
    for name, tensor in ours["weights"].items():
        assert torch.equal(loaded[name], tensor), name
    assert len(torch.load(tmp_path / "optimizer.pt", weights_only=True)["ranks"]) == 2
