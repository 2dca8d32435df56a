from polar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HistoryPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HISTORY_POLICY_UNSPECIFIED: _ClassVar[HistoryPolicy]
    HISTORY_POLICY_FAITHFUL: _ClassVar[HistoryPolicy]
    HISTORY_POLICY_TEMPLATE: _ClassVar[HistoryPolicy]
HISTORY_POLICY_UNSPECIFIED: HistoryPolicy
HISTORY_POLICY_FAITHFUL: HistoryPolicy
HISTORY_POLICY_TEMPLATE: HistoryPolicy

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "task_id", "history", "metadata", "sampling", "adapter")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task_id: str
    history: HistoryPolicy
    metadata: _containers.ScalarMap[str, str]
    sampling: _common_pb2.SamplingPolicy
    adapter: str
    def __init__(self, session_id: _Optional[str] = ..., task_id: _Optional[str] = ..., history: _Optional[_Union[HistoryPolicy, str]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingPolicy, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "key", "task_id", "closed", "call_count", "opened_unix_ns", "closed_unix_ns", "history", "metadata", "sampling", "expired", "adapter")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    CALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    key: str
    task_id: str
    closed: bool
    call_count: int
    opened_unix_ns: int
    closed_unix_ns: int
    history: HistoryPolicy
    metadata: _containers.ScalarMap[str, str]
    sampling: _common_pb2.SamplingPolicy
    expired: bool
    adapter: str
    def __init__(self, session_id: _Optional[str] = ..., key: _Optional[str] = ..., task_id: _Optional[str] = ..., closed: _Optional[bool] = ..., call_count: _Optional[int] = ..., opened_unix_ns: _Optional[int] = ..., closed_unix_ns: _Optional[int] = ..., history: _Optional[_Union[HistoryPolicy, str]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingPolicy, _Mapping]] = ..., expired: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("key", "omit_calls")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OMIT_CALLS_FIELD_NUMBER: _ClassVar[int]
    key: str
    omit_calls: bool
    def __init__(self, key: _Optional[str] = ..., omit_calls: _Optional[bool] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session", "calls")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.CallRecord]
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., calls: _Optional[_Iterable[_Union[_common_pb2.CallRecord, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("open_sessions",)
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    open_sessions: int
    def __init__(self, open_sessions: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class WatchSessionRequest(_message.Message):
    __slots__ = ("key", "until_caught_up")
    KEY_FIELD_NUMBER: _ClassVar[int]
    UNTIL_CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    key: str
    until_caught_up: bool
    def __init__(self, key: _Optional[str] = ..., until_caught_up: _Optional[bool] = ...) -> None: ...

class WatchSessionResponse(_message.Message):
    __slots__ = ("call",)
    CALL_FIELD_NUMBER: _ClassVar[int]
    call: _common_pb2.CallRecord
    def __init__(self, call: _Optional[_Union[_common_pb2.CallRecord, _Mapping]] = ...) -> None: ...

class GetNodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNodeStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: NodeStatus
    def __init__(self, status: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "open_sessions", "calls_in_flight", "calls_total", "draining", "base_url")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    open_sessions: int
    calls_in_flight: int
    calls_total: int
    draining: bool
    base_url: str
    def __init__(self, node_id: _Optional[str] = ..., open_sessions: _Optional[int] = ..., calls_in_flight: _Optional[int] = ..., calls_total: _Optional[int] = ..., draining: _Optional[bool] = ..., base_url: _Optional[str] = ...) -> None: ...
