"""Shared-prefix packing on CUDA in bf16: a tree computes what its traces compute one by one, within
bf16's own spread.

Runs on the device machine only (`python -m pytest -m gpu tests/gpu/test_shared_prefix_cuda.py`);
skipped without CUDA (the megatron case also without megatron-core).

Two bf16 computations of the same thing round differently, so the tree is held to bf16's spread as
measured on the same traces: its logprobs may differ from the traces run alone in bf16 by at most
twice as much as those differ from the fp32 truth (plus 0.01 nats), its loss likewise (plus 1e-4),
and each parameter's gradient by at most twice the norm of the bf16-vs-fp32 difference (plus 1% of
the gradient's norm).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.trace_forests import alone, forest, keyed_logprobs, loss_and_gradients
from tests.helpers.trainer_backends import save_tiny_model
from trainer.batches import pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _computation(backend, batches):
    logprobs = keyed_logprobs(batches, backend._score(backend.model, batches))
    loss, gradients = loss_and_gradients(backend, batches)
    return logprobs, loss, gradients


def _assert_within_bf16_spread(make_backend, sequences, max_tokens: int) -> None:
    shared = pack(sequences, max_tokens, share_prefixes=True, min_saving=1)
    assert any(batch.shares_prefixes for batch in shared)
    truth = _computation(make_backend("float32"), alone(sequences))
    bf16 = make_backend("bfloat16")
    reference = _computation(bf16, alone(sequences))
    ours = _computation(bf16, shared)
    finite = [key for key, value in truth[0].items() if value > float("-inf")]
    spread = max(abs(reference[0][key] - truth[0][key]) for key in finite)
    difference = max(abs(ours[0][key] - reference[0][key]) for key in finite)
    assert difference <= 2 * spread + 0.01, (difference, spread)
    assert abs(ours[1] - reference[1]) <= 2 * abs(reference[1] - truth[1]) + 1e-4
    for name, gradient in reference[2].items():
        spread = float((gradient.float() - truth[2][name].float()).norm())
        difference = float((ours[2][name].float() - gradient.float()).norm())
        assert difference <= 2 * spread + 0.01 * float(gradient.float().norm()), (name, difference, spread)


def test_torch_backend_tree_within_bf16_spread(tmp_path):
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    folder = save_tiny_model(tmp_path / "model", "qwen3", tied=False)
    sequences = forest(0, 300, 40, [(8, 4), (0, 3), (6, 4)])

    def make(dtype: str):
        return TorchBackend(TorchBackendOptions(model=str(folder), device="cuda", dtype=dtype))

    _assert_within_bf16_spread(make, sequences, max_tokens=200)


def test_megatron_backend_tree_within_bf16_spread(tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'polar[megatron]')")
    from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions

    folder = save_tiny_model(tmp_path / "model", "qwen3", tied=False)
    sequences = forest(1, 300, 40, [(8, 4), (0, 3), (6, 4)], truncation=False)
    backends = {}

    def make(dtype: str):
        if dtype not in backends:
            backends[dtype] = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype=dtype))
        return backends[dtype]

    _assert_within_bf16_spread(make, sequences, max_tokens=200)


def test_a_branch_through_cudnn_is_attention_over_its_ancestors_and_itself():
    """A piece below others, in bf16: its output and the gradients of its queries, keys and values
    match fp32 attention under the lower-right causal mask, within bf16's rounding."""
    import torch.nn.functional as F

    from trainer.tree_attention import TreeLayout, tree_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, above, own = 8, 2, 128, 700, 300
    layout = TreeLayout.from_pieces([above, own], [-1, 0])
    query = torch.randn(heads, above + own, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(kv_heads, above + own, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(kv_heads, above + own, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(heads, above + own, dim, device="cuda", dtype=torch.bfloat16)
    tree_attention(query, key, value, layout).backward(grad)
    exact = [t.detach().float().requires_grad_() for t in (query, key, value)]
    causal = torch.ones(above + own, above + own, dtype=torch.bool, device="cuda").tril()
    expected = F.scaled_dot_product_attention(*(t[None] for t in exact), attn_mask=causal, enable_gqa=True)[0]
    expected.backward(grad.float())
    ours = tree_attention(query.detach(), key.detach(), value.detach(), layout)
    for mine, reference in [(ours, expected)] + [(t.grad, e.grad) for t, e in zip((query, key, value), exact)]:
        assert (mine.float() - reference).norm() <= 2e-2 * reference.norm()  # bf16 keeps 8 bits


@pytest.mark.parametrize("layout", ["heads first", "tokens first"])
def test_siblings_through_cudnn_are_attention_over_their_ancestors_and_themselves(layout):
    """Siblings below one root (one of them a single token) and a grandchild, in bf16: the output and
    the gradients of queries, keys and values match fp32 attention under the tree's mask. "tokens
    first": laid out as Megatron hands them over, queries and keys [T, heads, d], values a view of a
    fused projection (heads further apart than d)."""
    import torch.nn.functional as F

    from trainer.tree_attention import TreeLayout, tree_attention

    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 128
    tree = TreeLayout.from_pieces([700, 300, 1, 200, 150], [-1, 0, 0, 0, 1])
    total = tree.spans[-1][1]
    allowed = torch.zeros(total, total, dtype=torch.bool, device="cuda")
    for (start, end), ancestors in zip(tree.spans, tree.ancestors):
        for above_start, above_end in ancestors:
            allowed[start:end, above_start:above_end] = True
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    query = torch.randn(heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(heads, total, dim, device="cuda", dtype=torch.bfloat16)

    def laid_out(query, key, value):
        if layout == "heads first":
            return query, key, value
        fused = torch.stack([key.transpose(0, 1), value.transpose(0, 1)], dim=2)  # [T, kv_heads, 2, d]
        return (
            query.transpose(0, 1).contiguous().transpose(0, 1),
            key.transpose(0, 1).contiguous().transpose(0, 1),
            fused[:, :, 1].transpose(0, 1),
        )

    out = tree_attention(*laid_out(query, key, value), tree)
    out.backward(grad)
    exact = [t.detach().float().requires_grad_() for t in (query, key, value)]
    expected = F.scaled_dot_product_attention(*(t[None] for t in exact), attn_mask=allowed, enable_gqa=True)[0]
    expected.backward(grad.float())
    for mine, reference in [(out, expected)] + [(t.grad, e.grad) for t, e in zip((query, key, value), exact)]:
        assert (mine.float() - reference).norm() <= 2e-2 * reference.norm()  # bf16 keeps 8 bits
