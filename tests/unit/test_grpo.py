"""The GRPO math: advantages, engine-faithful logprobs, the clipped loss and per-token weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.inference.sampling import batched_processed_logprobs
from polar.trajectory.rewards import token_share_weights
from trainer.grpo import (
    LossConfig,
    TraceWeighting,
    group_advantages,
    is_degenerate,
    merge_stats,
    policy_loss,
    token_logprobs,
    trace_token_weights,
)

CONFIG = LossConfig()
rewards_lists = st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=16)


# -------------------------------------------------------------------------------------------------
# Advantages


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, population variance 3.5
    centred = torch.tensor([-2.0, -1.0, 0.0, 3.0])
    torch.testing.assert_close(group_advantages(rewards, scale="none"), centred)
    torch.testing.assert_close(group_advantages(rewards), centred / (math.sqrt(3.5) + 1e-6))
    # Leave-one-out baselines: (12 - r_i) / 3 = [11/3, 10/3, 3, 2].
    loo = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])
    torch.testing.assert_close(group_advantages(rewards, scale="none", leave_one_out=True), loo)
    torch.testing.assert_close(group_advantages(rewards, leave_one_out=True), loo / (math.sqrt(3.5) + 1e-6))


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_groups_without_signal_get_exact_zeros(scale, leave_one_out):
    for rewards in ([0.7], [1.0, 1.0, 1.0], [0.0] * 8):
        advantages = group_advantages(torch.tensor(rewards), scale=scale, leave_one_out=leave_one_out)
        assert torch.equal(advantages, torch.zeros(len(rewards)))
        assert is_degenerate(torch.tensor(rewards))
    assert not is_degenerate([0.0, 1.0])


@pytest.mark.parametrize(
    "rewards, kwargs",
    [([1.0, 0.0], {"scale": "rank"}), ([], {}), ([1.0, math.nan], {}), ([math.inf, 0.0], {})],
)
def test_bad_groups_are_refused(rewards, kwargs):
    with pytest.raises(ValueError):
        group_advantages(torch.tensor(rewards), **kwargs)


@settings(max_examples=60, deadline=None)
@given(rewards_lists, st.floats(-50, 50, allow_nan=False), st.sampled_from(["std", "none"]), st.booleans())
def test_advantages_do_not_depend_on_a_shift_of_every_reward(rewards, shift, scale, leave_one_out):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    advantages = group_advantages(rewards, scale=scale, leave_one_out=leave_one_out)
    shifted = group_advantages(rewards + shift, scale=scale, leave_one_out=leave_one_out)
    torch.testing.assert_close(shifted, advantages, rtol=1e-6, atol=1e-6)
    assert abs(float(advantages.sum())) < 1e-6 * max(1.0, float(advantages.abs().max()))


# -------------------------------------------------------------------------------------------------
# Logprobs


def sampling_rows(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top_k, top_p mixing greedy, plain and truncated rows."""
    generator = torch.Generator().manual_seed(seed)
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.3])[torch.randint(4, (rows,), generator=generator)]
    top_k = torch.tensor([0, 0, 5, 64])[torch.randint(4, (rows,), generator=generator)]
    top_p = torch.tensor([1.0, 0.0, 0.9, 0.5])[torch.randint(4, (rows,), generator=generator)]
    return temperature, top_k, top_p


@pytest.mark.parametrize("truncating", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 3, 4096])
def test_token_logprobs_equal_the_engines_with_their_gradients(truncating, chunk_rows):
    rows, vocab = 23, 64
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).requires_grad_()
    temperature, top_k, top_p = sampling_rows(rows, seed=1)
    if not truncating:
        top_k, top_p = torch.zeros_like(top_k), torch.ones_like(top_p)
    engine = batched_processed_logprobs(logits, temperature, top_k, top_p)  # [N, V]
    # Targets the engine could have drawn: each row's most likely token or one it kept at random.
    kept = torch.isfinite(engine.detach())
    targets = torch.multinomial(kept.float(), 1, generator=generator).squeeze(-1)
    expected = engine.gather(-1, targets[:, None]).squeeze(-1)
    actual = token_logprobs(logits, targets, temperature, top_k, top_p, chunk_rows=chunk_rows)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    upstream = torch.randn(rows, generator=generator)
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream)
    (actual_grad,) = torch.autograd.grad(actual, logits, upstream)
    # fp32 rounding of the logsumexp (~1e-6 at these logits) shows in 1 - p of near-certain targets.
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=1e-5)
    with torch.no_grad():
        untracked = token_logprobs(logits, targets, temperature, top_k, top_p, chunk_rows=chunk_rows)
    assert torch.equal(untracked, actual.detach())


def test_tied_logits_at_the_truncation_boundary_are_kept_together():
    generator = torch.Generator().manual_seed(5)
    rows = 12
    logits = torch.randint(0, 4, (rows, 16), generator=generator).float().requires_grad_()  # many ties
    temperature = torch.full((rows,), 0.9)
    top_k = torch.tensor([1, 2, 3, 5, 0, 0] * 2)
    top_p = torch.tensor([1.0] * 4 + [0.3, 0.6] + [0.5] * 6)
    engine = batched_processed_logprobs(logits, temperature, top_k, top_p)
    targets = engine.detach().argmax(-1)
    expected = engine.gather(-1, targets[:, None]).squeeze(-1)
    actual = token_logprobs(logits, targets, temperature, top_k, top_p, chunk_rows=5)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    upstream = torch.randn(rows, generator=generator)
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream)
    (actual_grad,) = torch.autograd.grad(actual, logits, upstream)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=1e-6)


def test_token_logprobs_upcast_half_precision_logits():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    targets = torch.arange(5)
    temperature, top_k, top_p = torch.full((5,), 0.7), torch.zeros(5, dtype=torch.long), torch.ones(5)
    expected = (logits.float() / 0.7).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, temperature, top_k, top_p), expected)


# -------------------------------------------------------------------------------------------------
# The loss

losses = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        *[
            st.lists(st.floats(lo, hi, allow_nan=False), min_size=n, max_size=n)
            for lo, hi in [(-1.0, 1.0), (-3.0, 0.0), (-1.0, 1.0), (-2.0, 2.0), (0.0, 1.0), (-3.0, 0.0)]
        ]
    )
)


def loss_inputs(values):
    """(log_ratio, old, behaviour shift, advantages, weights, ref) lists -> the loss's [N] inputs."""
    log_ratio, old, behaviour_shift, advantages, weights, ref = (torch.tensor(v, dtype=torch.float64) for v in values)
    logprobs = (old + log_ratio).requires_grad_()
    return logprobs, old, old + behaviour_shift, advantages, weights, ref


@settings(max_examples=80, deadline=None)
@given(losses, st.sampled_from([LossConfig(), LossConfig(clip_low=0.1, clip_high=0.5, importance_cap=1.2)]))
def test_gradient_is_the_clipped_surrogates(values, config):
    logprobs, old, behaviour, advantages, weights, _ = loss_inputs(values)
    loss, stats = policy_loss(logprobs, old, behaviour, advantages, weights, config)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = (logprobs - old).exp().detach()
    is_weight = torch.minimum((old - behaviour).exp(), torch.tensor(config.importance_cap, dtype=torch.float64))
    clipped = ((ratio > 1 + config.clip_high) & (advantages > 0)) | ((ratio < 1 - config.clip_low) & (advantages < 0))
    expected = torch.where(clipped, 0.0, -weights * is_weight * advantages * ratio)
    torch.testing.assert_close(grad, expected)
    assert torch.all(grad[clipped] == 0)
    torch.testing.assert_close(
        loss.detach(),
        -(
            weights
            * is_weight
            * torch.minimum(ratio * advantages, ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages)
        ).sum(),
    )
    assert float(stats.is_weight_mean) <= config.importance_cap + 1e-12
    assert float(stats.clipped_weight) == pytest.approx(float(weights[clipped].sum()))


@settings(max_examples=60, deadline=None)
@given(losses)
def test_kl_gradient_is_the_k3_estimators(values):
    logprobs, old, behaviour, _, weights, ref = loss_inputs(values)
    config = LossConfig(kl_coef=0.05)
    loss, stats = policy_loss(logprobs, old, behaviour, torch.zeros_like(old), weights, config, ref_logprobs=ref)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, config.kl_coef * weights * (1 - (ref - logprobs.detach()).exp()))
    assert float(stats.kl_weighted) >= 0


def test_kl_needs_a_reference():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, x, x, torch.ones(3), LossConfig(kl_coef=0.1))


def test_importance_weight_never_exceeds_the_cap():
    old = torch.tensor([0.0, 0.0, 0.0, -1.0])
    behaviour = torch.tensor([-100.0, -0.5, 0.0, -1e30])  # exp(old - behaviour) up to inf
    logprobs = old.clone().requires_grad_()
    advantages, weights = torch.ones(4), torch.full((4,), 0.25)
    loss, stats = policy_loss(logprobs, old, behaviour, advantages, weights, CONFIG)
    (grad,) = torch.autograd.grad(loss, logprobs)
    is_weight = torch.tensor([2.0, math.exp(0.5), 1.0, 2.0])
    torch.testing.assert_close(grad, -weights * is_weight)
    assert float(stats.is_weight_mean) == pytest.approx(float(is_weight.mean()))


def test_unweighted_positions_leak_nothing():
    bad = torch.tensor([math.nan, math.inf, -math.inf])
    logprobs = torch.cat([torch.tensor([-1.0]), bad]).requires_grad_()
    old = torch.cat([torch.tensor([-1.1]), bad])
    weights = torch.tensor([1.0, 0.0, 0.0, 0.0])
    loss, stats = policy_loss(
        logprobs,
        old,
        old,
        torch.cat([torch.tensor([0.5]), bad]),
        weights,
        LossConfig(kl_coef=0.1),
        ref_logprobs=torch.cat([torch.tensor([-1.2]), bad]),
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad))
    assert torch.all(grad[1:] == 0)
    assert int(stats.tokens) == 1
    assert all(math.isfinite(v) for v in merge_stats([stats]).values())


def test_merged_stats_are_ratios_over_the_step():
    x = torch.zeros(2)
    # Ratio 2 with a positive advantage is clipped; ratio 1 is not.
    logprobs = torch.tensor([math.log(2.0), 0.0])
    _, first = policy_loss(logprobs, x, x, torch.ones(2), torch.tensor([0.25, 0.25]), CONFIG)
    _, second = policy_loss(logprobs, x, x, torch.ones(2), torch.tensor([0.0, 0.5]), CONFIG)
    merged = merge_stats([first, second])
    assert merged["weight_sum"] == pytest.approx(1.0)
    assert merged["clip_fraction"] == pytest.approx(0.25)
    assert merged["tokens"] == 3
    assert merged["ratio_max"] == pytest.approx(2.0)
    assert merged["is_weight_mean"] == pytest.approx(1.0)
    assert merged["kl"] == 0


def test_micro_batch_gradients_add_up_to_the_full_batch_gradient():
    generator = torch.Generator().manual_seed(7)
    rows, vocab = 40, 16
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64).requires_grad_()
    targets = torch.randint(vocab, (rows,), generator=generator)
    temperature, top_k, top_p = torch.full((rows,), 0.8), torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    old = token_logprobs(
        logits.detach() + 0.1 * torch.randn(rows, vocab, generator=generator, dtype=torch.float64),
        targets,
        temperature,
        top_k,
        top_p,
    )
    behaviour = old + 0.2 * torch.randn(rows, generator=generator)
    advantages = torch.randn(rows, generator=generator)
    weights = torch.rand(rows, generator=generator) * (torch.rand(rows, generator=generator) > 0.3)
    weights = weights / weights.sum()
    ref = old - 0.1
    config = LossConfig(kl_coef=0.01)

    def loss_of(index):
        logprobs = token_logprobs(logits[index], targets[index], temperature[index], top_k[index], top_p[index])
        inputs = (logprobs, old[index], behaviour[index], advantages[index], weights[index])
        return policy_loss(*inputs, config, ref[index])[0]

    full = loss_of(torch.arange(rows))
    (full_grad,) = torch.autograd.grad(full, logits)
    micro_losses = [loss_of(index) for index in torch.randperm(rows, generator=generator).split(7)]
    (accumulated,) = torch.autograd.grad(sum(micro_losses), logits)
    torch.testing.assert_close(sum(micro_losses).detach(), full.detach())
    torch.testing.assert_close(accumulated, full_grad)


# -------------------------------------------------------------------------------------------------
# Per-token weights over a step


def test_token_weights_by_hand():
    traces = [
        TraceWeighting("a", 1.0, 1.0, 10),  # one session of 10 tokens
        TraceWeighting("b", 0.75, 2.0, 30),  # a session of 40 tokens and weight 2, in two traces
        TraceWeighting("b", 0.25, 2.0, 10),
        TraceWeighting("c", 1.0, 1.0, 0),  # nothing to train on
    ]
    # Token level: tokens of a weigh 1, tokens of b weigh 2; Z = 10 + 80.
    assert trace_token_weights(traces) == pytest.approx([1 / 90, 2 / 90, 2 / 90, 0.0])
    # Session level: a's mean weighs 1, b's mean weighs 2: coefficients W / N_session / 3.
    assert trace_token_weights(traces, "session") == pytest.approx([1 / 10 / 3, 2 / 40 / 3, 2 / 40 / 3, 0.0])
    # Trace weights summing to W instead of 1 read the same.
    scaled = [
        TraceWeighting(t.session_id, t.trace_weight * t.session_weight, t.session_weight, t.trainable_tokens)
        for t in traces
    ]
    for aggregation in ("token", "session"):
        assert trace_token_weights(scaled, aggregation) == pytest.approx(trace_token_weights(traces, aggregation))


@pytest.mark.parametrize(
    "traces",
    [
        [TraceWeighting("a", 0.0, 1.0, 5)],  # an unset Trace.weight
        [TraceWeighting("a", -1.0, 1.0, 5)],
        [TraceWeighting("a", 0.5, 1.0, 5), TraceWeighting("a", 0.5, 2.0, 5)],
    ],
)
def test_inconsistent_weights_are_refused(traces):
    with pytest.raises(ValueError):
        trace_token_weights(traces)


sessions = st.lists(
    st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.sampled_from([0.5, 1.0, 2.0])),
    min_size=1,
    max_size=6,
)


def step_loss(traces: list[TraceWeighting], token_losses: list[np.ndarray], aggregation: str) -> float:
    """sum over traces of coefficient * the sum of the trace's per-token losses."""
    coefficients = trace_token_weights(traces, aggregation)
    assert sum(c * t.trainable_tokens for c, t in zip(coefficients, traces)) == pytest.approx(
        1.0 if any(t.trainable_tokens for t in traces) else 0.0
    )
    assert all(c == 0 for c, t in zip(coefficients, traces) if t.trainable_tokens == 0)
    return sum(c * losses.sum() for c, losses in zip(coefficients, token_losses))


@settings(max_examples=80, deadline=None)
@given(sessions, st.sampled_from(["token", "session"]), st.integers(0, 2**32 - 1))
def test_splitting_a_session_into_traces_leaves_the_step_loss_unchanged(sessions, aggregation, seed):
    rng = np.random.default_rng(seed)
    whole, whole_losses, split, split_losses = [], [], [], []
    for index, (pieces, session_weight) in enumerate(sessions):
        losses = [rng.normal(size=n) for n in pieces]  # the same tokens, whichever trace holds them
        whole_share = float(token_share_weights([sum(pieces)])[0])  # 1, or 0 with nothing to train
        whole.append(TraceWeighting(f"s{index}", whole_share, session_weight, sum(pieces)))
        whole_losses.append(np.concatenate(losses))
        shares = token_share_weights(pieces)
        split += [TraceWeighting(f"s{index}", float(w), session_weight, n) for w, n in zip(shares, pieces)]
        split_losses += losses
    expected = step_loss(whole, whole_losses, aggregation)
    assert step_loss(split, split_losses, aggregation) == pytest.approx(expected, abs=1e-9)


def test_tokens_outside_the_policys_support_contribute_nothing_and_no_nan():
    # A token sampled under top-p that the current policy can no longer sample has logprob -inf.
    logprobs = torch.tensor([-1.0, float("-inf"), -2.0], requires_grad=True)
    old = torch.tensor([-1.0, float("-inf"), -2.0])
    behaviour = torch.tensor([-1.1, -3.0, -2.0])
    weights = torch.tensor([0.25, 0.5, 0.25])
    loss, stats = policy_loss(logprobs, old, behaviour, torch.tensor([1.0, 1.0, -1.0]), weights, LossConfig())
    loss.backward()
    assert math.isfinite(float(loss))
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[1] == 0
    merged = merge_stats([stats])
    assert merged["outside_support"] == 1 and merged["tokens"] == 2
    # The same loss as if the token had no weight at all.
    reference, _ = policy_loss(
        logprobs.detach().nan_to_num(neginf=0.0),
        old.nan_to_num(neginf=0.0),
        behaviour,
        torch.tensor([1.0, 1.0, -1.0]),
        torch.tensor([0.25, 0.0, 0.25]),
        LossConfig(),
    )
    assert float(loss) == pytest.approx(float(reference))
