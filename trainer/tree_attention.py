"""Attention over a packed stream of pieces (trainer/batches.py): each piece attends causally to itself
and fully to its ancestor pieces, never to anything else.

One scaled_dot_product_attention call per piece: the piece's queries against the keys and values of
its ancestors (root first) followed by its own, with the causal mask aligned to the lower right
(query i of an n-token piece below m ancestor tokens sees keys 0 .. m + i). A root piece is plain
causal attention. So a trace's tokens see exactly the keys they see when the trace runs alone, and
the cost is what the tree holds: a shared prefix's queries are computed once, each branch's queries
attend over prefix + branch. The alternative, one call over the whole row with an [L, L] mask, costs
L^2 whatever the tree, which on a 20k-token prompt is most of the work sharing is meant to save.

On a GPU a root piece runs the fused causal kernels. A piece below others, in half precision, runs
two cuDNN calls merged by their log-sum-exps (`_BranchAttention`); otherwise it passes its mask as a
lower-right CausalBias, which SDPA hands to a fused kernel where one takes it (flash attention, or
memory-efficient attention, which takes no GQA) and materialises otherwise. On a CPU the lower-right
mask of a piece is materialised, [n, m + n] booleans, per call. Measured on one H100 (Qwen3-4B's heads,
a 20.3k-token prompt and 8 branches of 0.6k-3k tokens, forward and backward of one layer), before the
cuDNN split: 80 ms with the CausalBias, 73 ms with FlexAttention over one block mask (compiled),
89 ms with flash attention's variable-length kernel over each piece's gathered keys, 198 ms for the
traces one by one; a materialised mask instead of the CausalBias (cuDNN forced or not) was slower
still. The same split over flash attention calls made a whole Megatron step slower (13.9 s against
12.3 s): torch's flash kernel runs at under half of cuDNN's speed on Hopper.

Both backends use it: the torch backend through transformers' attention interface (registered as
``TREE_ATTENTION``, the row's layout passed as the ``tree_layout`` keyword of the model's forward),
the megatron backend from its core attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

TREE_ATTENTION = "polar_tree"  # the attention implementation's name in transformers' registry


@dataclass(frozen=True)
class TreeLayout:
    """Pieces tiling a stream [0, T) in order, each with the spans of its ancestors (root first)."""

    spans: tuple[tuple[int, int], ...]  # (start, end) of each piece in the stream
    ancestors: tuple[tuple[tuple[int, int], ...], ...]  # per piece, its ancestors' spans, root first

    @classmethod
    def from_pieces(cls, lengths: Sequence[int], parents: Sequence[int], total: int | None = None) -> TreeLayout:
        """From piece lengths and parents (indices into the same list, -1 for a root); ``total``: the
        stream's length, when a padding tail follows the pieces (a root piece of its own)."""
        spans, ancestors, at = [], [], 0
        for length, parent in zip(lengths, parents, strict=True):
            if parent >= len(spans):
                raise ValueError(f"piece {len(spans)}'s parent {parent} does not come before it")
            spans.append((at, at + length))
            ancestors.append(ancestors[parent] + (spans[parent],) if parent >= 0 else ())
            at += length
        if total is not None and total > at:
            spans.append((at, total))
            ancestors.append(())
        return cls(tuple(spans), tuple(ancestors))

    @property
    def shares(self) -> bool:
        return any(self.ancestors)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: TreeLayout,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of one stream: query [heads, T, d], key and value [kv_heads, T, d] (kv_heads divides
    heads) -> [heads, T, d]."""
    gqa = query.shape[0] != key.shape[0]
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # What autocast does for scaled_dot_product_attention, done here once: the lower-right
        # CausalBias checks its inputs' dtypes before autocast would see the call (transformers'
        # Qwen3 hands over fp32 queries and keys, after their norm, with bf16 values).
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    outputs = []
    for (start, end), ancestors in zip(layout.spans, layout.ancestors):
        q = query[None, :, start:end]  # [1, heads, n, d]
        if not ancestors:
            k, v = key[None, :, start:end], value[None, :, start:end]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            first = ancestors[0][0]
            contiguous = all(a[1] == b[0] for a, b in zip(ancestors, ancestors[1:] + ((start, end),)))
            if contiguous:  # a first child right after its parent: no copy
                k, v = key[None, :, first:end], value[None, :, first:end]
            else:
                spans = (*ancestors, (start, end))
                k = torch.cat([key[:, a:b] for a, b in spans], dim=1)[None]  # [1, kv_heads, m + n, d]
                v = torch.cat([value[:, a:b] for a, b in spans], dim=1)[None]
            if end - start > 1 and _cudnn_takes(q):  # cuDNN refuses one query over one key
                m = k.shape[2] - (end - start)
                out = _BranchAttention.apply(q, k[:, :, :m], v[:, :, :m], k[:, :, m:], v[:, :, m:],
                                             scale if scale is not None else q.shape[-1] ** -0.5)
            else:
                mask = _lower_right(end - start, k.shape[2], query.device)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outputs.append(out[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _cudnn_takes(query: torch.Tensor) -> bool:
    """Whether cuDNN's attention serves this piece: half precision on a GPU, heads of at most 128."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 128
            and torch.backends.cuda.cudnn_sdp_enabled())  # fmt: skip


def _cudnn_attention(q, k, v, causal: bool, scale: float):
    """cuDNN's attention: (output [1, heads, n, d], its log-sum-exp [1, heads, n, 1], what its backward needs)."""
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale
    )
    return result[0], result[1], (result[4], result[5], result[6], result[7])


def _cudnn_attention_backward(dout, q, k, v, out, lse, saved, causal: bool, scale: float):
    max_q, max_k, seed, offset = saved
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, seed, offset, None, None, None, max_q, max_k,
        0.0, causal, scale=scale,
    )  # fmt: skip


class _BranchAttention(torch.autograd.Function):
    """A piece below others, on a GPU: its queries against its ancestors' keys (no mask) and against
    its own (causal), two cuDNN calls merged by their log-sum-exps. Each part's backward is cuDNN's,
    given the merged output and log-sum-exp: that is the gradient of one part of a softmax over the
    union of the keys. torch sends a lower-right causal mask to flash attention, which ran at less than
    half of cuDNN's speed on an H100. There, a Claude Code-shaped Megatron step of the 4B shape took
    6.08 s before and 5.32 s after (scripts/bench_trainer.py --shared-prefix compare --backend megatron
    --shape qwen3-4b --device cuda --clis claude-code --session-shape coding --groups 1)."""

    @staticmethod
    def forward(ctx, q, k_above, v_above, k_own, v_own, scale: float):
        out_above, lse_above, saved_above = _cudnn_attention(q, k_above, v_above, False, scale)
        out_own, lse_own, saved_own = _cudnn_attention(q, k_own, v_own, True, scale)
        lse = torch.logaddexp(lse_above, lse_own)
        out = (out_above.float() * (lse_above - lse).exp() + out_own.float() * (lse_own - lse).exp()).to(q.dtype)
        ctx.save_for_backward(q, k_above, v_above, k_own, v_own, out, lse)
        ctx.saved = (saved_above, saved_own)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_above, v_above, k_own, v_own, out, lse = ctx.saved_tensors
        saved_above, saved_own = ctx.saved
        dout = dout.contiguous()
        dq_above, dk_above, dv_above = _cudnn_attention_backward(
            dout, q, k_above, v_above, out, lse, saved_above, False, ctx.scale)  # fmt: skip
        dq_own, dk_own, dv_own = _cudnn_attention_backward(dout, q, k_own, v_own, out, lse, saved_own, True, ctx.scale)
        return dq_above + dq_own, dk_above, dv_above, dk_own, dv_own, None


def _lower_right(queries: int, keys: int, device: torch.device):
    """The causal mask of the last ``queries`` of ``keys`` positions: a CausalBias that the fused GPU
    kernels take without a mask tensor; on a CPU (where it would warn on every call that no fused
    kernel takes it, then materialise it) the boolean mask itself."""
    if device.type == "cuda":
        return causal_lower_right(queries, keys)
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(diagonal=keys - queries)


def hf_tree_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      tree_layout: Sequence[TreeLayout] | None = None, **kwargs):
    """transformers' attention-function signature: query [R, heads, L, d], key / value [R, kv_heads,
    L, d] -> ([R, L, heads, d], None). ``tree_layout``: one layout per row; None: plain causal
    attention over every row (rows of one sequence, padded at the end, which causal attention never
    reads). transformers builds no mask for an implementation it does not know, so none is read."""
    if dropout:
        raise ValueError("tree attention has no dropout")
    if tree_layout is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = torch.stack([tree_attention(q, k, v, layout, scaling)
                           for q, k, v, layout in zip(query, key, value, tree_layout, strict=True)])
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers() -> None:
    """Make ``attn_implementation=TREE_ATTENTION`` available to transformers' models."""
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, hf_tree_attention)
