from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class Dialect(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIALECT_UNSPECIFIED: _ClassVar[Dialect]
    DIALECT_OPENAI_CHAT: _ClassVar[Dialect]
    DIALECT_OPENAI_RESPONSES: _ClassVar[Dialect]
    DIALECT_ANTHROPIC_MESSAGES: _ClassVar[Dialect]
    DIALECT_GOOGLE_GENERATE_CONTENT: _ClassVar[Dialect]

class SessionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_OUTCOME_UNSPECIFIED: _ClassVar[SessionOutcome]
    SESSION_OUTCOME_COMPLETED: _ClassVar[SessionOutcome]
    SESSION_OUTCOME_TIMED_OUT: _ClassVar[SessionOutcome]
    SESSION_OUTCOME_CANCELLED: _ClassVar[SessionOutcome]
    SESSION_OUTCOME_FAILED: _ClassVar[SessionOutcome]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_ERROR: FinishReason
DIALECT_UNSPECIFIED: Dialect
DIALECT_OPENAI_CHAT: Dialect
DIALECT_OPENAI_RESPONSES: Dialect
DIALECT_ANTHROPIC_MESSAGES: Dialect
DIALECT_GOOGLE_GENERATE_CONTENT: Dialect
SESSION_OUTCOME_UNSPECIFIED: SessionOutcome
SESSION_OUTCOME_COMPLETED: SessionOutcome
SESSION_OUTCOME_TIMED_OUT: SessionOutcome
SESSION_OUTCOME_CANCELLED: SessionOutcome
SESSION_OUTCOME_FAILED: SessionOutcome

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "ignore_eos", "constraint")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    constraint: OutputConstraint
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("kind", "json_schema", "prefix", "suffix")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    kind: str
    json_schema: str
    prefix: str
    suffix: str
    def __init__(self, kind: _Optional[str] = ..., json_schema: _Optional[str] = ..., prefix: _Optional[str] = ..., suffix: _Optional[str] = ...) -> None: ...

class SamplingPolicy(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens_per_call", "max_tokens_per_session", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens_per_call: int
    max_tokens_per_session: int
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens_per_call: _Optional[int] = ..., max_tokens_per_session: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...

class CallTimings(_message.Message):
    __slots__ = ("received_unix_ns", "render_seconds", "time_to_first_token_seconds", "total_seconds", "queue_seconds")
    RECEIVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    RENDER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    received_unix_ns: int
    render_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    queue_seconds: float
    def __init__(self, received_unix_ns: _Optional[int] = ..., render_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class CallRecord(_message.Message):
    __slots__ = ("call_id", "session_id", "dialect", "model", "prompt_token_ids", "sampled_token_ids", "sampled_logprobs", "finish_reason", "policy_version", "last_policy_version", "extends_call_id", "forced_token_count", "aborted", "error", "request_body", "response_body", "timings", "usage", "stream", "sampling", "truncated", "bodies_dropped", "prompt_too_long")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DIALECT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTENDS_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    BODIES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOO_LONG_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    session_id: str
    dialect: Dialect
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    policy_version: int
    last_policy_version: int
    extends_call_id: str
    forced_token_count: int
    aborted: bool
    error: str
    request_body: bytes
    response_body: bytes
    timings: CallTimings
    usage: Usage
    stream: bool
    sampling: SamplingParams
    truncated: bool
    bodies_dropped: bool
    prompt_too_long: bool
    def __init__(self, call_id: _Optional[str] = ..., session_id: _Optional[str] = ..., dialect: _Optional[_Union[Dialect, str]] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., last_policy_version: _Optional[int] = ..., extends_call_id: _Optional[str] = ..., forced_token_count: _Optional[int] = ..., aborted: _Optional[bool] = ..., error: _Optional[str] = ..., request_body: _Optional[bytes] = ..., response_body: _Optional[bytes] = ..., timings: _Optional[_Union[CallTimings, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stream: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., truncated: _Optional[bool] = ..., bodies_dropped: _Optional[bool] = ..., prompt_too_long: _Optional[bool] = ...) -> None: ...

class TraceSegment(_message.Message):
    __slots__ = ("kind", "start", "end", "call_id", "sampling")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TraceSegment.Kind]
        KIND_PROMPT: _ClassVar[TraceSegment.Kind]
        KIND_SAMPLED: _ClassVar[TraceSegment.Kind]
    KIND_UNSPECIFIED: TraceSegment.Kind
    KIND_PROMPT: TraceSegment.Kind
    KIND_SAMPLED: TraceSegment.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    kind: TraceSegment.Kind
    start: int
    end: int
    call_id: str
    sampling: SamplingParams
    def __init__(self, kind: _Optional[_Union[TraceSegment.Kind, str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., call_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("trace_id", "token_ids", "loss_mask", "behaviour_logprobs", "segments", "policy_versions", "weight", "fork_reason", "truncated")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    FORK_REASON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    segments: _containers.RepeatedCompositeFieldContainer[TraceSegment]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    weight: float
    fork_reason: str
    truncated: bool
    def __init__(self, trace_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., segments: _Optional[_Iterable[_Union[TraceSegment, _Mapping]]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., weight: _Optional[float] = ..., fork_reason: _Optional[str] = ..., truncated: _Optional[bool] = ...) -> None: ...

class MergeStats(_message.Message):
    __slots__ = ("calls", "chains", "tokens_before", "tokens_after", "forks")
    class ForksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AFTER_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    calls: int
    chains: int
    tokens_before: int
    tokens_after: int
    forks: _containers.ScalarMap[str, int]
    def __init__(self, calls: _Optional[int] = ..., chains: _Optional[int] = ..., tokens_before: _Optional[int] = ..., tokens_after: _Optional[int] = ..., forks: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("queued_seconds", "init_seconds", "ready_seconds", "running_seconds", "postrun_seconds")
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POSTRUN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queued_seconds: float
    init_seconds: float
    ready_seconds: float
    running_seconds: float
    postrun_seconds: float
    def __init__(self, queued_seconds: _Optional[float] = ..., init_seconds: _Optional[float] = ..., ready_seconds: _Optional[float] = ..., running_seconds: _Optional[float] = ..., postrun_seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "session_id", "task_id", "group_id", "traces", "reward", "weight", "stats", "outcome", "error", "builder", "min_policy_version", "max_policy_version", "stage_timings", "metadata", "calls", "attempt", "harness_exit_code", "harness_output", "evaluator_output", "abandoned_calls")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRACES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BUILDER_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    HARNESS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    HARNESS_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_CALLS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    session_id: str
    task_id: str
    group_id: str
    traces: _containers.RepeatedCompositeFieldContainer[Trace]
    reward: float
    weight: float
    stats: MergeStats
    outcome: SessionOutcome
    error: str
    builder: str
    min_policy_version: int
    max_policy_version: int
    stage_timings: StageTimings
    metadata: _containers.ScalarMap[str, str]
    calls: _containers.RepeatedCompositeFieldContainer[CallRecord]
    attempt: int
    harness_exit_code: int
    harness_output: str
    evaluator_output: str
    abandoned_calls: _containers.RepeatedCompositeFieldContainer[CallRecord]
    def __init__(self, trajectory_id: _Optional[str] = ..., session_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., traces: _Optional[_Iterable[_Union[Trace, _Mapping]]] = ..., reward: _Optional[float] = ..., weight: _Optional[float] = ..., stats: _Optional[_Union[MergeStats, _Mapping]] = ..., outcome: _Optional[_Union[SessionOutcome, str]] = ..., error: _Optional[str] = ..., builder: _Optional[str] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., stage_timings: _Optional[_Union[StageTimings, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., calls: _Optional[_Iterable[_Union[CallRecord, _Mapping]]] = ..., attempt: _Optional[int] = ..., harness_exit_code: _Optional[int] = ..., harness_output: _Optional[str] = ..., evaluator_output: _Optional[str] = ..., abandoned_calls: _Optional[_Iterable[_Union[CallRecord, _Mapping]]] = ...) -> None: ...

class TrajectoryBatch(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...
