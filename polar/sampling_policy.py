"""A task's sampling policy: what the gateway applies over what a harness asks, on every call of the
task's sessions (temperature, top_p, top_k, a per-call cap, a session budget). The rollout server
checks it at submit; the gateway applies it (gateway/sampling.py).

Contract: protos/polar/v1/common.proto, SamplingPolicy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polar.v1 import common_pb2


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
