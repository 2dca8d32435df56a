"""Reward bookkeeping: how one session's reward and weight attach to its traces.

A session (one rollout of one task) earns one scalar reward from its evaluator; GRPO turns it into one
advantage ``A`` by normalising within the session's group. The builders may split the session into
several traces (sub-agents, parallel branches, compaction; ``per_request`` splits it into one trace
per call). The split is an artefact of reconstruction and must not change what the session teaches.

The rule used here:

* Every trace of a session carries the session's own advantage ``A``, unchanged. No trace gets a
  reward of its own: the outcome was produced by the whole session (the sub-agent that found the bug,
  the main agent that applied the fix), and per-trace credit would need an evaluator that knows which
  calls mattered, which an unmodified harness does not provide.
* Trace ``i`` carries the weight ``w_i = W * n_i / N``: ``W`` is the session's weight (1 unless the
  task says otherwise), ``n_i`` the trace's trainable (mask 1) tokens, ``N`` the session's trainable
  tokens. The weights of a session's traces sum to ``W``; a trace with nothing to train on gets 0.
* The trainer averages a trace's per-token losses over its trainable tokens and multiplies by ``w_i``.
  Each trainable token then weighs ``W / N``, whatever the split, so a session contributes the same
  loss as one trace or as twenty: ``sum_i w_i * mean_i(loss) = W * mean over the session's tokens``.

Why not the alternatives. Giving every trace the full reward at weight 1 (the reference system's
per-request training) makes a session's influence grow with its number of calls: a policy that makes
more, shorter calls multiplies the weight of every rewarded session, which is the reward hacking that
system reported. Splitting the weight equally per trace (``W / traces``) keeps the session total but
lets a three-token side call weigh as much as a thousand-token main chain, so that side call claims a
share of the reward it did not earn. Sharing by trainable tokens is the only split under which the
per-token weight does not depend on how the session was cut into traces (checked by property tests).
A session with no trainable token contributes nothing (every weight is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from polar.trajectory.records import BuiltTrace


@dataclass(frozen=True)
class TraceCredit:
    """What the trainer multiplies a trace's mean per-token loss by: ``advantage * weight``."""

    trace_id: str
    advantage: float  # the session's advantage, the same for every trace of the session
    weight: float  # the trace's share of the session's weight


def token_share_weights(trainable_tokens: Sequence[int], session_weight: float = 1.0) -> np.ndarray:
    """``(traces,)`` weights ``session_weight * n_i / sum(n)``; all 0 when nothing is trainable."""
    counts = np.asarray(trainable_tokens, dtype=np.float64)  # (traces,)
    if np.any(counts < 0):
        raise ValueError("trainable token counts must be >= 0")
    total = counts.sum()
    if total == 0:
        return np.zeros_like(counts)
    return session_weight * counts / total


def with_token_share_weights(
    traces: Sequence[BuiltTrace], session_weight: float = 1.0
) -> tuple[BuiltTrace, ...]:
    """The traces with ``weight`` set to their share of the session's trainable tokens."""
    weights = token_share_weights([trace.trainable_tokens for trace in traces], session_weight)
    return tuple(trace.with_weight(float(w)) for trace, w in zip(traces, weights))


def credit_traces(
    traces: Sequence[BuiltTrace], advantage: float, session_weight: float = 1.0
) -> tuple[TraceCredit, ...]:
    """Attach one session's advantage and weight to each of its traces."""
    weights = token_share_weights([trace.trainable_tokens for trace in traces], session_weight)
    return tuple(
        TraceCredit(trace.trace_id, float(advantage), float(w)) for trace, w in zip(traces, weights)
    )


def token_weights(trace: BuiltTrace) -> np.ndarray:
    """``(T,)`` per-token loss weights of a trace: ``weight / n`` on trainable tokens, 0 elsewhere."""
    n = trace.trainable_tokens
    if n == 0:
        return np.zeros(len(trace.token_ids), dtype=np.float64)
    return trace.loss_mask.astype(np.float64) * (trace.weight / n)


def session_loss(traces: Sequence[BuiltTrace], token_losses: Sequence[np.ndarray]) -> float:
    """``sum_i weight_i * mean(token_losses_i over trainable tokens)``: a session's loss.

    ``token_losses[i]`` is ``(T_i,)``, aligned with ``traces[i].token_ids``; values where the loss
    mask is 0 are ignored.
    """
    total = 0.0
    for trace, losses in zip(traces, token_losses, strict=True):
        total += float(np.dot(token_weights(trace), np.asarray(losses, dtype=np.float64)))
    return total
