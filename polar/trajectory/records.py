"""Frozen records mirroring the protobuf messages the builders read and write.

``CallView`` is what a builder needs of a ``CallRecord``: token ids, logprobs, how the call ended (and
whether a limit the harness did not ask for truncated it), the sampling the engine used and when it
arrived. Dialect, model name and the raw request/response bodies stay in the record; the
builders never look at them. Token ids are read-only ``int32`` arrays and logprobs ``float32``
arrays, so the builders compare and copy whole spans with numpy instead of looping over tokens.

Exceptions::

    TrajectoryError
    ├── InvalidCallError      a call record breaks its own invariants (lengths, duplicate ids)
    ├── UnknownBuilderError   build() was asked for a builder that does not exist
    ├── VerificationError     traces are not faithful to the calls (see verify.py)
    └── SessionFileError      a session file cannot be read
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from polar.inference.constraints import OutputConstraint
from polar.v1 import common_pb2


class TrajectoryError(Exception):
    """Base of every error raised by ``polar.trajectory``."""


class InvalidCallError(TrajectoryError, ValueError):
    """A call record is inconsistent with itself or with its session."""


class UnknownBuilderError(TrajectoryError, LookupError):
    """No builder is registered under the requested name."""


class VerificationError(TrajectoryError):
    """Traces are not faithful to the calls they were built from."""


class SessionFileError(TrajectoryError):
    """A session file is missing, unreadable or not in a known format."""


def _frozen_array(values, dtype) -> np.ndarray:
    array = np.array(values, dtype=dtype)
    if array.ndim != 1:
        raise InvalidCallError(f"expected a flat sequence, got shape {array.shape}")
    array.flags.writeable = False
    return array


_INTERRUPTED = (common_pb2.FINISH_REASON_ABORTED, common_pb2.FINISH_REASON_ERROR)


@dataclass(frozen=True)
class SamplingParams:
    """What the engine was asked to sample with (mirrors ``polar.v1.SamplingParams``)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 0.0  # 0 or 1: no nucleus truncation
    top_k: int = 0  # 0: no top-k truncation
    max_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    constraint: OutputConstraint | None = None  # constrained decoding: the mask each token was drawn under

    def __post_init__(self) -> None:
        # The message's floats are float32: holding them so makes a round trip through it exact.
        object.__setattr__(self, "temperature", float(np.float32(self.temperature)))
        object.__setattr__(self, "top_p", float(np.float32(self.top_p)))
        object.__setattr__(self, "stop_token_ids", tuple(int(token) for token in self.stop_token_ids))

    @classmethod
    def from_proto(cls, params: common_pb2.SamplingParams) -> SamplingParams:
        return cls(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop_token_ids=tuple(params.stop_token_ids),
            seed=params.seed if params.HasField("seed") else None,
            ignore_eos=params.ignore_eos,
            constraint=(
                OutputConstraint(
                    params.constraint.kind,
                    params.constraint.json_schema,
                    params.constraint.prefix,
                    params.constraint.suffix,
                )
                if params.HasField("constraint")
                else None
            ),
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            constraint=self.constraint.to_proto(common_pb2.OutputConstraint) if self.constraint is not None else None,
        )


def _sampling_of(message: common_pb2.CallRecord | common_pb2.TraceSegment) -> SamplingParams | None:
    """The ``sampling`` field of a CallRecord or TraceSegment; None when it is unset."""
    return SamplingParams.from_proto(message.sampling) if message.HasField("sampling") else None


@dataclass(frozen=True, eq=False)
class CallView:
    """One model call as the builders see it (mirrors ``polar.v1.CallRecord``)."""

    call_id: str
    prompt_ids: np.ndarray  # (P,) int32: every token the engine was given
    sampled_ids: np.ndarray  # (S,) int32: every token the engine sampled
    logprobs: np.ndarray  # (S,) float32: log-probability of each sampled token
    finish_reason: int = common_pb2.FINISH_REASON_STOP  # a polar.v1.FinishReason value
    aborted: bool = False
    policy_version: int = 0
    last_policy_version: int = 0
    received_unix_ns: int = 0
    extends_call_id: str = ""
    error: str = ""
    sampling: SamplingParams | None = None  # None: not recorded
    truncated: bool = False  # cut by a limit the harness did not ask for (task's cap or budget, context)
    prompt_too_long: bool = False  # refused before generation: the prompt does not fit the context

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _frozen_array(self.prompt_ids, np.int32))
        object.__setattr__(self, "sampled_ids", _frozen_array(self.sampled_ids, np.int32))
        object.__setattr__(self, "logprobs", _frozen_array(self.logprobs, np.float32))
        if len(self.logprobs) != len(self.sampled_ids):
            raise InvalidCallError(
                f"call {self.call_id}: {len(self.sampled_ids)} sampled tokens but {len(self.logprobs)} logprobs"
            )

    @property
    def interrupted(self) -> bool:
        """The harness never received this response whole, so no later prompt extends its sample."""
        return self.aborted or self.finish_reason in _INTERRUPTED

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.sampled_ids)

    @classmethod
    def from_proto(cls, record: common_pb2.CallRecord) -> CallView:
        return cls(
            call_id=record.call_id,
            prompt_ids=record.prompt_token_ids,
            sampled_ids=record.sampled_token_ids,
            logprobs=record.sampled_logprobs,
            finish_reason=record.finish_reason,
            aborted=record.aborted,
            policy_version=record.policy_version,
            last_policy_version=record.last_policy_version,
            received_unix_ns=record.timings.received_unix_ns,
            extends_call_id=record.extends_call_id,
            error=record.error,
            sampling=_sampling_of(record),
            truncated=record.truncated,
            prompt_too_long=record.prompt_too_long,
        )

    def to_proto(self, session_id: str = "") -> common_pb2.CallRecord:
        """A CallRecord holding this view's fields (dialect, bodies and timings other than arrival unset)."""
        return common_pb2.CallRecord(
            call_id=self.call_id,
            session_id=session_id,
            prompt_token_ids=self.prompt_ids.tolist(),
            sampled_token_ids=self.sampled_ids.tolist(),
            sampled_logprobs=self.logprobs.tolist(),
            finish_reason=self.finish_reason,
            aborted=self.aborted,
            policy_version=self.policy_version,
            last_policy_version=self.last_policy_version,
            extends_call_id=self.extends_call_id,
            error=self.error,
            timings=common_pb2.CallTimings(received_unix_ns=self.received_unix_ns),
            sampling=self.sampling.to_proto() if self.sampling is not None else None,
            truncated=self.truncated,
            prompt_too_long=self.prompt_too_long,
        )


def views_from_protos(records: Sequence[common_pb2.CallRecord]) -> tuple[CallView, ...]:
    return tuple(CallView.from_proto(record) for record in records)


class SegmentKind(enum.IntEnum):
    """Mirrors ``polar.v1.TraceSegment.Kind``."""

    PROMPT = common_pb2.TraceSegment.KIND_PROMPT
    SAMPLED = common_pb2.TraceSegment.KIND_SAMPLED


@dataclass(frozen=True)
class Segment:
    """Token positions [start, end) of a trace that come from one call's prompt or sample."""

    kind: SegmentKind
    start: int
    end: int
    call_id: str
    sampling: SamplingParams | None = None  # SAMPLED: the call's sampling (None when not recorded)

    def to_proto(self) -> common_pb2.TraceSegment:
        return common_pb2.TraceSegment(
            kind=int(self.kind),
            start=self.start,
            end=self.end,
            call_id=self.call_id,
            sampling=self.sampling.to_proto() if self.sampling is not None else None,
        )

    @classmethod
    def from_proto(cls, segment: common_pb2.TraceSegment) -> Segment:
        return cls(SegmentKind(segment.kind), segment.start, segment.end, segment.call_id, _sampling_of(segment))


@dataclass(frozen=True, eq=False)
class BuiltTrace:
    """One token sequence for the trainer (mirrors ``polar.v1.Trace``)."""

    trace_id: str
    token_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) uint8: 1 on sampled tokens
    logprobs: np.ndarray  # (T,) float32: behaviour logprob where loss_mask is 1, else 0
    segments: tuple[Segment, ...]
    policy_versions: tuple[int, ...]  # one per SAMPLED segment, in order
    fork_reason: str = ""
    weight: float = 0.0
    truncated: bool = False  # a call whose sample it holds was truncated

    def __post_init__(self) -> None:
        for name, dtype in (("token_ids", np.int32), ("loss_mask", np.uint8), ("logprobs", np.float32)):
            array = np.asarray(getattr(self, name), dtype=dtype)
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "policy_versions", tuple(self.policy_versions))

    @property
    def trainable_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def with_weight(self, weight: float) -> BuiltTrace:
        return replace(self, weight=weight)

    def to_proto(self) -> common_pb2.Trace:
        return common_pb2.Trace(
            trace_id=self.trace_id,
            token_ids=self.token_ids.tolist(),
            loss_mask=self.loss_mask.tolist(),
            behaviour_logprobs=self.logprobs.tolist(),
            segments=[segment.to_proto() for segment in self.segments],
            policy_versions=self.policy_versions,
            weight=self.weight,
            fork_reason=self.fork_reason,
            truncated=self.truncated,
        )

    @classmethod
    def from_proto(cls, trace: common_pb2.Trace) -> BuiltTrace:
        return cls(
            trace_id=trace.trace_id,
            token_ids=np.array(trace.token_ids, dtype=np.int32),
            loss_mask=np.array(trace.loss_mask, dtype=np.uint8),
            logprobs=np.array(trace.behaviour_logprobs, dtype=np.float32),
            segments=tuple(Segment.from_proto(segment) for segment in trace.segments),
            policy_versions=tuple(trace.policy_versions),
            fork_reason=trace.fork_reason,
            weight=trace.weight,
            truncated=trace.truncated,
        )


@dataclass(frozen=True)
class MergeStats:
    """How a session's calls became traces (mirrors ``polar.v1.MergeStats``)."""

    calls: int  # calls in the session, including those that sampled nothing
    chains: int  # traces produced
    tokens_before: int  # sum of prompt + sampled tokens over the calls that sampled something
    tokens_after: int  # sum of trace lengths: what the trainer runs over
    forks: Mapping[str, int] = field(default_factory=dict)  # traces started per fork reason

    def __post_init__(self) -> None:
        object.__setattr__(self, "forks", types.MappingProxyType(dict(sorted(self.forks.items()))))

    def to_proto(self) -> common_pb2.MergeStats:
        return common_pb2.MergeStats(
            calls=self.calls,
            chains=self.chains,
            tokens_before=self.tokens_before,
            tokens_after=self.tokens_after,
            forks=dict(self.forks),
        )

    @classmethod
    def from_proto(cls, stats: common_pb2.MergeStats) -> MergeStats:
        return cls(stats.calls, stats.chains, stats.tokens_before, stats.tokens_after, dict(stats.forks))


@dataclass(frozen=True)
class BuildResult:
    """A builder's output for one session."""

    builder: str
    traces: tuple[BuiltTrace, ...]
    stats: MergeStats

    def to_proto_traces(self) -> list[common_pb2.Trace]:
        return [trace.to_proto() for trace in self.traces]


def make_stats(calls: Sequence[CallView], traces: Sequence[BuiltTrace]) -> MergeStats:
    forks: dict[str, int] = {}
    for trace in traces:
        if trace.fork_reason:
            forks[trace.fork_reason] = forks.get(trace.fork_reason, 0) + 1
    return MergeStats(
        calls=len(calls),
        chains=len(traces),
        tokens_before=sum(call.total_tokens for call in calls if len(call.sampled_ids)),
        tokens_after=sum(len(trace.token_ids) for trace in traces),
        forks=forks,
    )


def check_unique_ids(calls: Sequence[CallView]) -> None:
    seen: set[str] = set()
    for call in calls:
        if call.call_id in seen:
            raise InvalidCallError(f"call id {call.call_id!r} appears more than once in the session")
        seen.add(call.call_id)
