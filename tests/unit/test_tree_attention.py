"""Tree attention on a CPU: for random trees of pieces (siblings below shared ancestors, nested,
single tokens, none), the output and the gradients of queries, keys and values equal attention under
the tree's dense mask (each piece sees its ancestors and itself, causally), computed in float64. In
float32 the siblings run split through the CPU's flash attention; in float64, which that kernel does
not serve, each piece runs under its lower-right mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.tree_attention import TreeLayout, tree_attention


@st.composite
def trees(draw) -> TreeLayout:
    count = draw(st.integers(1, 9))
    lengths = [draw(st.integers(1, 24)) for _ in range(count)]
    parents = [-1] + [draw(st.integers(-1, index - 1)) for index in range(1, count)]
    padding = draw(st.integers(0, 5))
    return TreeLayout.from_pieces(lengths, parents, total=sum(lengths) + padding)


def dense_mask(layout: TreeLayout) -> torch.Tensor:
    total = layout.spans[-1][1]
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for (start, end), ancestors in zip(layout.spans, layout.ancestors):
        for above_start, above_end in ancestors:
            allowed[start:end, above_start:above_end] = True
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return allowed


@settings(max_examples=60, deadline=None)
@given(
    layout=trees(),
    heads=st.sampled_from([(4, 2), (3, 3), (6, 2)]),
    tokens_first=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_tree_attention_is_attention_under_the_trees_mask(layout, heads, tokens_first, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    total, dim = layout.spans[-1][1], 8
    counts = (heads[0], heads[1], heads[1])  # query, key and value heads
    inputs = [torch.randn(count, total, dim, generator=generator, dtype=torch.float64) for count in counts]
    grad = torch.randn(heads[0], total, dim, generator=generator, dtype=torch.float64)
    exact = [t.clone().requires_grad_() for t in inputs]
    expected = F.scaled_dot_product_attention(*(t[None] for t in exact), attn_mask=dense_mask(layout), enable_gqa=True)[
        0
    ]
    expected.backward(grad)
    ours = [t.to(dtype).requires_grad_() for t in inputs]
    # Megatron and transformers hand over [heads, T, d] views of tensors laid out token by token.
    laid_out = [t.transpose(0, 1).contiguous().transpose(0, 1) if tokens_first else t for t in ours]
    out = tree_attention(*laid_out, layout)
    out.backward(grad.to(dtype))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    for mine, reference in zip(ours, exact):
        torch.testing.assert_close(mine.grad.double(), reference.grad, rtol=1e-4, atol=1e-5)
