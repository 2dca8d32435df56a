"""Attention over a packed stream of pieces (trainer/batches.py): each piece attends causally to itself
and fully to its ancestor pieces, never to anything else.

Siblings below the same ancestors share one call over the ancestors' keys, merged by log-sum-exp with
each piece's causal call over its own; both backends use it. The kernels and the measured speedups:
docs/design/packing.md.
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


def tree_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: TreeLayout, scale: float | None = None
) -> torch.Tensor:
    """Attention of one stream: query [heads, T, d], key and value [kv_heads, T, d] (kv_heads divides
    heads) -> [heads, T, d], a view of a tensor laid out token by token ([T, heads, d] contiguous),
    the layout both callers want back."""
    gqa = query.shape[0] != key.shape[0]
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # What autocast does for scaled_dot_product_attention, done here once: the lower-right
        # CausalBias checks its inputs' dtypes before autocast would see the call (transformers'
        # Qwen3 hands over fp32 queries and keys, after their norm, with bf16 values).
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    segments: list[tuple[int, torch.Tensor]] = []  # (where in the stream, output [n, heads, d])
    siblings: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}  # ancestors -> spans below them
    kernel = _split_kernel(query)
    for (start, end), ancestors in zip(layout.spans, layout.ancestors):
        q = query[None, :, start:end]  # [1, heads, n, d]
        if not ancestors:
            k, v = key[None, :, start:end], value[None, :, start:end]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        elif kernel == "cpu" or (kernel == "cudnn" and end - start > 1):  # cuDNN refuses one query over one key
            siblings.setdefault(ancestors, []).append((start, end))
            continue
        else:
            spans = (*ancestors, (start, end))
            k, v = _gather(key, spans), _gather(value, spans)
            mask = _lower_right(end - start, k.shape[2], query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        segments.append((start, out[0].transpose(0, 1)))
    for ancestors, spans in siblings.items():
        out = _SiblingAttention.apply(
            _gather(query, spans),
            _gather(key, ancestors),
            _gather(value, ancestors),
            _gather(key, spans),
            _gather(value, spans),
            kernel,
            tuple(end - start for start, end in spans),
            scale if scale is not None else query.shape[-1] ** -0.5,
        )[0].transpose(0, 1)
        if _follow_each_other(spans):
            segments.append((spans[0][0], out))
            continue
        at = 0
        for start, end in spans:
            segments.append((start, out[at : at + end - start]))
            at += end - start
    segments.sort(key=lambda segment: segment[0])
    out = segments[0][1] if len(segments) == 1 else torch.cat([out for _, out in segments])
    return out.transpose(0, 1)


def _follow_each_other(spans: Sequence[tuple[int, int]]) -> bool:
    return all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _gather(stream: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[heads, T, d] -> [1, heads, n, d]: the spans' rows in order; a view where they follow each other."""
    if _follow_each_other(spans):
        return stream[None, :, spans[0][0] : spans[-1][1]]
    return torch.cat([stream[:, a:b].transpose(0, 1) for a, b in spans]).transpose(0, 1)[None]


def _split_kernel(query: torch.Tensor) -> str | None:
    """The kernel that runs pieces below others as two calls merged by their log-sum-exps: "cudnn"
    (half precision on a GPU, heads of at most 128), "cpu" (torch's flash attention for the CPU),
    or None (one call per piece under its lower-right causal mask)."""
    if query.is_cuda:
        cudnn = query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 128
        return "cudnn" if cudnn and torch.backends.cuda.cudnn_sdp_enabled() else None
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "cpu"
    return None


def _cudnn_attention(q, k, v, causal: bool, scale: float):
    """cuDNN's attention over contiguous q, k, v: (output [1, heads, n, d], its log-sum-exp [1, heads,
    n, 1], what its backward needs)."""
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return result[0], result[1], (result[4], result[5], result[6], result[7])


def _cudnn_attention_backward(dout, q, k, v, out, lse, saved, causal: bool, scale: float):
    max_q, max_k, seed, offset = saved
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, None, None, max_q, max_k, 0.0, causal, scale=scale
    )


def _cpu_attention(q, k, v, causal: bool, scale: float):
    """torch's flash attention for the CPU, over contiguous q, k, v (kv heads dividing heads)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.unsqueeze(-1), None


def _cpu_attention_backward(dout, q, k, v, out, lse, saved, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale
    )


_KERNELS = {"cudnn": (_cudnn_attention, _cudnn_attention_backward), "cpu": (_cpu_attention, _cpu_attention_backward)}


def _merge(out_above, lse_above, out_own, lse_own):
    """Two attentions over disjoint keys -> the attention over their union: (output, log-sum-exp)."""
    lse = torch.logaddexp(lse_above, lse_own)
    out = out_above.float() * (lse_above - lse).exp() + out_own.float() * (lse_own - lse).exp()
    return out.to(out_above.dtype).contiguous(), lse.contiguous()


class _SiblingAttention(torch.autograd.Function):
    """The pieces below the same ancestors: all their queries against the ancestors' keys in one call
    (no mask), each piece's queries against its own keys in one more (causal), merged by their
    log-sum-exps. Each part's backward is the kernel's, given the merged output and log-sum-exp:
    that is the gradient of one part of a softmax over the union of the keys, and the one call over
    the ancestors sums their key and value gradients over the siblings.

    Why: on a GPU, torch sends a lower-right causal mask to flash attention, which ran at less than
    half of cuDNN's speed on an H100; and one call per sibling over the ancestors left cuDNN's
    backward, which walks the queries for each block of keys, a few hundred queries to walk. On a
    CPU, a masked call computes every query-key pair of the piece and its ancestors, and copies the
    ancestors' keys and values next to the piece's own.

    Every tensor handed to the kernel is contiguous: torch caches cuDNN's graphs by the sizes and
    strides of q, k and v alone, and a graph replayed with an output or output gradient laid out
    otherwise than when it was built computes wrong gradients (the GPU tier caught it with
    Megatron's layout)."""

    @staticmethod
    def forward(ctx, q, k_above, v_above, k_own, v_own, kernel: str, lengths: tuple[int, ...], scale: float):
        attention, _ = _KERNELS[kernel]
        q, k_above, v_above, k_own, v_own = (t.contiguous() for t in (q, k_above, v_above, k_own, v_own))
        out_above, lse_above, saved_above = attention(q, k_above, v_above, False, scale)
        own, at = [], 0
        for length in lengths:
            piece = slice(at, at + length)
            own.append(attention(*(t[:, :, piece].contiguous() for t in (q, k_own, v_own)), True, scale))
            at += length
        out_own = own[0][0] if len(own) == 1 else torch.cat([out for out, _, _ in own], dim=2)
        lse_own = own[0][1] if len(own) == 1 else torch.cat([lse for _, lse, _ in own], dim=2)
        out, lse = _merge(out_above, lse_above, out_own, lse_own)
        ctx.save_for_backward(q, k_above, v_above, k_own, v_own, out, lse)
        ctx.saved = (saved_above, [saved for _, _, saved in own])
        ctx.kernel, ctx.lengths, ctx.scale = kernel, lengths, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_above, v_above, k_own, v_own, out, lse = ctx.saved_tensors
        saved_above, saved_own = ctx.saved
        _, backward = _KERNELS[ctx.kernel]
        dout = dout.contiguous()
        dq, dk_above, dv_above = backward(dout, q, k_above, v_above, out, lse, saved_above, False, ctx.scale)
        own, at = [], 0
        for length, saved in zip(ctx.lengths, saved_own):
            piece = slice(at, at + length)
            parts = (t[:, :, piece].contiguous() for t in (dout, q, k_own, v_own, out, lse))
            own.append(backward(*parts, saved, True, ctx.scale))
            at += length
        if len(own) == 1:
            dq_own, dk_own, dv_own = own[0]
        else:
            dq_own, dk_own, dv_own = (torch.cat([part[i] for part in own], dim=2) for i in range(3))
        return dq + dq_own, dk_above, dv_above, dk_own, dv_own, None, None, None


def _lower_right(queries: int, keys: int, device: torch.device):
    """The causal mask of the last ``queries`` of ``keys`` positions: a CausalBias that the fused GPU
    kernels take without a mask tensor; on a CPU (where it would warn on every call that no fused
    kernel takes it, then materialise it) the boolean mask itself."""
    if device.type == "cuda":
        return causal_lower_right(queries, keys)
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(diagonal=keys - queries)


def hf_tree_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    tree_layout: Sequence[TreeLayout] | None = None,
    **kwargs,
):
    """transformers' attention-function signature: query [R, heads, L, d], key / value [R, kv_heads,
    L, d] -> ([R, L, heads, d], None). ``tree_layout``: one layout per row; None: plain causal
    attention over every row (rows of one sequence, padded at the end, which causal attention never
    reads). transformers builds no mask for an implementation it does not know, so none is read."""
    if dropout:
        raise ValueError("tree attention has no dropout")
    if tree_layout is not None:
        return torch.stack(
            [
                tree_attention(q, k, v, layout, scaling).transpose(0, 1)
                for q, k, v, layout in zip(query, key, value, tree_layout, strict=True)
            ]
        ), None
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers() -> None:
    """Make ``attn_implementation=TREE_ATTENTION`` available to transformers' models."""
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, hf_tree_attention)
