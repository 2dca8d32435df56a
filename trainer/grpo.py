"""The GRPO math: advantages, the trainer's logprobs, the clipped loss and per-token weights.

Every function here is pure torch (or plain Python) so it can be read, tested and reused by any
backend. One training step is, per GRPO group of sessions that ran the same task:

1. ``group_advantages``: each session's reward minus its group's baseline, optionally divided by the
   group's std. A group whose rewards are all equal teaches nothing and gets exact zeros.
2. ``trace_token_weights``: one coefficient per trace, applied to each of its trainable tokens, so
   the step's loss is a weighted sum over every trainable token of the step and a session split into
   several traces (sub-agents, compaction, per-request building) weighs what it weighs unsplit.
3. ``token_logprobs``: the logprob of each sampled token under exactly the distribution the engine
   drew it from (temperature, top-k, top-p), via the engine's own ``batched_processed_logprobs``;
   for a token of a constrained call, over the logits masked by its constraint first
   (``constrained_logits``, the masks the grammar's replay gives: polar/inference/constraints.py).
4. ``policy_loss``: the asymmetric clipped surrogate, times a truncated importance weight against
   the behaviour logprobs the gateway recorded, plus an optional k3 KL penalty.

The token weights are normalised over the whole step, so the loss of each micro-batch is a plain
sum: summing micro-batch losses gives the step's loss and accumulating their gradients gives the
exact full-batch gradient, however the step was cut into micro-batches.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from polar.inference.constraints import masked_logits
from polar.inference.sampling import batched_processed_logprobs, to_device

# -------------------------------------------------------------------------------------------------
# Advantages

ADVANTAGE_SCALES = ("std", "none")


def _check_rewards(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """The rewards as a float64 [G] tensor; ValueError when empty or not finite."""
    rewards = torch.as_tensor(rewards).to(torch.float64).reshape(-1)  # [G]
    if rewards.numel() == 0:
        raise ValueError("a GRPO group needs at least one reward")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    return rewards


def is_degenerate(rewards: torch.Tensor | Sequence[float]) -> bool:
    """True when every reward of the group is equal: the group has no signal to learn from."""
    rewards = _check_rewards(rewards)
    return bool((rewards == rewards[0]).all())


def group_advantages(
    rewards: torch.Tensor, *, scale: str = "std", leave_one_out: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages [G] of one group's rewards [G]: ``(r_i - baseline_i) / (std + eps)``.

    The baseline is the group mean, or with ``leave_one_out`` the mean of the other G-1 rewards (an
    unbiased baseline: it does not depend on r_i; a group of one has no other reward and gets 0).
    ``scale="std"`` divides by the group's population std plus ``eps``; ``"none"`` keeps the
    centred reward in reward units (Dr. GRPO: dividing by the std up-weights the groups whose rewards
    barely vary, the tasks nearly always or nearly never solved).
    Computed in float64, returned in the rewards' float dtype (float32 for integer rewards).
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {ADVANTAGE_SCALES}")
    dtype = rewards.dtype if torch.is_tensor(rewards) and rewards.is_floating_point() else torch.float32
    rewards = _check_rewards(rewards)  # [G] fp64
    size = rewards.numel()
    if is_degenerate(rewards):
        return torch.zeros_like(rewards, dtype=dtype)
    if leave_one_out:
        baseline = (rewards.sum() - rewards) / (size - 1)  # [G]; size > 1 as the group varies
    else:
        baseline = rewards.mean()
    advantages = rewards - baseline  # [G]
    if scale == "std":
        advantages = advantages / (rewards.std(correction=0) + eps)
    return advantages.to(dtype)


# -------------------------------------------------------------------------------------------------
# Logprobs under the engine's sampling distribution


def _truncating_rows(vocab: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows whose distribution the engine truncates (its rule: greedy never truncates)."""
    sampled = temperature > 0
    has_top_k = (top_k > 0) & (top_k < vocab)
    has_top_p = (top_p > 0) & (top_p < 1)
    return sampled & (has_top_k | has_top_p)


class _SampledLogprob(torch.autograd.Function):
    """The engine's logprob of each target, computed and differentiated one chunk of rows at a time.

    Plain autograd would keep fp32 [N, V] temporaries alive until backward, however the rows were
    chunked. This function keeps only the logits (alive anyway: the model made them) and two numbers
    per row: the logsumexp of the kept scaled logits and the truncation threshold. The engine keeps
    exactly the tokens whose scaled logit reaches a threshold, so backward rebuilds each chunk's
    distribution from the logits and those two numbers:
    d logprob / d logits = (onehot(target) - softmax over the kept tokens) / T.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, top_k, top_p, chunk_rows, chunk_truncates):
        # logits [N, V]; targets [N] int64 and temperature [N] fp32 on logits' device; top_k, top_p [N]
        scale = torch.where(temperature > 0, temperature, 1.0)  # [N]: greedy rows use T = 1
        rows = logits.shape[0]
        logsumexp = torch.empty(rows, dtype=torch.float32, device=logits.device)  # [N]
        threshold = torch.full_like(logsumexp, -torch.inf)  # [N]: lowest kept scaled logit
        logprobs = torch.empty_like(logsumexp)  # [N]
        for start, truncates in zip(range(0, rows, chunk_rows), chunk_truncates):
            chunk = slice(start, start + chunk_rows)
            scaled = logits[chunk].float() / scale[chunk, None]  # [C, V]
            if truncates:
                processed = batched_processed_logprobs(
                    logits[chunk].float(), temperature[chunk], top_k[chunk], top_p[chunk]
                )  # [C, V], -inf where truncated
                dropped = processed.isinf()
                threshold[chunk] = scaled.masked_fill(dropped, torch.inf).amin(-1)
                scaled.masked_fill_(dropped, -torch.inf)
            logsumexp[chunk] = scaled.logsumexp(-1)
            logprobs[chunk] = scaled.gather(-1, targets[chunk, None]).squeeze(-1) - logsumexp[chunk]
        ctx.save_for_backward(logits, targets, scale, logsumexp, threshold)
        ctx.chunk_rows = chunk_rows
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs):
        logits, targets, scale, logsumexp, threshold = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # [N, V]
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            chunk = slice(start, start + ctx.chunk_rows)
            scaled = logits[chunk].float() / scale[chunk, None]  # [C, V]
            probs = (scaled - logsumexp[chunk, None]).exp_().masked_fill_(scaled < threshold[chunk, None], 0)
            grad = probs.neg_().scatter_add_(-1, targets[chunk, None], torch.ones_like(probs[:, :1]))  # [C, V]
            grad_logits[chunk] = grad * (grad_logprobs[chunk] / scale[chunk])[:, None]
        return grad_logits, None, None, None, None, None, None


def constrained_logits(
    logits: torch.Tensor,
    flat: torch.Tensor,
    constraint_index: torch.Tensor,
    allowed: torch.Tensor,
    vocab_start: int = 0,
) -> torch.Tensor:
    """logits [K, Vs] of the targets at flat positions flat [K] (ascending), with -inf wherever the
    constraint mask allowed [M, V] of position constraint_index [M] disallows a token; positions of
    constraint_index that are not among flat (no trainable target) are skipped. Differentiable.

    The logits are vocabulary columns [vocab_start, vocab_start + Vs): the whole vocabulary (the torch
    backend), or one tensor-parallel rank's slice of it (the megatron backend), which each rank masks
    with its own columns of the mask; a slice's padding past the mask's V is masked too (no such
    token exists). Every backend masks the logits here, before temperature, as the engine did."""
    constraint_index = constraint_index.to(flat.device)
    rows = torch.searchsorted(flat, constraint_index).clamp(max=max(len(flat) - 1, 0))  # [M]
    present = flat[rows] == constraint_index if len(flat) else torch.zeros_like(constraint_index, dtype=torch.bool)
    columns = logits.shape[1]
    shard = allowed[:, vocab_start : vocab_start + columns]  # [M, <= Vs]
    if shard.shape[1] < columns:
        padded = torch.zeros(shard.shape[0], columns, dtype=torch.bool)  # [M, Vs]
        padded[:, : shard.shape[1]] = shard
        shard = padded
    return masked_logits(logits, rows[present], shard.to(logits.device)[present])


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    chunk_rows: int = 4096,
) -> torch.Tensor:
    """fp32 [N] log-probability of each target [N] under the distribution the engine sampled it from.

    logits [N, V] (any float dtype, upcast to fp32 a chunk at a time); temperature, top_k, top_p [N]
    (any device). Greedy rows (temperature 0) use T = 1 and no truncation, as the engine's contract
    says. Differentiable w.r.t. logits. A chunk of ``chunk_rows`` rows with no truncated row takes the
    fast path, log softmax(logits / T); any other chunk also runs the engine's own
    ``batched_processed_logprobs`` (forward only) to learn which tokens it keeps. Either way at most
    one chunk's fp32 [chunk_rows, V] temporaries exist at a time, in forward and in backward.

    A target the trainer's distribution truncates away gets -inf: the trainer's logits put it just
    outside the engine's top-k / top-p set (they should match the engine's logits closely).
    """
    rows, vocab = logits.shape
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    truncated_rows = _truncating_rows(vocab, temperature, top_k, top_p).nonzero().squeeze(-1).cpu()  # one sync
    chunks = -(-rows // chunk_rows)
    chunk_truncates = tuple((torch.bincount(truncated_rows // chunk_rows, minlength=chunks) > 0).tolist())
    targets = to_device(targets.long(), logits.device)
    temperature = to_device(temperature.float(), logits.device)
    return _SampledLogprob.apply(logits, targets, temperature, top_k, top_p, chunk_rows, chunk_truncates)


# -------------------------------------------------------------------------------------------------
# The loss


@dataclass(frozen=True)
class LossConfig:
    """The GRPO loss's knobs."""

    # The ratio is clipped to [1 - clip_low, 1 + clip_high] (PPO's epsilon, made asymmetric).
    clip_low: float = 0.2
    # A wider upper bound (DAPO's clip-higher) lets unlikely tokens with a positive advantage grow,
    # which keeps the policy's entropy from collapsing.
    clip_high: float = 0.28
    # Truncation of exp(old - behaviour), the correction for trainer/inference mismatch and staleness:
    # a token the engine found far less likely than the trainer does cannot dominate the step.
    importance_cap: float = 2.0
    # Weight of the k3 KL estimate against the reference policy; 0: no reference needed.
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if not self.importance_cap > 0:
            raise ValueError(f"importance_cap must be > 0, got {self.importance_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True)
class LossStats:
    """What one micro-batch's loss saw, as detached 0-d tensors (no device sync until merged)."""

    weight_sum: torch.Tensor  # sum of token weights
    clipped_weight: torch.Tensor  # sum of token weights where the clip is active (zero gradient)
    kl_weighted: torch.Tensor  # sum of token weight * k3; 0 without a reference
    is_weight_mean: torch.Tensor  # token-weighted mean of the truncated importance weight
    ratio_max: torch.Tensor  # largest policy ratio among weighted tokens; 0 when there is none
    tokens: torch.Tensor  # positions with a nonzero token weight, in the policy's support
    outside_support: torch.Tensor  # weighted positions whose token the policy can no longer sample


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The micro-batch's share of the step loss: ``sum(token_weights * per_token)``, and its stats.

    ratio = exp(logprobs - old);  is_weight = min(exp(old - behaviour), importance_cap)
    per_token = -is_weight * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
                + kl_coef * k3,  k3 = exp(ref - logprobs) - (ref - logprobs) - 1

    Every input is [N] over the micro-batch's target positions. ``logprobs`` is the current policy's
    (differentiable); ``old_logprobs`` the policy's at the start of the step (detached);
    ``behaviour_logprobs`` what the engine recorded; ``ref_logprobs`` the reference policy's, needed
    when ``config.kl_coef > 0``. Positions whose token weight is 0 contribute nothing, not even a NaN:
    every input is selected with ``torch.where`` before any arithmetic.

    Under truncated sampling (top-p, top-k) a sampled token can lie outside the policy's current
    support: the weights moved since it was sampled, or it sat on the nucleus boundary. Its logprob
    is then -inf, its importance weight exp(old - behaviour) is 0, and it contributes nothing; such
    positions are left out like unweighted ones (counted in ``outside_support``), so no -inf - -inf
    turns into a NaN.
    """
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    in_support = torch.isfinite(logprobs.detach()) & torch.isfinite(old_logprobs.detach())  # [N]
    weighted = (token_weights != 0) & in_support  # [N]
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    weights = torch.where(weighted, token_weights, zero)  # [N]
    logp = torch.where(weighted, logprobs, zero)  # [N]
    old = torch.where(weighted, old_logprobs.detach(), zero)  # [N]
    behaviour = torch.where(weighted, behaviour_logprobs.detach(), zero)  # [N]
    adv = torch.where(weighted, advantages, zero)  # [N]

    ratio = (logp - old).exp()  # [N]
    # min(exp(x), cap) taken in log space, so a huge x cannot overflow to inf first.
    is_weight = (old - behaviour).clamp(max=math.log(config.importance_cap)).exp()  # [N]
    # min(ratio * A, clip(ratio) * A) picks the clipped term exactly where the ratio has left the
    # trust region in the direction A pushes it; choosing by that mask (not by comparing the two
    # products, which can tie after rounding) gives clipped tokens exactly zero gradient.
    clip_active = ((adv > 0) & (ratio > 1 + config.clip_high)) | ((adv < 0) & (ratio < 1 - config.clip_low))  # [N]
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    per_token = -is_weight * torch.where(clip_active, clipped_ratio.detach(), ratio) * adv  # [N]

    kl_weighted = zero
    if ref_logprobs is not None:
        log_ref_ratio = torch.where(weighted, ref_logprobs.detach(), zero) - logp  # [N]
        k3 = log_ref_ratio.exp() - log_ref_ratio - 1  # [N], >= 0, 0 at ref == logp
        kl_weighted = (weights * k3).sum().detach()
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * k3

    loss = (weights * per_token).sum()
    weight_sum = weights.sum().detach()
    stats = LossStats(
        weight_sum=weight_sum,
        clipped_weight=(weights * clip_active).sum().detach(),
        kl_weighted=kl_weighted,
        is_weight_mean=((weights * is_weight).sum() / weight_sum.clamp(min=1e-30)).detach(),
        ratio_max=torch.where(weighted, ratio, zero).max().detach() if ratio.numel() else zero,
        tokens=weighted.sum(),
        outside_support=((token_weights != 0) & ~in_support).sum(),
    )
    return loss, stats


def merge_stats(stats: Sequence[LossStats]) -> dict[str, float]:
    """One step's statistics from its micro-batches' (one device sync); ratios of sums over the step."""
    if not stats:
        keys = ("weight_sum", "tokens", "clip_fraction", "kl", "is_weight_mean", "ratio_max", "outside_support")
        return dict.fromkeys(keys, 0.0)
    rows = [
        torch.stack(
            [
                s.weight_sum,
                s.clipped_weight,
                s.kl_weighted,
                s.is_weight_mean * s.weight_sum,
                s.ratio_max.to(s.weight_sum.dtype),
                s.tokens.to(s.weight_sum.dtype),
                s.outside_support.to(s.weight_sum.dtype),
            ]
        )
        for s in stats
    ]
    values = torch.stack(rows).double().cpu()  # [micro-batches, 7]
    weight_sum, clipped, kl, is_weighted, _, tokens, outside = values.sum(0).tolist()
    per_weight = 1 / weight_sum if weight_sum > 0 else 0.0
    return {
        "weight_sum": weight_sum,
        "tokens": tokens,
        "clip_fraction": clipped * per_weight,
        "kl": kl * per_weight,
        "is_weight_mean": is_weighted * per_weight,
        "ratio_max": float(values[:, 4].max()),
        "outside_support": outside,
    }


# -------------------------------------------------------------------------------------------------
# Per-token weights over a step

AGGREGATIONS = ("token", "session")


@dataclass(frozen=True)
class TraceWeighting:
    """What weighting needs to know of one trace of the step."""

    session_id: str
    trace_weight: float  # Trace.weight: the trace's share of its session (the shares sum to 1)
    session_weight: float  # Trajectory.weight: the session's weight W (1 unless the task says otherwise)
    trainable_tokens: int  # the trace's mask-1 tokens


def trace_token_weights(traces: Sequence[TraceWeighting], aggregation: str = "token") -> list[float]:
    """One loss coefficient per trace, applied to each of its trainable tokens; normalised over the step.

    A trace's share of its session is ``s = trace_weight / (sum of the trace weights of its session
    in the step)``, which reads Trace.weight the same whether the shares sum to 1 (the proto's
    contract) or to W, and keeps a session whole when some of its traces were left out. With
    token-share weights (polar.trajectory.rewards), ``s = n_trace / N_session``.

    * ``"token"`` (DAPO's token-level mean): the trace's tokens each weigh
      ``u = W * s * N_session / n_trace`` (= W for token shares); coefficient ``u / Z`` with
      ``Z = sum over the step's traces of u * n_trace``. Long sessions weigh more, by their tokens.
    * ``"session"`` (the mean over each session's tokens, then a W-weighted mean over sessions):
      coefficient ``W * s / n_trace / sum of W over the step's sessions``.

    Traces with no trainable token get 0, and a session with none does not count in the normaliser,
    so ``sum(coefficient * trainable_tokens) == 1`` unless the whole step has nothing to train on
    (then every coefficient is 0). A session with trainable tokens whose trace weights sum to 0 is an
    error: an unset Trace.weight would otherwise silently drop the session from training. Pass the
    whole step at once: the coefficients are normalised over it.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    share_sum: dict[str, float] = defaultdict(float)
    session_tokens: dict[str, int] = defaultdict(int)
    session_weight: dict[str, float] = {}
    for trace in traces:
        if trace.trace_weight < 0 or trace.session_weight < 0 or trace.trainable_tokens < 0:
            raise ValueError(f"negative weight or token count in session {trace.session_id!r}: {trace}")
        if session_weight.setdefault(trace.session_id, trace.session_weight) != trace.session_weight:
            raise ValueError(f"session {trace.session_id!r} has two session weights")
        if trace.trainable_tokens:
            share_sum[trace.session_id] += trace.trace_weight
            session_tokens[trace.session_id] += trace.trainable_tokens
    for session_id, tokens in session_tokens.items():
        if share_sum[session_id] == 0:
            raise ValueError(f"session {session_id!r} has {tokens} trainable tokens but its trace weights sum to 0")

    per_token = []  # unnormalised weight of each of a trace's tokens
    for trace in traces:
        if trace.trainable_tokens == 0:
            per_token.append(0.0)
            continue
        share = trace.trace_weight / share_sum[trace.session_id]
        if aggregation == "token":
            per_token.append(trace.session_weight * share * session_tokens[trace.session_id] / trace.trainable_tokens)
        else:
            per_token.append(trace.session_weight * share / trace.trainable_tokens)
    total = sum(u * trace.trainable_tokens for u, trace in zip(per_token, traces))
    if total == 0:
        return [0.0] * len(traces)
    return [u / total for u in per_token]
