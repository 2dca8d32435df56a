"""Hugging Face <-> Megatron weight conversion, with tensor-parallel sharding. Pure functions.

    HF (Llama / Qwen2 / Qwen3)                        Megatron (one tensor-parallel rank)
    model.embed_tokens.weight                         embedding.word_embeddings.weight       vocab rows, padded
    model.layers.i.input_layernorm.weight             decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{weight,bias} ...self_attention.linear_qkv.{weight,bias}  per KV group
    model.layers.i.self_attn.o_proj.weight            ...self_attention.linear_proj.weight   input columns
    model.layers.i.self_attn.{q,k}_norm.weight        ...self_attention.{q,k}_layernorm.weight
    model.layers.i.post_attention_layernorm.weight    ...pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight          ...mlp.linear_fc1.weight               [gate; up] per rank
    model.layers.i.mlp.down_proj.weight               ...mlp.linear_fc2.weight               input columns
    model.norm.weight                                 decoder.final_layernorm.weight
    lm_head.weight (untied only)                      output_layer.weight                    vocab rows, padded

Megatron's fused QKV holds, for each KV group in turn, that group's query heads, then its key head,
then its value head; a rank holds a contiguous range of groups. Its fc1 holds the rank's slice of
the gate projection followed by its slice of the up projection (SwiGLU's chunk order). The vocabulary
is padded (zero rows) so every rank holds an equal slice; the padding is dropped on the way back.

Both directions convert whatever subset of names they are given, so a caller can stream one layer at
a time; the tensors of one fused group (q, k, v or gate, up) must come together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from trainer.backends.megatron.model import ModelShape

_LAYER = re.compile(r"^(model\.layers|decoder\.layers)\.(\d+)\.(.+)$")

# Per-layer names: Megatron suffix -> (HF suffixes, how the tensor is split over ranks).
#   None: replicated; ("dim", d): equal slices along d; "qkv" / "glu": fused, see the module docstring.
_LAYER_RULES: dict[str, tuple[tuple[str, ...], object]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), None),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), ("dim", 1)),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), None),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), None),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), ("dim", 1)),
}
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_GLOBAL_RULES: dict[str, tuple[tuple[str, ...], object]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), None),
    "output_layer.weight": (("lm_head.weight",), "vocab"),
}


def _rules(shape: ModelShape) -> dict[str, tuple[tuple[str, ...], object]]:
    """Every Megatron name of the model -> (its HF names, its split)."""
    rules = {}
    for name, rule in _GLOBAL_RULES.items():
        if name == "output_layer.weight" and shape.tied_embeddings:
            continue
        rules[name] = rule
    for layer in range(shape.num_layers):
        for suffix, (hf_suffixes, split) in _LAYER_RULES.items():
            if suffix in _QK_NORMS and not shape.qk_norm:
                continue
            if suffix.endswith("linear_qkv.bias") and not shape.qkv_bias:
                continue
            rules[f"decoder.layers.{layer}.{suffix}"] = (tuple(f"model.layers.{layer}.{s}" for s in hf_suffixes), split)
    return rules


def megatron_names(shape: ModelShape) -> list[str]:
    """Every Megatron parameter name of the model, in HF order (embeddings, layers, norm, head)."""
    return list(_rules(shape))


def hf_names(shape: ModelShape) -> list[str]:
    """Every HF tensor name the conversion produces (a tied model has no lm_head.weight)."""
    return [hf_name for hf_group, _ in _rules(shape).values() for hf_name in hf_group]


def replicated(name: str) -> bool:
    """Whether every tensor-parallel rank holds the whole parameter (the norms)."""
    return name.endswith("norm.weight")


def layer_of(name: str) -> int | None:
    """The layer index of an HF or Megatron name; None for the embeddings, final norm and head."""
    match = _LAYER.match(name)
    return int(match.group(2)) if match else None


def _qkv_groups(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q [nh*d, ...], k, v [ng*d, ...] -> [ng, (nh/ng + 2) * d, ...]: Megatron's group order."""
    groups, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    per_group = shape.num_heads // groups
    return torch.cat(
        [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, padding])


def hf_to_megatron(
    state_dict: Mapping[str, torch.Tensor], shape: ModelShape, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s Megatron tensors for the HF tensors given (any subset of whole fused groups).

    KeyError names an HF tensor that is missing from a fused group; names that are not part of the
    model (a tied lm_head, rotary buffers) are ignored.
    """
    out = {}
    for name, (hf_names, split) in _rules(shape).items():
        present = [n in state_dict for n in hf_names]
        if not any(present):
            continue
        if not all(present):
            raise KeyError(f"{name} needs {', '.join(hf_names)} together; missing {hf_names[present.index(False)]}")
        tensors = [state_dict[n] for n in hf_names]
        if split is None:
            value = tensors[0]
        elif split == "vocab":
            value = _pad_rows(tensors[0], shape.padded_vocab_size(tp_size)).chunk(tp_size)[tp_rank]
        elif split == "qkv":
            grouped = _qkv_groups(shape, *tensors)  # [ng, per-group rows, ...]
            value = grouped.chunk(tp_size)[tp_rank].reshape(-1, *grouped.shape[2:])
        elif split == "glu":
            gate, up = tensors
            value = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        else:
            value = tensors[0].chunk(tp_size, dim=split[1])[tp_rank]
        out[name] = value.clone()
    return out


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Whole HF tensors from every rank's Megatron tensors (shards[r] from rank r, the same names).

    With a single rank, tensors that need no reshuffling (norms, unpadded slices) are views of the
    inputs, not copies.
    """
    tp_size = len(shards)
    out = {}
    for name, (hf_names, split) in _rules(shape).items():
        if name not in shards[0]:
            continue
        parts = [shard[name] for shard in shards]
        if split is None:
            out[hf_names[0]] = parts[0]
        elif split == "vocab":
            whole = parts[0] if tp_size == 1 else torch.cat(parts)
            out[hf_names[0]] = whole[: shape.vocab_size]
        elif split == "qkv":
            groups, d = shape.num_kv_heads, shape.head_dim
            q_rows = shape.num_heads // groups * d
            grouped = torch.cat([p.reshape(groups // tp_size, q_rows + 2 * d, *p.shape[1:]) for p in parts])
            rest = grouped.shape[2:]
            q, k, v = grouped.split([q_rows, d, d], dim=1)
            for hf_name, tensor in zip(hf_names, (q, k, v)):
                out[hf_name] = tensor.reshape(-1, *rest)
        elif split == "glu":
            halves = [p.chunk(2) for p in parts]
            out[hf_names[0]] = torch.cat([gate for gate, _ in halves])
            out[hf_names[1]] = torch.cat([up for _, up in halves])
        else:
            out[hf_names[0]] = parts[0] if tp_size == 1 else torch.cat(parts, dim=split[1])
    return out
