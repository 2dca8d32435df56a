"""Weight sync: the trainer's new weights onto every inference server, as one policy version.

    Pause (every server, at once)  ->  UpdateWeights (streamed, per server)  ->  Resume (every server)

Pause lets the generations in flight finish and holds new ones, so no call mixes two versions within
one step; UpdateWeights streams each tensor in chunks straight from the backend's parameters (one
tensor in flight at a time, never a second copy of the model); Resume runs whatever happened, so a
failed update never leaves a server holding its calls. Every server must then report the same
version, which becomes the trainer's policy version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from polar import credentials
from polar.v1 import inference_pb2, inference_pb2_grpc

CHUNK_BYTES = 16 * 1024 * 1024  # the inference server accepts messages up to 64 MiB
RPC_TIMEOUT_S = 600.0  # a pause waits for the longest generation in flight
UPDATE_WEIGHTS = "/polar.v1.InferenceService/UpdateWeights"
WIRE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class WeightSyncError(RuntimeError):
    """An inference server refused or failed the update; the message names it."""


@dataclass(frozen=True)
class SyncResult:
    policy_version: int  # the version every server now serves
    bytes_sent: int  # per server
    seconds: float


def tensor_messages(named_tensors: Iterable[tuple[str, torch.Tensor]], note: str) -> Iterator[bytes]:
    """An UpdateWeights stream, serialized: the header, then each tensor's bytes in chunks of
    CHUNK_BYTES, each an UpdateWeightsRequest exactly as protobuf would serialize it.

    The chunks are written here rather than by protobuf because protobuf copies a bytes field in and
    out again: building the message around the tensor's memory costs one copy of the weights, which
    is most of a sync's CPU. The header counts the tensors, so an iterable that cannot say its length
    is listed first; a sized one (the megatron backend's, which gathers each layer from its ranks as
    it goes) is streamed as it comes, never held whole.
    """
    tensors = named_tensors if isinstance(named_tensors, Sized) else list(named_tensors)
    header = inference_pb2.WeightsHeader(tensor_count=len(tensors), note=note)
    yield inference_pb2.UpdateWeightsRequest(header=header).SerializeToString()
    for name, tensor in tensors:
        wire = WIRE_DTYPES.get(tensor.dtype)
        if wire is None:
            tensor, wire = tensor.float(), "float32"
        data = memoryview(tensor.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())  # no copy on the CPU
        shape = list(tensor.shape)
        for offset in range(0, max(len(data), 1), CHUNK_BYTES):
            yield chunk_message(name, wire, shape, offset, data[offset : offset + CHUNK_BYTES])


def chunk_message(name: str, dtype: str, shape: list[int], offset: int, data: memoryview) -> bytes:
    """`UpdateWeightsRequest(chunk=TensorChunk(name, dtype, shape, offset, data)).SerializeToString()`,
    with `data` copied once. Fields serialize in number order and `data` (5) is the last, so the
    other fields' bytes, then data's tag, length and bytes, are the message protobuf would write."""
    head = inference_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset).SerializeToString()
    # proto3 leaves an empty bytes field out (an empty tensor's one chunk).
    field = (_DATA_TAG, _varint(len(data)), data) if len(data) else ()
    chunk_length = len(head) + sum(len(part) for part in field)
    return b"".join((_CHUNK_TAG, _varint(chunk_length), head, *field))


# Wire tags (field number << 3 | length-delimited): UpdateWeightsRequest.chunk = 2, TensorChunk.data = 5.
_CHUNK_TAG = bytes([2 << 3 | 2])
_DATA_TAG = bytes([5 << 3 | 2])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


class InferencePool:
    """gRPC channels to every inference server the trainer keeps in sync."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("the trainer needs at least one inference server address")
        self.addresses = list(addresses)
        own = credentials.of_process()
        self._channels = [
            credentials.channel(a, credentials.TRAINER, own, options=[("grpc.max_send_message_length", -1)])
            for a in addresses
        ]
        self._stubs = [inference_pb2_grpc.InferenceServiceStub(c) for c in self._channels]
        # UpdateWeights over messages tensor_messages serialized already (no request serializer).
        self._updates = [
            channel.stream_unary(UPDATE_WEIGHTS, response_deserializer=inference_pb2.UpdateWeightsResponse.FromString)
            for channel in self._channels
        ]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def model_infos(self, timeout_s: float = 60.0) -> list[inference_pb2.ModelInfo]:
        """Each server's ModelInfo, waiting up to timeout_s for servers still starting."""
        infos = []
        for address, stub in zip(self.addresses, self._stubs):
            try:
                response = stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
            except grpc.RpcError as exc:
                raise WeightSyncError(f"inference server {address}: GetModelInfo failed: {exc.code().name}: {exc.details()}") from None
            infos.append(response.model_info)
        return infos

    def push(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], note: str) -> SyncResult:
        """Pause every server, stream `weights()` to each, resume them all; the new common version."""
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(self._stubs)) as pool:
            try:
                list(pool.map(self._pause, self.addresses, self._stubs))
                responses = []
                for address, update in zip(self.addresses, self._updates):
                    try:
                        responses.append(update(tensor_messages(weights(), note), timeout=RPC_TIMEOUT_S))
                    except grpc.RpcError as exc:
                        raise WeightSyncError(
                            f"inference server {address} refused the weights: {exc.code().name}: {exc.details()}"
                        ) from None
            finally:
                list(pool.map(self._resume, self.addresses, self._stubs))
        versions = {r.policy_version for r in responses}
        if len(versions) != 1:
            listed = ", ".join(f"{a}: {r.policy_version}" for a, r in zip(self.addresses, responses))
            raise WeightSyncError(f"inference servers disagree on the policy version after the update ({listed})")
        return SyncResult(versions.pop(), responses[0].bytes_received, time.perf_counter() - started)

    @staticmethod
    def _pause(address: str, stub) -> None:
        try:
            stub.Pause(inference_pb2.PauseRequest(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise WeightSyncError(f"inference server {address}: Pause failed: {exc.code().name}: {exc.details()}") from None

    @staticmethod
    def _resume(address: str, stub) -> None:
        try:
            stub.Resume(inference_pb2.ResumeRequest(), timeout=60)
        except grpc.RpcError:
            pass  # a server that cannot be resumed is also one that is gone; the push reports it
