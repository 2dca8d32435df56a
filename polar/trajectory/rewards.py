"""Reward bookkeeping: how one session's reward and weight attach to its traces.

Every trace of a session carries the session's advantage unchanged, and trace i weighs
``W * n_i / N`` (its share of the session's trainable tokens), so a session teaches the same however
it was cut into traces. The rule and why not the alternatives: docs/design/trajectories.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def with_token_share_weights(traces: Sequence[BuiltTrace], session_weight: float = 1.0) -> tuple[BuiltTrace, ...]:
    """The traces with ``weight`` set to their share of the session's trainable tokens."""
    weights = token_share_weights([trace.trainable_tokens for trace in traces], session_weight)
    return tuple(trace.with_weight(float(w)) for trace, w in zip(traces, weights))


def credit_traces(
    traces: Sequence[BuiltTrace], advantage: float, session_weight: float = 1.0
) -> tuple[TraceCredit, ...]:
    """Attach one session's advantage and weight to each of its traces."""
    weights = token_share_weights([trace.trainable_tokens for trace in traces], session_weight)
    return tuple(TraceCredit(trace.trace_id, float(advantage), float(w)) for trace, w in zip(traces, weights))


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
