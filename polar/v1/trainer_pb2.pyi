from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: TrainerStatus
    def __init__(self, status: _Optional[_Union[TrainerStatus, _Mapping]] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("step", "total_steps", "backend", "trajectories_consumed", "groups_consumed", "trained_tokens", "last_metrics", "results_cursor", "wait_seconds", "compute_seconds", "push_seconds")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_CURSOR_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    backend: str
    trajectories_consumed: int
    groups_consumed: int
    trained_tokens: int
    last_metrics: _containers.ScalarMap[str, float]
    results_cursor: str
    wait_seconds: float
    compute_seconds: float
    push_seconds: float
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., backend: _Optional[str] = ..., trajectories_consumed: _Optional[int] = ..., groups_consumed: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., results_cursor: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., push_seconds: _Optional[float] = ...) -> None: ...

class GetPolicyVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPolicyVersionResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: PolicyVersion
    def __init__(self, policy_version: _Optional[_Union[PolicyVersion, _Mapping]] = ...) -> None: ...

class PolicyVersion(_message.Message):
    __slots__ = ("version", "step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("path", "step", "policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    policy_version: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...
