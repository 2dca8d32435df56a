from polar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_PENDING: _ClassVar[SessionState]
    SESSION_STATE_INIT: _ClassVar[SessionState]
    SESSION_STATE_READY: _ClassVar[SessionState]
    SESSION_STATE_RUNNING: _ClassVar[SessionState]
    SESSION_STATE_POSTRUN: _ClassVar[SessionState]
    SESSION_STATE_DONE: _ClassVar[SessionState]
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_PENDING: SessionState
SESSION_STATE_INIT: SessionState
SESSION_STATE_READY: SessionState
SESSION_STATE_RUNNING: SessionState
SESSION_STATE_POSTRUN: SessionState
SESSION_STATE_DONE: SessionState

class HarnessSpec(_message.Message):
    __slots__ = ("preset", "command", "env", "dialect")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PRESET_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    DIALECT_FIELD_NUMBER: _ClassVar[int]
    preset: str
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    dialect: _common_pb2.Dialect
    def __init__(self, preset: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., dialect: _Optional[_Union[_common_pb2.Dialect, str]] = ...) -> None: ...

class RuntimeSpec(_message.Message):
    __slots__ = ("kind", "template", "prepare", "image", "revision", "workdir", "cpus", "memory_bytes", "max_processes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    template: str
    prepare: _containers.RepeatedScalarFieldContainer[str]
    image: str
    revision: str
    workdir: str
    cpus: float
    memory_bytes: int
    max_processes: int
    def __init__(self, kind: _Optional[str] = ..., template: _Optional[str] = ..., prepare: _Optional[_Iterable[str]] = ..., image: _Optional[str] = ..., revision: _Optional[str] = ..., workdir: _Optional[str] = ..., cpus: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., max_processes: _Optional[int] = ...) -> None: ...

class EvaluatorSpec(_message.Message):
    __slots__ = ("kind", "command", "callable", "timeout_seconds", "swe", "harbor", "gym")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CALLABLE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWE_FIELD_NUMBER: _ClassVar[int]
    HARBOR_FIELD_NUMBER: _ClassVar[int]
    GYM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    command: str
    callable: str
    timeout_seconds: float
    swe: SweTests
    harbor: HarborTests
    gym: GymVerifier
    def __init__(self, kind: _Optional[str] = ..., command: _Optional[str] = ..., callable: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., swe: _Optional[_Union[SweTests, _Mapping]] = ..., harbor: _Optional[_Union[HarborTests, _Mapping]] = ..., gym: _Optional[_Union[GymVerifier, _Mapping]] = ...) -> None: ...

class GymVerifier(_message.Message):
    __slots__ = ("url", "row_json")
    URL_FIELD_NUMBER: _ClassVar[int]
    ROW_JSON_FIELD_NUMBER: _ClassVar[int]
    url: str
    row_json: str
    def __init__(self, url: _Optional[str] = ..., row_json: _Optional[str] = ...) -> None: ...

class HarborTests(_message.Message):
    __slots__ = ("name", "image", "solution_image", "env", "solution_env")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SolutionEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SOLUTION_IMAGE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SOLUTION_ENV_FIELD_NUMBER: _ClassVar[int]
    name: str
    image: str
    solution_image: str
    env: _containers.ScalarMap[str, str]
    solution_env: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., image: _Optional[str] = ..., solution_image: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., solution_env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SweTests(_message.Message):
    __slots__ = ("instance_id", "test_patch", "fail_to_pass", "pass_to_pass", "test_command", "gold_patch", "max_patch_bytes")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TEST_PATCH_FIELD_NUMBER: _ClassVar[int]
    FAIL_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    PASS_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    TEST_COMMAND_FIELD_NUMBER: _ClassVar[int]
    GOLD_PATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_PATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    test_patch: str
    fail_to_pass: _containers.RepeatedScalarFieldContainer[str]
    pass_to_pass: _containers.RepeatedScalarFieldContainer[str]
    test_command: str
    gold_patch: str
    max_patch_bytes: int
    def __init__(self, instance_id: _Optional[str] = ..., test_patch: _Optional[str] = ..., fail_to_pass: _Optional[_Iterable[str]] = ..., pass_to_pass: _Optional[_Iterable[str]] = ..., test_command: _Optional[str] = ..., gold_patch: _Optional[str] = ..., max_patch_bytes: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "instruction", "group_size", "harness", "runtime", "evaluator", "builder", "timeout_seconds", "priority", "metadata", "sampling", "adapter")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HARNESS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    BUILDER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    instruction: str
    group_size: int
    harness: HarnessSpec
    runtime: RuntimeSpec
    evaluator: EvaluatorSpec
    builder: str
    timeout_seconds: float
    priority: int
    metadata: _containers.ScalarMap[str, str]
    sampling: _common_pb2.SamplingPolicy
    adapter: str
    def __init__(self, task_id: _Optional[str] = ..., instruction: _Optional[str] = ..., group_size: _Optional[int] = ..., harness: _Optional[_Union[HarnessSpec, _Mapping]] = ..., runtime: _Optional[_Union[RuntimeSpec, _Mapping]] = ..., evaluator: _Optional[_Union[EvaluatorSpec, _Mapping]] = ..., builder: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., priority: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingPolicy, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class SubmitTasksRequest(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ...) -> None: ...

class SubmitTasksResponse(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchResultsRequest(_message.Message):
    __slots__ = ("cursor", "max_groups_per_batch", "until_caught_up")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    UNTIL_CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    cursor: str
    max_groups_per_batch: int
    until_caught_up: bool
    def __init__(self, cursor: _Optional[str] = ..., max_groups_per_batch: _Optional[int] = ..., until_caught_up: _Optional[bool] = ...) -> None: ...

class WatchResultsResponse(_message.Message):
    __slots__ = ("cursor", "zstd_trajectories", "group_count", "trajectory_count", "uncompressed_bytes")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    ZSTD_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GROUP_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_COUNT_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    cursor: str
    zstd_trajectories: bytes
    group_count: int
    trajectory_count: int
    uncompressed_bytes: int
    def __init__(self, cursor: _Optional[str] = ..., zstd_trajectories: _Optional[bytes] = ..., group_count: _Optional[int] = ..., trajectory_count: _Optional[int] = ..., uncompressed_bytes: _Optional[int] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "task_id", "node_id", "state", "outcome", "reward", "call_count", "stage_timings", "error", "attempts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    STAGE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task_id: str
    node_id: str
    state: SessionState
    outcome: _common_pb2.SessionOutcome
    reward: float
    call_count: int
    stage_timings: _common_pb2.StageTimings
    error: str
    attempts: int
    def __init__(self, session_id: _Optional[str] = ..., task_id: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., outcome: _Optional[_Union[_common_pb2.SessionOutcome, str]] = ..., reward: _Optional[float] = ..., call_count: _Optional[int] = ..., stage_timings: _Optional[_Union[_common_pb2.StageTimings, _Mapping]] = ..., error: _Optional[str] = ..., attempts: _Optional[int] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task_id", "group_size", "sessions_by_state", "released", "mean_reward", "harness")
    class SessionsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    HARNESS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    group_size: int
    sessions_by_state: _containers.ScalarMap[str, int]
    released: bool
    mean_reward: float
    harness: str
    def __init__(self, task_id: _Optional[str] = ..., group_size: _Optional[int] = ..., sessions_by_state: _Optional[_Mapping[str, int]] = ..., released: _Optional[bool] = ..., mean_reward: _Optional[float] = ..., harness: _Optional[str] = ...) -> None: ...

class GetTaskStatusRequest(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTaskStatusResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ...) -> None: ...

class GetSessionStatusRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: SessionStatus
    def __init__(self, status: _Optional[_Union[SessionStatus, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("task_ids", "session_ids")
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ..., session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("name", "capacity", "depth")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity: int
    depth: int
    def __init__(self, name: _Optional[str] = ..., capacity: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("gateway_address", "base_url", "pools", "runtimes")
    GATEWAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    gateway_address: str
    base_url: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    runtimes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gateway_address: _Optional[str] = ..., base_url: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., runtimes: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval_seconds", "node_secret", "max_request_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval_seconds: float
    node_secret: str
    max_request_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., node_secret: _Optional[str] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "node_secret", "pools", "sessions", "leaving")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_secret: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionProgress]
    leaving: bool
    def __init__(self, node_id: _Optional[str] = ..., node_secret: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionProgress, _Mapping]]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class SessionProgress(_message.Message):
    __slots__ = ("session_id", "state", "call_count", "stage_timings", "new_calls")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    STAGE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NEW_CALLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: SessionState
    call_count: int
    stage_timings: _common_pb2.StageTimings
    new_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.CallRecord]
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., call_count: _Optional[int] = ..., stage_timings: _Optional[_Union[_common_pb2.StageTimings, _Mapping]] = ..., new_calls: _Optional[_Iterable[_Union[_common_pb2.CallRecord, _Mapping]]] = ...) -> None: ...

class SessionAssignment(_message.Message):
    __slots__ = ("session_id", "task", "attempt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task: Task
    attempt: int
    def __init__(self, session_id: _Optional[str] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., attempt: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("start", "cancel", "reregister", "max_request_bytes")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[SessionAssignment]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    reregister: bool
    max_request_bytes: int
    def __init__(self, start: _Optional[_Iterable[_Union[SessionAssignment, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ..., reregister: _Optional[bool] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...

class ReportSessionRequest(_message.Message):
    __slots__ = ("node_id", "node_secret", "session_id", "trajectory")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_secret: str
    session_id: str
    trajectory: _common_pb2.Trajectory
    def __init__(self, node_id: _Optional[str] = ..., node_secret: _Optional[str] = ..., session_id: _Optional[str] = ..., trajectory: _Optional[_Union[_common_pb2.Trajectory, _Mapping]] = ...) -> None: ...

class ReportSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "gateway_address", "base_url", "runtimes", "pools", "session_count", "seconds_since_heartbeat", "credential", "credential_role")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SESSION_COUNT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ROLE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gateway_address: str
    base_url: str
    runtimes: _containers.RepeatedScalarFieldContainer[str]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    session_count: int
    seconds_since_heartbeat: float
    credential: str
    credential_role: str
    def __init__(self, node_id: _Optional[str] = ..., gateway_address: _Optional[str] = ..., base_url: _Optional[str] = ..., runtimes: _Optional[_Iterable[str]] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., session_count: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., credential: _Optional[str] = ..., credential_role: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class JoinUpstreamRequest(_message.Message):
    __slots__ = ("cluster", "address", "envoy")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENVOY_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    address: str
    envoy: str
    def __init__(self, cluster: _Optional[str] = ..., address: _Optional[str] = ..., envoy: _Optional[str] = ...) -> None: ...

class JoinUpstreamResponse(_message.Message):
    __slots__ = ("upstream_id", "upstream_secret", "heartbeat_interval_seconds", "accepted_credentials")
    UPSTREAM_ID_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_SECRET_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    upstream_id: str
    upstream_secret: str
    heartbeat_interval_seconds: float
    accepted_credentials: _containers.RepeatedCompositeFieldContainer[AcceptedCredential]
    def __init__(self, upstream_id: _Optional[str] = ..., upstream_secret: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., accepted_credentials: _Optional[_Iterable[_Union[AcceptedCredential, _Mapping]]] = ...) -> None: ...

class AcceptedCredential(_message.Message):
    __slots__ = ("name", "role", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class UpstreamHeartbeatRequest(_message.Message):
    __slots__ = ("upstream_id", "upstream_secret", "draining", "gone")
    UPSTREAM_ID_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_SECRET_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    upstream_id: str
    upstream_secret: str
    draining: bool
    gone: bool
    def __init__(self, upstream_id: _Optional[str] = ..., upstream_secret: _Optional[str] = ..., draining: _Optional[bool] = ..., gone: _Optional[bool] = ...) -> None: ...

class UpstreamHeartbeatResponse(_message.Message):
    __slots__ = ("rejoin", "drain_acknowledged", "accepted_credentials")
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    rejoin: bool
    drain_acknowledged: bool
    accepted_credentials: _containers.RepeatedCompositeFieldContainer[AcceptedCredential]
    def __init__(self, rejoin: _Optional[bool] = ..., drain_acknowledged: _Optional[bool] = ..., accepted_credentials: _Optional[_Iterable[_Union[AcceptedCredential, _Mapping]]] = ...) -> None: ...

class ListUpstreamsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpstreamInfo(_message.Message):
    __slots__ = ("upstream_id", "cluster", "address", "envoy", "draining", "seconds_since_heartbeat", "credential", "credential_role")
    UPSTREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENVOY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ROLE_FIELD_NUMBER: _ClassVar[int]
    upstream_id: str
    cluster: str
    address: str
    envoy: str
    draining: bool
    seconds_since_heartbeat: float
    credential: str
    credential_role: str
    def __init__(self, upstream_id: _Optional[str] = ..., cluster: _Optional[str] = ..., address: _Optional[str] = ..., envoy: _Optional[str] = ..., draining: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., credential: _Optional[str] = ..., credential_role: _Optional[str] = ...) -> None: ...

class EnvoyInfo(_message.Message):
    __slots__ = ("node_id", "connected", "version", "acknowledged_version", "rejected_version", "error", "credential", "credential_role")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    REJECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ROLE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    connected: bool
    version: str
    acknowledged_version: str
    rejected_version: str
    error: str
    credential: str
    credential_role: str
    def __init__(self, node_id: _Optional[str] = ..., connected: _Optional[bool] = ..., version: _Optional[str] = ..., acknowledged_version: _Optional[str] = ..., rejected_version: _Optional[str] = ..., error: _Optional[str] = ..., credential: _Optional[str] = ..., credential_role: _Optional[str] = ...) -> None: ...

class ListUpstreamsResponse(_message.Message):
    __slots__ = ("upstreams", "envoys")
    UPSTREAMS_FIELD_NUMBER: _ClassVar[int]
    ENVOYS_FIELD_NUMBER: _ClassVar[int]
    upstreams: _containers.RepeatedCompositeFieldContainer[UpstreamInfo]
    envoys: _containers.RepeatedCompositeFieldContainer[EnvoyInfo]
    def __init__(self, upstreams: _Optional[_Iterable[_Union[UpstreamInfo, _Mapping]]] = ..., envoys: _Optional[_Iterable[_Union[EnvoyInfo, _Mapping]]] = ...) -> None: ...
