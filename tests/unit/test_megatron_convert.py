"""The megatron backend's pure parts: HF <-> Megatron conversion with tensor-parallel sharding, the
vocabulary-parallel logprobs on one rank, and the SwiGLU backward. None needs megatron-core."""

from __future__ import annotations

import pytest
import torch

from trainer.backends.megatron.convert import hf_to_megatron, layer_of, megatron_names, megatron_to_hf
from trainer.backends.megatron.logprobs import TruncatedSamplingError, check_untruncated, vocab_parallel_logprobs
from trainer.backends.megatron.model import ModelShape, UnsupportedModel
from trainer.grpo import token_logprobs

pytest.importorskip("transformers")


def _shape(model_type: str, tied: bool, **overrides) -> ModelShape:
    from transformers import AutoConfig

    fields = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    fields.update(overrides)
    return ModelShape.from_hf_config(AutoConfig.for_model(model_type, **fields))


def _hf_state(shape: ModelShape) -> dict[str, torch.Tensor]:
    """Random HF tensors with the shapes transformers gives this model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        shape.model_type,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied_embeddings,
    )
    model = AutoModelForCausalLM.from_config(config)
    return {name: torch.randn_like(p) for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type,tied", [("qwen3", False), ("qwen2", True), ("llama", False)])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_hf_megatron_hf_is_exact(model_type, tied, tp_size):
    shape = _shape(model_type, tied)
    hf = _hf_state(shape)
    shards = [hf_to_megatron(hf, shape, rank, tp_size) for rank in range(tp_size)]
    assert set(shards[0]) == set(megatron_names(shape))
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_shards_hold_whole_kv_groups():
    """Rank r's fused QKV holds query heads 2r, 2r+1 ... of its KV group r, then k_r, then v_r."""
    shape = _shape("qwen3", False, num_attention_heads=4, num_key_value_heads=2, head_dim=1, hidden_size=1)
    d = shape.head_dim
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(4.0).reshape(4, 1),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[10.0], [11.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[20.0], [21.0]]),
    }
    ranks = [
        hf_to_megatron(hf, shape, rank, 2)["decoder.layers.0.self_attention.linear_qkv.weight"] for rank in range(2)
    ]
    assert d == 1
    assert ranks[0].flatten().tolist() == [0.0, 1.0, 10.0, 20.0]
    assert ranks[1].flatten().tolist() == [2.0, 3.0, 11.0, 21.0]


def test_fc1_shards_are_gate_then_up():
    shape = _shape(
        "llama", False, intermediate_size=4, hidden_size=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1
    )
    hf = {
        "model.layers.0.mlp.gate_proj.weight": torch.arange(4.0).reshape(4, 1),
        "model.layers.0.mlp.up_proj.weight": torch.arange(10.0, 14.0).reshape(4, 1),
    }
    ranks = [hf_to_megatron(hf, shape, rank, 2)["decoder.layers.0.mlp.linear_fc1.weight"] for rank in range(2)]
    assert ranks[0].flatten().tolist() == [0.0, 1.0, 10.0, 11.0]
    assert ranks[1].flatten().tolist() == [2.0, 3.0, 12.0, 13.0]


def test_vocabulary_is_padded_to_equal_slices_and_unpadded_back():
    shape = _shape("qwen3", False)
    embed = torch.randn(300, 32)
    shards = [hf_to_megatron({"model.embed_tokens.weight": embed}, shape, rank, 2) for rank in range(2)]
    slices = [s["embedding.word_embeddings.weight"] for s in shards]
    assert [tuple(s.shape) for s in slices] == [(256, 32), (256, 32)]
    assert torch.equal(slices[1][300 - 256 :], torch.zeros(212, 32))
    assert torch.equal(megatron_to_hf(shards, shape)["model.embed_tokens.weight"], embed)


def test_a_fused_group_must_come_whole():
    shape = _shape("qwen3", False)
    hf = _hf_state(shape)
    del hf["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(KeyError, match="v_proj"):
        hf_to_megatron(hf, shape, 0, 1)


def test_one_layer_converts_alone():
    shape = _shape("qwen2", True)
    hf = _hf_state(shape)
    layer = {name: t for name, t in hf.items() if layer_of(name) == 1}
    converted = hf_to_megatron(layer, shape, 0, 2)
    assert converted and all(name.startswith("decoder.layers.1.") for name in converted)


@pytest.mark.parametrize(
    "overrides,what",
    [
        ({"hidden_act": "gelu"}, "activation"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "RoPE scaling"),
        ({"attention_bias": True}, "attention biases"),
    ],
)
def test_unsupported_configs_are_refused(overrides, what):
    with pytest.raises(UnsupportedModel, match=what):
        _shape("llama", False, **overrides)


def test_uneven_tensor_parallel_split_is_refused():
    with pytest.raises(UnsupportedModel, match="key/value heads"):
        _shape("qwen3", False).check_tensor_parallel(8)


def test_single_rank_vocab_parallel_logprobs_equal_token_logprobs_with_padding_left_out():
    torch.manual_seed(0)
    vocab, padded, rows = 300, 384, 37
    logits = torch.randn(rows, vocab, dtype=torch.float64).float()
    targets = torch.randint(0, vocab, (rows,))
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.7] * 10)[:rows]
    padded_logits = torch.cat([logits, torch.full((rows, padded - vocab), 50.0)], dim=1).requires_grad_(True)
    reference_logits = logits.clone().requires_grad_(True)
    ones = torch.ones(rows)
    ours = vocab_parallel_logprobs(padded_logits, targets, temperature, vocab_start=0, vocab_size=vocab, chunk_rows=8)
    theirs = token_logprobs(reference_logits, targets, temperature, torch.zeros(rows, dtype=torch.long), ones)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    weights = torch.randn(rows)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(padded_logits.grad[:, :vocab], reference_logits.grad, atol=1e-6, rtol=0)
    assert torch.equal(padded_logits.grad[:, vocab:], torch.zeros(rows, padded - vocab))


def test_truncated_sampling_is_refused_and_greedy_is_not():
    temperature = torch.tensor([0.0, 1.0])
    check_untruncated(300, temperature, torch.tensor([5, 0]), torch.tensor([0.5, 1.0]))  # greedy ignores both
    with pytest.raises(TruncatedSamplingError, match="top_k"):
        check_untruncated(300, temperature, torch.tensor([0, 20]), torch.ones(2))
    with pytest.raises(TruncatedSamplingError):
        check_untruncated(300, temperature, torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.9]))


def test_swiglu_backward_is_the_gradient():
    from trainer.backends.megatron.model import _SwiGLU

    fc1_out = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (fc1_out,))
    gate, up = fc1_out.detach().chunk(2, dim=-1)
    torch.testing.assert_close(_SwiGLU.apply(fc1_out), torch.nn.functional.silu(gate) * up)
