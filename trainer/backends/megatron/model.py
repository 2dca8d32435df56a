"""A Megatron-Core GPT model shaped like a Hugging Face Llama / Qwen2 / Qwen3 checkpoint.

Polar's layer spec is Megatron's local spec (ColumnParallel / RowParallel linears, torch RMSNorm,
SwiGLU as a gated fc1, optional QK-norm) with two modules changed. Core attention is `SDPAttention`,
which calls torch's scaled_dot_product_attention (flash / memory-efficient kernels on a GPU, GQA
without repeating the keys); Megatron's own `DotProductAttention` materialises the [s, s] scores and
refuses packed sequences. The MLP computes SwiGLU with a hand-written backward that keeps less for
it. TransformerEngine is not used, so the model runs wherever torch does.

Packed rows use Megatron's "thd" layout: every piece of every row (a sequence, or a part of a tree of
sequences sharing a prompt: trainer/batches.py) becomes one stretch of a single token stream,
described by cu_seqlens, and `SDPAttention` runs trainer.tree_attention over it: one causal attention
per stretch, over its ancestors' keys and its own. That is exact per-sequence attention with the
flash kernel's memory use; the alternative, one call with a [T, T] mask, costs T^2 memory and rules
the flash kernel out. A row's padding tail (padded layouts) is one more stretch whose outputs are
never read.

RoPE takes each token's position in its own sequence (the micro-batch's position_ids: a piece
continues its parent's). Megatron's thd rotary path splits the stream into its
sequences and runs half a dozen kernels on each, for queries and keys, in every layer; instead the
rotary cos / sin of every token are looked up once per forward (`RotaryPackedSeqParams`) and
`SDPAttention` rotates the whole stream's queries and keys in one pass each (torch.compile'd on a GPU
when `fused_rope` is set): the same arithmetic as Megatron's unfused path, in the activations' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.backends.megatron.runtime import import_megatron
from trainer.tree_attention import TreeLayout, tree_attention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
VOCAB_MULTIPLE = 128  # each rank's vocabulary slice is padded to a multiple of this (tensor-core shapes)


class UnsupportedModel(ValueError):
    """The Hugging Face config describes something this backend cannot build; the message says what."""


@dataclass(frozen=True)
class ModelShape:
    """What the Megatron model and the weight conversion need to know of a Hugging Face config."""

    model_type: str
    vocab_size: int  # the checkpoint's vocabulary (rows of embed_tokens)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qk_norm: bool  # Qwen3: RMSNorm over each head's queries and keys
    qkv_bias: bool  # Qwen2: biases on q, k and v (not on o)
    tied_embeddings: bool

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        """From a transformers config object; UnsupportedModel for what the model cannot represent."""
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedModel(f"RoPE scaling ({rope_type}) is not supported")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation {config.hidden_act!r} is not supported (only silu)")
        if getattr(config, "mlp_bias", False):
            raise UnsupportedModel("MLP biases are not supported")
        if model_type != "qwen2" and getattr(config, "attention_bias", False):
            raise UnsupportedModel("attention biases on q/k/v/o are not supported (Qwen2's q/k/v biases are)")
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModel("sliding-window attention is not supported")
        heads = config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=config.max_position_embeddings,
            qk_norm=model_type == "qwen3",
            qkv_bias=model_type == "qwen2",
            tied_embeddings=bool(config.tie_word_embeddings),
        )

    def padded_vocab_size(self, tp_size: int) -> int:
        """Rows of Megatron's (padded) embedding and output layer: every rank gets an equal slice."""
        multiple = VOCAB_MULTIPLE * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_tensor_parallel(self, tp_size: int) -> None:
        for what, count in (
            ("attention heads", self.num_heads),
            ("key/value heads", self.num_kv_heads),
            ("MLP width", self.ffn_hidden_size),
        ):
            if count % tp_size:
                raise UnsupportedModel(f"{count} {what} cannot be split over {tp_size} tensor-parallel ranks")


def transformer_config(
    shape: ModelShape, tp_size: int, dtype: torch.dtype, recompute: str = "none", fused_swiglu: bool = False
):
    """Megatron's TransformerConfig for the shape. `recompute`: "none", "selective" (core attention
    recomputed in backward) or "full" (every layer's activations recomputed). `fused_swiglu`:
    Megatron's SwiGLU through torch.compile (one kernel each way, only fc1's output kept for
    backward); it needs a working Triton toolchain."""
    import_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute_options = {
        "none": {},
        "selective": {"recompute_granularity": "selective"},
        "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    }
    if recompute not in recompute_options:
        raise ValueError(f"recompute must be one of {', '.join(recompute_options)}, got {recompute!r}")
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Weights come from a checkpoint (or the caller's initialisation), built on the CPU first.
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=fused_swiglu,
        # The other fused kernels come from Apex / TransformerEngine, which Polar does not require.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,  # Megatron's needs TransformerEngine; SDPAttention applies RoPE itself
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Data-parallel gradients are summed, not averaged: the loss of each micro-batch is already
        # weighted for the whole update (Megatron's DistributedDataParallel reads this).
        calculate_per_token_loss=True,
        **recompute_options[recompute],
    )


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of fc1's output [..., 2F] = [gate | up], keeping only that output for backward.

    Autograd through `F.silu(gate) * up` would also keep silu(gate): [tokens, F] more per layer,
    about a sixth of a layer's activations in a Qwen3-4B shape.
    """

    @staticmethod
    def forward(ctx, fc1_out):
        gate, up = fc1_out.chunk(2, dim=-1)
        ctx.save_for_backward(fc1_out)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (fc1_out,) = ctx.saved_tensors
        gate, up = fc1_out.chunk(2, dim=-1)
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
        return torch.cat([grad_gate, grad * silu], dim=-1)


def _mlp_class():
    import_megatron()
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.transformer.mlp import MLP

    class SwiGLUMLP(MLP):
        """Megatron's MLP (same parameters and names) with SwiGLU computed by `_SwiGLU`, or by
        Megatron's torch.compile'd kernels when the config asks for activation fusion."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                raise ValueError("per-token scales (MoE experts) are not supported")
            fc1_out, _ = self.linear_fc1(hidden_states)  # [s, b, 2F/tp]
            if self.config.bias_activation_fusion:
                activated = bias_swiglu_impl(fc1_out, None)
            else:
                activated = _SwiGLU.apply(fc1_out)
            return self.linear_fc2(activated)

    return SwiGLUMLP


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of t [T, heads, d] with per-token cos / sin [T, 1, d] (Megatron's non-interleaved layout:
    the two halves of each head rotate against each other)."""
    first, second = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin


_compiled_rotate = None


def _fused_rotate():
    """`rotate` compiled into one kernel each way (dynamic: the stream's length changes per batch)."""
    global _compiled_rotate
    if _compiled_rotate is None:
        _compiled_rotate = torch.compile(rotate, dynamic=True)
    return _compiled_rotate


def _rotary_params_class():
    import_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class RotaryPackedSeqParams(PackedSeqParams):
        """Megatron's packed-sequence parameters, with the rotary cos / sin [T, 1, d] of every token
        of the stream (each token at its position in its own sequence), in the activations' dtype,
        and the stretches' tree (`tree`: each attends to its ancestors and itself)."""

        rotary_cos: torch.Tensor | None = None
        rotary_sin: torch.Tensor | None = None
        tree: TreeLayout | None = None

    return RotaryPackedSeqParams


def _sdpa_attention_class(fused_rope: bool):
    import_megatron()
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        """RoPE, then core attention through torch's scaled_dot_product_attention (causal, GQA), on a
        packed stream.

        Inherits the per-partition head counts and the softmax scale from DotProductAttention.
        """

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if attention_bias is not None:
                raise ValueError("attention bias is not supported by SDPAttention")
            if getattr(packed_seq_params, "rotary_cos", None) is None:
                raise ValueError("SDPAttention needs packed sequences with their rotary tables (selected_logits)")
            # thd: [t, heads, d]. Rotate the whole stream, then one causal attention per stretch
            # over its ancestors and itself.
            rotary = _fused_rotate() if fused_rope else rotate
            cos, sin = packed_seq_params.rotary_cos, packed_seq_params.rotary_sin
            query, key = rotary(query, cos, sin), rotary(key, cos, sin)
            out = tree_attention(
                query.transpose(0, 1),
                key.transpose(0, 1),
                value.transpose(0, 1),
                packed_seq_params.tree,
                self.softmax_scale,
            )  # [np, t, d]
            return out.transpose(0, 1).reshape(out.shape[1], -1)

    return SDPAttention


def layer_spec(shape: ModelShape, fused_rope: bool = False):
    """Polar's transformer-layer spec: Megatron's local spec with RoPE and SDPA in core attention."""
    import_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class(fused_rope)
    spec.submodules.mlp.module = _mlp_class()
    return spec


def build_model(
    shape: ModelShape,
    tp_size: int,
    dtype: torch.dtype,
    device: torch.device,
    recompute: str = "none",
    fused_swiglu: bool = False,
    fused_rope: bool = False,
):
    """An uninitialised GPTModel for this rank's shard (parameters allocated, values arbitrary).
    `fused_rope`: RoPE through torch.compile (needs Triton)."""
    import_megatron()
    from megatron.core.models.gpt import GPTModel

    shape.check_tensor_parallel(tp_size)
    model = GPTModel(
        config=transformer_config(shape, tp_size, dtype, recompute, fused_swiglu),
        transformer_layer_spec=layer_spec(shape, fused_rope),
        vocab_size=shape.padded_vocab_size(tp_size),
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.tied_embeddings,
    )
    # torch.nn.RMSNorm is created in the default dtype (fp32). Norm weights in the activations' dtype
    # let torch run its fused RMSNorm kernel (fp32 arithmetic inside, as Hugging Face's RMSNorm does);
    # with fp32 weights on bf16 inputs it falls back to an unfused fp32 path that keeps fp32 copies of
    # its input and output for backward (about 40% of a Qwen3-4B layer's activation memory).
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.to(dtype)
    return model.to(device)


def packed_seq_params(
    model, sequence_lengths: list[list[int]], parents: list[list[int]], position_ids: torch.Tensor, dtype: torch.dtype
):
    """Packed-sequence parameters for rows laid end to end: each row's pieces, then its padding (a
    stretch of its own); with the rotary tables of `model`'s RoPE at `position_ids` [R, L] and the
    stretches' tree.

    cu_seqlens stay on the CPU: they and the tree are read as Python ints.
    """
    rows, row_length = position_ids.shape
    lengths, stretch_parents = [], []
    for row, row_parents in zip(sequence_lengths, parents):
        offset = len(lengths)
        lengths.extend(row)
        stretch_parents.extend(parent + offset if parent >= 0 else -1 for parent in row_parents)
        if sum(row) < row_length:
            lengths.append(row_length - sum(row))
            stretch_parents.append(-1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    longest = max(lengths)
    positions = position_ids.reshape(-1)  # [T]
    furthest = int(positions.max()) + 1
    angles = model.rotary_pos_emb(furthest, packed_seq=True)[positions].squeeze(1)  # [T, 1, d] fp32
    return _rotary_params_class()(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        rotary_cos=angles.cos().to(dtype),
        rotary_sin=angles.sin().to(dtype),
        tree=TreeLayout.from_pieces(lengths, stretch_parents),
    )


def selected_logits(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    sequence_lengths: list[list[int]],
    parents: list[list[int]],
    keep: torch.Tensor,
) -> torch.Tensor:
    """This rank's vocabulary slice of the logits at flat positions `keep` [K] -> [K, V / tp].

    input_ids, position_ids [R, L] on the model's device; `sequence_lengths` and `parents`: each
    row's pieces (MicroBatch). The output layer runs only on the kept positions: prompts are most of
    a trace, and the output layer is the widest matrix.
    """
    rows, length = input_ids.shape
    tokens = input_ids.reshape(1, rows * length)  # [1, T]
    hidden = model.embedding(input_ids=tokens, position_ids=None)  # [T, 1, H]
    params = packed_seq_params(model, sequence_lengths, parents, position_ids, hidden.dtype)
    # No rotary_pos_emb: SDPAttention applies RoPE from params' tables.
    hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=None, packed_seq_params=params)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden[keep], weight=weight)  # [K, 1, V/tp]
    return logits.squeeze(1)
