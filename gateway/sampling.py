"""What the engine is asked to sample with: the harness's request under its task's sampling policy.

    requested (the dialect's reading of the body: Sampling)
    policy (the session's, from its task: temperature, top_p, top_k, per-call cap, session budget)
    tokens the session's calls have sampled so far, room the context leaves after the prompt
        ──effective_sampling──▶ SamplingParams for the engine + the Limit that set max_tokens

A policy's temperature, top_p and top_k replace the harness's. max_tokens is the smallest of the harness's own
(if it asked), the per-call cap (if > 0), what is left of the session budget (if > 0) and the context's
room; on a tie the harness's own wins, then the cap, then the budget, then the context. Reaching any
limit but the harness's own truncates the call (CallRecord.truncated). An empty policy changes nothing:
a session without one samples exactly as the harness asked, within the context.

Contract: protos/polar/v1/common.proto, SamplingPolicy.
"""

from __future__ import annotations

import enum

from gateway.dialects.base import ErrorKind, GatewayError, Sampling
from polar.sampling_policy import SamplingPolicy
from polar.v1 import common_pb2

DEFAULT_TEMPERATURE = 1.0  # when neither the harness nor the policy gives one


class Limit(enum.Enum):
    """What set a call's max_tokens (in the order ties are decided)."""

    REQUEST = "request"  # the harness's own max tokens: reaching it is an ordinary length finish
    CALL_CAP = "call_cap"  # the policy's max_tokens_per_call
    SESSION_BUDGET = "session_budget"  # what was left of the policy's max_tokens_per_session
    CONTEXT = "context"  # the room the context window leaves after the prompt

    @property
    def truncates(self) -> bool:
        """Reaching it cuts the generation at a limit the harness did not ask for."""
        return self is not Limit.REQUEST


_TIE_ORDER = {limit: order for order, limit in enumerate(Limit)}


def budget_left(policy: SamplingPolicy, sampled_tokens: int) -> int | None:
    """Tokens the session may still sample; None without a budget. GatewayError once it is used up."""
    budget = policy.max_tokens_per_session
    if not budget:
        return None
    if sampled_tokens >= budget:
        raise GatewayError(
            ErrorKind.INVALID_REQUEST,
            f"this session's token budget is used up: its calls have sampled {sampled_tokens} tokens of the "
            f"{budget} its task allows (max_tokens_per_session); no further calls are served",
        )
    return budget - sampled_tokens


def effective_sampling(
    requested: Sampling, policy: SamplingPolicy, sampled_tokens: int, context_room: int
) -> tuple[common_pb2.SamplingParams, Limit]:
    """The engine's sampling for one call and the limit that set its max_tokens (see the module doc).

    `sampled_tokens`: what the session's calls sampled so far; `context_room`: the context length
    minus the prompt, >= 1 (a prompt that fills the context is refused before this). Raises
    GatewayError(INVALID_REQUEST) for a requested max tokens below 1 or a used-up session budget.
    """
    if context_room < 1:
        raise ValueError(f"context_room must be >= 1, got {context_room}")
    if requested.max_tokens is not None and requested.max_tokens < 1:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"max tokens must be at least 1, not {requested.max_tokens}")
    limits = [(context_room, Limit.CONTEXT)]
    if requested.max_tokens is not None:
        limits.append((requested.max_tokens, Limit.REQUEST))
    if policy.max_tokens_per_call:
        limits.append((policy.max_tokens_per_call, Limit.CALL_CAP))
    if (left := budget_left(policy, sampled_tokens)) is not None:
        limits.append((left, Limit.SESSION_BUDGET))
    max_tokens, limit = min(limits, key=lambda item: (item[0], _TIE_ORDER[item[1]]))

    temperature = policy.temperature if policy.temperature is not None else requested.temperature
    top_p = policy.top_p if policy.top_p is not None else requested.top_p
    top_k = policy.top_k if policy.top_k is not None else requested.top_k
    params = common_pb2.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=top_p or 0.0,
        top_k=top_k or 0,
        max_tokens=max_tokens,
    )
    if requested.seed is not None:
        params.seed = requested.seed % 2**64
    return params, limit
