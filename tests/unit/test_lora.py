"""LoRA's layer against the merged weight it stands for, in float64: the same output, and the
adapter's gradients the chain rule of the merged weight's (dL/dB = s·dL/dW·Aᵀ, dL/dA = s·Bᵀ·dL/dW);
attaching, merging and the PEFT folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from polar import lora

ATOL = 1e-10  # float64


def layer(in_features: int, out_features: int, rank: int, alpha: float, seed: int, bias: bool) -> lora.LoraLinear:
    """A LoraLinear over a random base, with a random (not zero) B, so every term is exercised."""
    generator = torch.Generator().manual_seed(seed)
    base = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=generator, dtype=torch.float64))
        if bias:
            base.bias.copy_(torch.randn(base.bias.shape, generator=generator, dtype=torch.float64))
    adapted = lora.LoraLinear(base, rank, alpha / rank)
    with torch.no_grad():
        adapted.lora_A.weight.copy_(torch.randn(adapted.lora_A.weight.shape, generator=generator, dtype=torch.float64))
        adapted.lora_B.weight.copy_(torch.randn(adapted.lora_B.weight.shape, generator=generator, dtype=torch.float64))
    return adapted


shapes = st.tuples(
    st.integers(1, 12),  # in
    st.integers(1, 12),  # out
    st.integers(1, 6),  # rank
    st.floats(0.5, 64.0),  # alpha
    st.integers(0, 2**16),  # seed
    st.booleans(),  # bias
)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_the_adapted_layer_computes_the_merged_weight(shape) -> None:
    in_features, out_features, rank, alpha, seed, bias = shape
    adapted = layer(in_features, out_features, rank, alpha, seed, bias)
    x = torch.randn(3, 2, in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    expected = x @ adapted.merged_weight().T + (adapted.bias if bias else 0)
    torch.testing.assert_close(adapted(x), expected, atol=ATOL, rtol=0)
    with lora.disabled(adapted):
        torch.testing.assert_close(adapted(x), nn.functional.linear(x, adapted.weight, adapted.bias))


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_adapter_gradients_are_the_chain_rule_of_the_merged_weights(shape) -> None:
    in_features, out_features, rank, alpha, seed, bias = shape
    adapted = layer(in_features, out_features, rank, alpha, seed, bias)
    generator = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(5, in_features, dtype=torch.float64, generator=generator)
    probe = torch.randn(5, out_features, dtype=torch.float64, generator=generator)
    (adapted(x) * probe).sum().sin().backward()  # a non-linear loss of the output
    merged = adapted.merged_weight().detach().requires_grad_(True)
    (nn.functional.linear(x, merged, adapted.bias) * probe).sum().sin().backward()
    d_w, a, b, s = merged.grad, adapted.lora_A.weight.detach(), adapted.lora_B.weight.detach(), adapted.scaling
    torch.testing.assert_close(adapted.lora_B.weight.grad, s * d_w @ a.T, atol=ATOL, rtol=1e-9)
    torch.testing.assert_close(adapted.lora_A.weight.grad, s * b.T @ d_w, atol=ATOL, rtol=1e-9)


def small_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def test_attach_adapts_the_targets_under_the_names_peft_writes() -> None:
    model = small_model()
    base_names = {name for name, _ in model.named_parameters()}
    adapted = lora.attach(model, lora.LoraSettings.parse(4, 8.0, "q_proj,down_proj"))
    assert adapted == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    names = {name for name, _ in model.named_parameters()}
    assert names - base_names == {
        f"{module}.lora_{which}.weight" for module in adapted for which in "AB"
    }  # the base keeps its names
    shapes = {name: tuple(p.shape) for name, p in lora.adapter_parameters(model)}
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 16)
    assert shapes["model.layers.0.mlp.down_proj.lora_B.weight"] == (16, 4)
    # B starts at zero: the adapted model computes what the base does.
    ids = torch.tensor([[1, 5, 7, 3]])
    with lora.disabled(model):
        base_logits = model(ids).logits
    torch.testing.assert_close(model(ids).logits, base_logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("rank", "alpha", "targets", "message"),
    [
        (0, 8.0, "q_proj", "lora_rank must be >= 1"),
        (4, 0.0, "q_proj", "lora_alpha must be"),
        (4, 8.0, " , ", "names no module"),
    ],
)
def test_bad_settings_are_refused_by_name(rank, alpha, targets, message) -> None:
    with pytest.raises(lora.LoraError, match=message):
        lora.LoraSettings.parse(rank, alpha, targets)


def test_a_target_that_matches_no_linear_layer_is_refused() -> None:
    with pytest.raises(lora.LoraError, match="qproj match no linear layer"):
        lora.attach(small_model(), lora.LoraSettings.parse(4, 8.0, "q_proj,qproj"))


def randomized(model: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(model):
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def test_merging_gives_the_plain_model_that_computes_the_same() -> None:
    model = small_model()
    lora.attach(model, lora.LoraSettings.parse(3, 6.0))
    randomized(model)
    ids = torch.tensor([[1, 5, 7, 3, 9]])
    adapted_logits = model(ids).logits
    state = lora.merged_state_dict(model)
    plain = small_model()
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state)
    torch.testing.assert_close(plain(ids).logits, adapted_logits, atol=1e-10, rtol=0)
    lora.merge_into(model)
    assert not list(lora.adapter_layers(model))
    torch.testing.assert_close(model(ids).logits, adapted_logits, atol=1e-10, rtol=0)


def test_an_adapter_folder_is_peft_s_layout_and_loads_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    settings_ = lora.LoraSettings.parse(2, 4.0, "q_proj,v_proj")
    model = small_model()
    lora.attach(model, settings_)
    randomized(model)
    lora.save_adapter(tmp_path / "adapter", model, settings_, base_model="some/base")
    config = json.loads((tmp_path / "adapter" / lora.CONFIG_FILE).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4.0)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == "some/base"
    keys = set(load_file(tmp_path / "adapter" / lora.WEIGHTS_FILE))
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in keys and len(keys) == 8
    saved = lora.read_adapter(tmp_path / "adapter")
    assert saved.settings == settings_ and saved.base_model == "some/base"
    fresh = small_model()
    lora.attach(fresh, saved.settings)
    lora.load_adapter_tensors(fresh, saved.tensors)
    for (name, ours), (_, theirs) in zip(lora.adapter_parameters(model), lora.adapter_parameters(fresh)):
        torch.testing.assert_close(theirs, ours.float().double(), msg=name)
    other = small_model()
    lora.attach(other, lora.LoraSettings.parse(2, 4.0, "q_proj"))
    with pytest.raises(lora.LoraError, match="unknown model.layers.0.self_attn.v_proj"):
        lora.load_adapter_tensors(other, saved.tensors)


def test_an_adapter_folder_of_an_unsupported_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / lora.CONFIG_FILE).write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    with pytest.raises(lora.LoraError, match="use_dora"):
        lora.read_adapter(tmp_path)
    (tmp_path / lora.CONFIG_FILE).write_text("{")
    with pytest.raises(lora.LoraError, match="not a readable adapter config"):
        lora.read_adapter(tmp_path)


def test_a_lora_run_s_server_holds_the_base_and_the_run_s_adapter(tmp_path: Path) -> None:
    from polar.app.train import train_plan
    from polar.config import StackConfig, TrainerConfig

    config = StackConfig(trainer=TrainerConfig(model="tiny", lora_rank=8, lora_alpha=16.0, lora_targets="q_proj"))
    stack, _ = train_plan(config, tmp_path / "run")
    inference = stack.inference
    assert (inference.model, inference.adapter, inference.policy_version) == ("tiny", "", 0)
    assert (inference.lora_rank, inference.lora_alpha, inference.lora_targets) == (8, 16.0, "q_proj")
    # Resumed: the latest checkpoint's adapter, at its policy version.
    step = tmp_path / "run" / "checkpoints" / "step-000004"
    (step / "tiny").mkdir(parents=True)
    (step / "tiny" / lora.CONFIG_FILE).write_text("{}")
    (step / "state.json").write_text(json.dumps({"step": 4, "policy_version": 4, "base_model": "tiny"}))
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-000004\n")
    stack, _ = train_plan(config, tmp_path / "run")
    assert (stack.inference.model, stack.inference.adapter) == ("tiny", str(step / "tiny"))
    assert stack.inference.policy_version == 4


def test_a_run_with_a_named_adapter_gets_room_for_it_and_needs_a_rank(tmp_path: Path) -> None:
    from polar.app.train import check_before_start, train_plan
    from polar.config import StackConfig, TrainerConfig

    named = TrainerConfig(model="tiny", lora_rank=8, lora_adapter_name="run-a")
    stack, _ = train_plan(StackConfig(trainer=named), tmp_path / "run")
    assert (stack.inference.lora_rank, stack.inference.max_adapters) == (8, 1)
    stack, _ = train_plan(StackConfig(trainer=TrainerConfig(model="tiny", lora_rank=8)), tmp_path / "other")
    assert stack.inference.max_adapters == 0
    with pytest.raises(ValueError, match="lora_adapter_name names a LoRA adapter: it needs lora_rank > 0"):
        check_before_start(TrainerConfig(lora_adapter_name="run-a"), dataset="")
