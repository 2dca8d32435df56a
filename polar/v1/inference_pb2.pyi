from polar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "session_id", "message_interval_seconds", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    session_id: str
    message_interval_seconds: float
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., message_interval_seconds: _Optional[float] = ..., adapter: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "policy_version", "finish_reason", "usage", "queue_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    queue_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("tensor_count", "note", "update_id", "adapter")
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    tensor_count: int
    note: str
    update_id: str
    adapter: str
    def __init__(self, tensor_count: _Optional[int] = ..., note: _Optional[str] = ..., update_id: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "tensors_updated", "bytes_received", "apply_seconds", "staged")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensors_updated: int
    bytes_received: int
    apply_seconds: float
    staged: bool
    def __init__(self, policy_version: _Optional[int] = ..., tensors_updated: _Optional[int] = ..., bytes_received: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., staged: _Optional[bool] = ...) -> None: ...

class CommitWeightsRequest(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class CommitWeightsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: UpdateWeightsResponse
    def __init__(self, result: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ...) -> None: ...

class UpdateWeightsSharedRequest(_message.Message):
    __slots__ = ("header", "bucket")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    header: SharedWeightsHeader
    bucket: SharedBucket
    def __init__(self, header: _Optional[_Union[SharedWeightsHeader, _Mapping]] = ..., bucket: _Optional[_Union[SharedBucket, _Mapping]] = ...) -> None: ...

class SharedWeightsHeader(_message.Message):
    __slots__ = ("tensor_count", "note", "update_id", "buffers", "host_buffers", "adapter")
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    HOST_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    tensor_count: int
    note: str
    update_id: str
    buffers: _containers.RepeatedCompositeFieldContainer[CudaIpcBuffer]
    host_buffers: _containers.RepeatedCompositeFieldContainer[HostSharedBuffer]
    adapter: str
    def __init__(self, tensor_count: _Optional[int] = ..., note: _Optional[str] = ..., update_id: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[CudaIpcBuffer, _Mapping]]] = ..., host_buffers: _Optional[_Iterable[_Union[HostSharedBuffer, _Mapping]]] = ..., adapter: _Optional[str] = ...) -> None: ...

class HostSharedBuffer(_message.Message):
    __slots__ = ("name", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class SharedBucket(_message.Message):
    __slots__ = ("buffer", "tensors")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    buffer: int
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    def __init__(self, buffer: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "tensor_offset", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    tensor_offset: int
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., tensor_offset: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UpdateWeightsSharedResponse(_message.Message):
    __slots__ = ("buffer_released", "result")
    BUFFER_RELEASED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    buffer_released: int
    result: UpdateWeightsResponse
    def __init__(self, buffer_released: _Optional[int] = ..., result: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ...) -> None: ...

class UpdateWeightsCollectiveRequest(_message.Message):
    __slots__ = ("header", "bucket")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    header: CollectiveWeightsHeader
    bucket: SharedBucket
    def __init__(self, header: _Optional[_Union[CollectiveWeightsHeader, _Mapping]] = ..., bucket: _Optional[_Union[SharedBucket, _Mapping]] = ...) -> None: ...

class CollectiveWeightsHeader(_message.Message):
    __slots__ = ("tensor_count", "note", "update_id", "backend", "rendezvous", "group_id", "world_size", "rank", "bucket_bytes", "buffer_count", "timeout_seconds", "group_sync", "adapter")
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SYNC_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    tensor_count: int
    note: str
    update_id: str
    backend: str
    rendezvous: str
    group_id: str
    world_size: int
    rank: int
    bucket_bytes: int
    buffer_count: int
    timeout_seconds: float
    group_sync: int
    adapter: str
    def __init__(self, tensor_count: _Optional[int] = ..., note: _Optional[str] = ..., update_id: _Optional[str] = ..., backend: _Optional[str] = ..., rendezvous: _Optional[str] = ..., group_id: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., buffer_count: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., group_sync: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class UpdateWeightsCollectiveResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: UpdateWeightsResponse
    def __init__(self, result: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "rank", "alpha", "targets", "policy_version", "replace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    alpha: float
    targets: str
    policy_version: int
    replace: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., targets: _Optional[str] = ..., policy_version: _Optional[int] = ..., replace: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("ended_generations",)
    ENDED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    ended_generations: int
    def __init__(self, ended_generations: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "rank", "alpha", "targets", "policy_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    alpha: float
    targets: _containers.RepeatedScalarFieldContainer[str]
    policy_version: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., targets: _Optional[_Iterable[str]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: int
    def __init__(self, drained: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("admitted",)
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    admitted: int
    def __init__(self, admitted: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_info",)
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    model_info: ModelInfo
    def __init__(self, model_info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "eos_token_ids", "end_of_turn_token_id", "bos_token_id", "chat_template", "context_length", "policy_version", "engine", "dtype", "device", "parameter_count", "paused", "tokenizer_path", "weight_transports", "host_id", "constrained_decoding", "adapters", "max_adapters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_OF_TURN_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_DECODING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    end_of_turn_token_id: int
    bos_token_id: int
    chat_template: str
    context_length: int
    policy_version: int
    engine: str
    dtype: str
    device: str
    parameter_count: int
    paused: bool
    tokenizer_path: str
    weight_transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    constrained_decoding: bool
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_adapters: int
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., end_of_turn_token_id: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., chat_template: _Optional[str] = ..., context_length: _Optional[int] = ..., policy_version: _Optional[int] = ..., engine: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., parameter_count: _Optional[int] = ..., paused: _Optional[bool] = ..., tokenizer_path: _Optional[str] = ..., weight_transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., constrained_decoding: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_adapters: _Optional[int] = ...) -> None: ...
