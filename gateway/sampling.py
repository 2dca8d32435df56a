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
import math
from dataclasses import dataclass

from gateway.dialects.base import ErrorKind, GatewayError, Sampling
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


@dataclass(frozen=True)
class SamplingPolicy:
    """A task's sampling for every call of its sessions (mirrors ``polar.v1.SamplingPolicy``)."""

    temperature: float | None = None  # None: the harness's
    top_p: float | None = None  # None: the harness's
    max_tokens_per_call: int = 0  # 0: no cap
    max_tokens_per_session: int = 0  # 0: no budget
    top_k: int | None = None  # None: the harness's; 0: no truncation

    @classmethod
    def from_proto(cls, policy: common_pb2.SamplingPolicy) -> SamplingPolicy:
        return cls(
            temperature=policy.temperature if policy.HasField("temperature") else None,
            top_p=policy.top_p if policy.HasField("top_p") else None,
            max_tokens_per_call=policy.max_tokens_per_call,
            max_tokens_per_session=policy.max_tokens_per_session,
            top_k=policy.top_k if policy.HasField("top_k") else None,
        )

    def to_proto(self) -> common_pb2.SamplingPolicy:
        return common_pb2.SamplingPolicy(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens_per_call=self.max_tokens_per_call,
            max_tokens_per_session=self.max_tokens_per_session,
            top_k=self.top_k,
        )

    def problems(self, field: str = "sampling") -> list[str]:
        """What is out of range, one "field.name: problem" each (empty when valid)."""
        problems = []
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"{field}.temperature: must be a finite number >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"{field}.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            problems.append(f"{field}.top_k: must be >= 0 (0: no truncation), got {self.top_k}")
        if self.max_tokens_per_call < 0:
            problems.append(f"{field}.max_tokens_per_call: must be >= 0 (0: no cap), got {self.max_tokens_per_call}")
        if self.max_tokens_per_session < 0:
            problems.append(
                f"{field}.max_tokens_per_session: must be >= 0 (0: no budget), got {self.max_tokens_per_session}"
            )
        return problems


NO_POLICY = SamplingPolicy()


def policy_problems(policy: common_pb2.SamplingPolicy, field: str = "sampling") -> list[str]:
    """What is wrong with a SamplingPolicy message, each problem naming its field under `field`."""
    return SamplingPolicy.from_proto(policy).problems(field)


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
