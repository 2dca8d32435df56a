"""The torch backend with LoRA against the same model with the adapter merged, in float64 on a CPU:
the same logprobs and loss over shared-prefix micro-batches, and the adapter's gradients are the
chain rule applied to the merged weights' gradients. The optimizer holds the adapters alone, a push
and a checkpoint carry them alone, and a checkpoint loads back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from polar import lora
from tests.helpers.trainer_backends import LOSS, sample_sequences, save_tiny_model
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import pack
from trainer.grpo import LossConfig

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")


def shared_prefix_batches(max_tokens: int = 64):
    """The sample traces, three of them beginning with the same four prompt tokens, packed as trees."""
    sequences = sample_sequences()
    for sequence in sequences[1:]:
        sequence.token_ids[:3] = sequences[0].token_ids[:3]
    batches = pack(sequences, max_tokens, share_prefixes=True, min_saving=1)
    assert any(parent >= 0 for batch in batches for parent in batch.row_parents(0))  # a tree was made
    return batches


def float64_backend(folder: Path, **options) -> TorchBackend:
    backend = TorchBackend(TorchBackendOptions(model=str(folder), device="cpu", lr=1e-3, grad_clip=0.0, **options))
    backend.model.double()
    return backend


def with_random_adapters(backend: TorchBackend) -> None:
    """B random instead of zero: otherwise dL/dA is zero and the adapter computes nothing."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(backend.model):
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def update_capturing_gradients(backend: TorchBackend, batches, loss: LossConfig = LOSS):
    """backend.update, with each trained parameter's gradient as the optimizer got it."""
    gradients = {}
    step = backend._step

    def capture() -> None:
        gradients.update({name: p.grad.clone() for name, p in backend.model.named_parameters() if p.grad is not None})
        step()

    backend._step = capture
    return backend.update(batches, loss), gradients


def test_a_lora_step_equals_the_merged_model_s_and_its_gradients_follow_the_chain_rule(folder: Path) -> None:
    adapted = float64_backend(folder, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS)
    with_random_adapters(adapted)
    merged = float64_backend(folder)
    merged.model.load_state_dict(lora.merged_state_dict(adapted.model))
    batches = shared_prefix_batches()

    for ours, theirs in zip(adapted.logprobs(batches), merged.logprobs(batches), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)  # logprobs are taken in fp32
    layers = dict(lora.adapter_layers(adapted.model))
    before = {name: (layer.lora_A.weight.clone(), layer.lora_B.weight.clone()) for name, layer in layers.items()}
    ours, adapter_gradients = update_capturing_gradients(adapted, batches)
    theirs, weight_gradients = update_capturing_gradients(merged, batches)

    assert ours.loss == pytest.approx(theirs.loss, abs=1e-9)
    assert (ours.tokens, ours.trainable_tokens) == (theirs.tokens, theirs.trainable_tokens)
    # Only the adapters have gradients: the base is frozen.
    assert set(adapter_gradients) == {name for name, _ in lora.adapter_parameters(adapted.model)}
    assert len(layers) == 2 * 7
    for name, layer in layers.items():
        a, b = before[name]
        d_w = weight_gradients[f"{name}.weight"]
        s = layer.scaling
        torch.testing.assert_close(adapter_gradients[f"{name}.lora_B.weight"], s * d_w @ a.T, atol=1e-8, rtol=1e-6)
        torch.testing.assert_close(adapter_gradients[f"{name}.lora_A.weight"], s * b.T @ d_w, atol=1e-8, rtol=1e-6)


def test_the_optimizer_push_and_checkpoint_hold_the_adapters_alone(folder: Path, tmp_path: Path) -> None:
    backend = TorchBackend(
        TorchBackendOptions(model=str(folder), device="cpu", lr=1e-2, lora_rank=RANK, lora_alpha=ALPHA)
    )
    adapters = dict(lora.adapter_parameters(backend.model))
    optimized = [p for group in backend.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in adapters.values()}
    base = {name: p.clone() for name, p in backend.model.named_parameters() if name not in adapters}
    batches = shared_prefix_batches()
    result = backend.update(batches, LOSS)
    assert result.grad_norm > 0
    for name, parameter in backend.model.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name
    pushed = dict(backend.hf_weights())
    assert set(pushed) == set(adapters)
    pushed_bytes = sum(t.numel() * t.element_size() for t in pushed.values())
    model_bytes = sum(p.numel() * p.element_size() for p in base.values())
    assert pushed_bytes < model_bytes / 4

    backend.save(tmp_path / "adapter", tmp_path / "optimizer.pt")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    loaded = TorchBackend(
        TorchBackendOptions(model=str(folder), device="cpu", lr=1e-2, adapter=str(tmp_path / "adapter"))
    )
    loaded.load_optimizer(tmp_path / "optimizer.pt")
    for name, tensor in loaded.hf_weights():
        assert torch.equal(tensor, pushed[name]), name
    backend.update(batches, LOSS)
    loaded.update(batches, LOSS)
    after = dict(backend.hf_weights())
    for name, tensor in loaded.hf_weights():
        assert torch.equal(tensor, after[name]), name


def test_the_kl_reference_of_a_lora_run_is_the_base_model(folder: Path) -> None:
    adapted = TorchBackend(
        TorchBackendOptions(model=str(folder), device="cpu", lora_rank=RANK, lora_alpha=ALPHA, reference_model=True)
    )
    with_random_adapters(adapted)
    assert adapted.reference is None  # no copy of the model is kept
    base = TorchBackend(TorchBackendOptions(model=str(folder), device="cpu"))
    batches = shared_prefix_batches()
    for ours, theirs in zip(adapted.logprobs(batches, reference=True), base.logprobs(batches), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    moved = max(float((a - b).abs().max()) for a, b in zip(adapted.logprobs(batches), base.logprobs(batches)))
    assert moved > 1e-3  # the adapter does change the policy
    result = adapted.update(batches, LossConfig(kl_coef=0.5))
    assert np.isfinite(result.loss) and result.stats["kl"] > 0
