"""trainer/bf16_adamw.py: stochastic rounding to bf16 is unbiased and lands on a neighbour; AdamW on bf16
parameters with it follows fp32 AdamW on average where round-to-nearest bf16 AdamW does not move."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.bf16_adamw import StochasticRoundingAdamW, stochastic_round_to_bf16


def neighbours(x: float) -> tuple[float, float]:
    """The bf16 values just below and above x (equal when x is one), from the bit pattern alone."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32).item()
    down = torch.tensor([bits & ~0xFFFF], dtype=torch.int32).view(torch.float32).item()
    up = (
        torch.tensor([(bits & ~0xFFFF) + (0x10000 if bits & 0xFFFF else 0)], dtype=torch.int32)
        .view(torch.float32)
        .item()
    )
    return (min(down, up), max(down, up))


finite = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, width=32).filter(lambda x: x != 0)


@settings(max_examples=60, deadline=None)
@given(finite, st.integers(0, 2**31 - 1))
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(x, seed):
    generator = torch.Generator().manual_seed(seed)
    draws = 20000
    values = torch.full((draws,), x, dtype=torch.float32)
    rounded = stochastic_round_to_bf16(values, torch.rand(draws, generator=generator)).float()
    low, high = neighbours(x)
    assert set(rounded.unique().tolist()) <= {low, high}
    if low != high:
        share_up = (rounded == high).double().mean().item()
        expected = (x - low) / (high - low)
        assert abs(share_up - expected) < 5 * (expected * (1 - expected) / draws) ** 0.5 + 1e-3


def test_a_bf16_value_rounds_to_itself():
    exact = torch.tensor([1.0, -0.5, 3.140625, 0.0], dtype=torch.float32)
    assert torch.equal(stochastic_round_to_bf16(exact, torch.full((4,), 0.999)).float(), exact)


def _train(optimizer_class, dtype, steps: int, **options) -> torch.Tensor:
    torch.manual_seed(0)
    start = torch.randn(4096) * 0.05
    param = torch.nn.Parameter(start.clone().to(dtype))
    optimizer = optimizer_class([param], lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0, **options)
    for step in range(steps):
        # The same direction every step, with noise: a gradient whose steps add up.
        param.grad = (torch.ones(4096) + 0.5 * torch.randn(4096, generator=torch.Generator().manual_seed(step))).to(
            dtype
        )
        optimizer.step()
    return param.detach().float() - start.to(dtype).float()


def test_small_steps_add_up_as_in_fp32():
    steps = 100
    reference = _train(torch.optim.AdamW, torch.float32, steps)  # about -lr per step on every weight
    rounded_to_nearest = _train(torch.optim.AdamW, torch.bfloat16, steps)
    stochastic = _train(StochasticRoundingAdamW, torch.bfloat16, steps)
    assert reference.mean().item() == pytest.approx(-steps * 1e-5, rel=0.15)
    # Round-to-nearest loses most of the movement (for weights of this size every step is under
    # half an ulp); stochastic rounding keeps it on average.
    assert abs(rounded_to_nearest.mean().item()) < 0.5 * abs(reference.mean().item())
    assert stochastic.mean().item() == pytest.approx(reference.mean().item(), rel=0.05)
    assert (stochastic - reference).abs().mean().item() < (rounded_to_nearest - reference).abs().mean().item()


def test_weight_decay_and_state_round_trip():
    param = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    optimizer = StochasticRoundingAdamW([param], lr=1e-2, weight_decay=0.1)
    param.grad = torch.zeros(8, dtype=torch.bfloat16)
    optimizer.step()
    # A zero gradient: only the decay acts, 1 * (1 - 1e-2 * 0.1) = 0.999, within one bf16 ulp.
    assert torch.all((param.float() - 0.999).abs() <= 2**-8)
    restored = StochasticRoundingAdamW([torch.nn.Parameter(param.detach().clone())], lr=1e-2)
    restored.load_state_dict(optimizer.state_dict())
    assert restored.state_dict()["state"][0]["step"] == 1


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="bf16 parameters"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.ones(2))])


@pytest.mark.gpu
def test_the_compiled_cuda_step_follows_fp32_adamw_on_average():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    start = (torch.randn(1 << 20) * 0.05).cuda()
    reference = torch.nn.Parameter(start.clone())
    stochastic = torch.nn.Parameter(start.clone().bfloat16())
    optimizers = [
        torch.optim.AdamW([reference], lr=1e-5, betas=(0.9, 0.99)),
        StochasticRoundingAdamW([stochastic], lr=1e-5, betas=(0.9, 0.99)),
    ]
    for _ in range(50):
        gradient = torch.ones_like(start) + 0.5 * torch.randn_like(start)
        reference.grad, stochastic.grad = gradient, gradient.bfloat16()
        for optimizer in optimizers:
            optimizer.step()
    moved = (reference.detach() - start).mean().item()
    assert moved == pytest.approx(-50 * 1e-5, rel=0.15)
    assert (stochastic.detach().float() - start.bfloat16().float()).mean().item() == pytest.approx(moved, rel=0.05)
