"""Weight sync: the trainer's new weights onto every inference server, as one policy version.

    Pause (every server)  ->  transfer, staged (per server)  ->  CommitWeights (every server)  ->  Resume

Each server gets the update over the fastest transport it offers (cuda_ipc, shm, nccl, gloo,
stream). The transports and why a failed transfer leaves every server on the old version:
docs/design/weight-sync.md.
"""

from __future__ import annotations

import contextlib
import queue
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from polar import credentials
from polar.inference import collective, sharing
from polar.inference.weights import byte_view
from polar.v1 import inference_pb2, inference_pb2_grpc
from trainer.weight_buckets import PIECE_ALIGN, bucket_messages, sized, wire_form
from trainer.weight_collective import DEFAULT_TIMEOUT_S, CollectiveSender, GroupFailed

CHUNK_BYTES = 16 * 1024 * 1024  # the inference server accepts messages up to 64 MiB
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
RPC_TIMEOUT_S = 600.0  # a pause waits for the longest generation in flight
UPDATE_WEIGHTS = "/polar.v1.InferenceService/UpdateWeights"
TRANSPORTS = ("auto", sharing.STREAM, sharing.SHM, collective.NCCL, collective.GLOO)


class HostBuffersUnavailable(RuntimeError):
    """This machine's shared memory cannot hold the "shm" transport's two blocks."""


class WeightSyncError(RuntimeError):
    """An inference server refused or failed the update; the message names it."""


@dataclass(frozen=True)
class ServerSync:
    address: str
    transport: str  # "cuda_ipc", "nccl", "gloo" or "stream"
    seconds: float  # this server's transfer, staged (a collective group's: every member's the same)
    bytes_received: int = 0
    group: str = ""  # collective transports: "new" (built for this sync) or "kept" (from the last); else ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_received / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self) -> dict:
        """This server's line in a step's metrics."""
        line = {"address": self.address, "transport": self.transport, "seconds": self.seconds, "gbps": self.gb_per_s}
        return {**line, "group": self.group} if self.group else line


@dataclass(frozen=True)
class SyncResult:
    policy_version: int  # the version every server now serves
    bytes_sent: int  # per server
    seconds: float  # the whole sync: pause, transfers, commits, resume
    servers: tuple[ServerSync, ...] = ()

    @property
    def transport(self) -> str:
        """The transports used, joined: e.g. "stream", "nccl", or "cuda_ipc+stream"."""
        return "+".join(sorted({s.transport for s in self.servers}))

    @property
    def gb_per_s(self) -> float:
        """Model bytes over the whole sync's seconds."""
        return self.bytes_sent / self.seconds / 1e9 if self.seconds > 0 else 0.0


def tensor_messages(
    named_tensors: Iterable[tuple[str, torch.Tensor]], note: str, update_id: str = "", adapter: str = ""
) -> Iterator[bytes]:
    """An UpdateWeights stream, serialized: the header, then each tensor's bytes in chunks of
    CHUNK_BYTES, each an UpdateWeightsRequest exactly as protobuf would serialize it.

    The chunks are written here rather than by protobuf because protobuf copies a bytes field in and
    out again: building the message around the tensor's memory costs one copy of the weights, which
    is most of a sync's CPU. The header counts the tensors, so an iterable that cannot say its length
    is listed first; a sized one (the megatron backend's, which gathers each layer from its ranks as
    it goes) is streamed as it comes, never held whole.
    """
    tensors = sized(named_tensors)
    header = inference_pb2.WeightsHeader(tensor_count=len(tensors), note=note, update_id=update_id, adapter=adapter)
    yield inference_pb2.UpdateWeightsRequest(header=header).SerializeToString()
    for name, tensor in tensors:
        tensor, wire = wire_form(tensor)
        data = memoryview(byte_view(tensor.cpu()).numpy())  # no copy on the CPU
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
    """gRPC channels to every inference server the trainer keeps in sync.

    `transport`: "auto" takes the fastest transport each server offers that this process can use;
    "stream", "nccl" or "gloo" that one for every server (a server that does not offer it fails the
    sync, naming it). `bucket_bytes`: the size of each of the two buffers the "cuda_ipc" and
    collective transports pack tensors into. `timeout_s`: how long a collective group's joining and
    each of its broadcasts may take before the sync fails (a server that died). `adapter`: the named
    LoRA adapter (a run's, on servers several runs share) whose matrices the pushes replace; "" = the
    servers' own parameters. `device`: the trainer's (where its weights are); when it is a GPU, the
    "cuda_ipc" and "nccl" buffers go there (a server of this machine on another GPU copies them
    across), else on the current CUDA device."""

    def __init__(
        self,
        addresses: Sequence[str],
        transport: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        adapter: str = "",
        device: torch.device | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("the trainer needs at least one inference server address")
        if transport not in TRANSPORTS:
            raise ValueError(f"weight sync transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        if bucket_bytes < PIECE_ALIGN:
            raise ValueError(f"bucket_bytes = {bucket_bytes} must be at least {PIECE_ALIGN}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s = {timeout_s} must be > 0")
        self.addresses = list(addresses)
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.adapter = adapter
        own = credentials.of_process()
        self._channels = [
            credentials.channel(a, credentials.TRAINER, own, options=[("grpc.max_send_message_length", -1)])
            for a in addresses
        ]
        self._stubs = [inference_pb2_grpc.InferenceServiceStub(c) for c in self._channels]
        # "shm": each server's two blocks, kept between syncs: a fresh block costs a page fault on
        # every page at its first write, on both sides (about 6x the copy itself, measured here).
        self._host_buffers: dict[int, sharing.HostBuffers] = {}
        # Servers that could not open the shared buffers (shm or CUDA IPC): that sync was streamed, and
        # later ones take the next transport the server offers.
        self._sharing_refused: set[int] = set()
        # UpdateWeights over messages tensor_messages serialized already (no request serializer).
        self._updates = [
            channel.stream_unary(UPDATE_WEIGHTS, response_deserializer=inference_pb2.UpdateWeightsResponse.FromString)
            for channel in self._channels
        ]
        self._gpu = device if device is not None and device.type == "cuda" else None
        self._collective = CollectiveSender(bucket_bytes, timeout_s, RPC_TIMEOUT_S, adapter, self._gpu)

    def close(self) -> None:
        self._collective.close()
        for blocks in self._host_buffers.values():
            blocks.close()
        self._host_buffers.clear()
        for channel in self._channels:
            channel.close()

    def model_infos(self, timeout_s: float = 60.0, wait_for_ready: bool = True) -> list[inference_pb2.ModelInfo]:
        """Each server's ModelInfo, waiting up to timeout_s for servers still starting (or, without
        wait_for_ready, failing at once for a server that is not there)."""
        infos = []
        for address, stub in zip(self.addresses, self._stubs):
            try:
                response = stub.GetModelInfo(
                    inference_pb2.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready
                )
            except grpc.RpcError as exc:
                raise WeightSyncError(
                    f"inference server {address}: GetModelInfo failed: {exc.code().name}: {exc.details()}"
                ) from None
            infos.append(response.model_info)
        return infos

    def load_adapter(
        self, rank: int, alpha: float, targets: str, policy_version: int = 0, path: str = "", replace: bool = False
    ) -> None:
        """Load this pool's adapter on every server: zero of rank, alpha and targets, or the PEFT
        folder at `path` (which the servers read), served as `policy_version`. All or none: a server
        that refuses it has it unloaded from those that took it."""
        request = inference_pb2.LoadAdapterRequest(
            name=self.adapter,
            path=path,
            rank=rank,
            alpha=alpha,
            targets=targets,
            policy_version=policy_version,
            replace=replace,
        )
        loaded = []
        for address, stub in zip(self.addresses, self._stubs):
            try:
                stub.LoadAdapter(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                self._unload(loaded)
                raise WeightSyncError(
                    f"inference server {address}: loading adapter {self.adapter!r} failed: "
                    f"{exc.code().name}: {exc.details()}"
                ) from None
            loaded.append(stub)

    def unload_adapter(self) -> None:
        """Unload this pool's adapter from every server that holds it (one that does not, or is
        gone, is passed over: a run that ends leaves nothing behind either way)."""
        self._unload(self._stubs)

    def _unload(self, stubs: Sequence[inference_pb2_grpc.InferenceServiceStub]) -> None:
        for stub in stubs:
            try:
                stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=self.adapter), timeout=60)
            except grpc.RpcError:
                pass

    def transports(self) -> list[str]:
        """The transport each server will be sent the weights over. "auto": the first the server
        offers (fastest first) that this process can use: "cuda_ipc" needs CUDA here and the server
        on this machine (and able to open the buffers), "nccl" CUDA here."""
        here = sharing.host_id()
        cuda = torch.cuda.is_available()
        chosen = []
        for address, info in zip(self.addresses, self.model_infos(wait_for_ready=False)):
            offered = list(info.weight_transports) or [sharing.STREAM]
            if self.transport != "auto":
                if self.transport not in offered:
                    raise WeightSyncError(
                        f"inference server {address} does not offer the {self.transport} weight transport "
                        f'(it offers {", ".join(offered)}); set [trainer] weight_sync = "auto" or one of those'
                    )
                chosen.append(self.transport)
                continue
            usable = {sharing.STREAM, collective.GLOO}
            if cuda:
                usable.add(collective.NCCL)
            if here and info.host_id == here and len(chosen) not in self._sharing_refused:
                usable.add(sharing.SHM)
                if cuda:
                    usable.add(sharing.CUDA_IPC)
            chosen.append(next((t for t in offered if t in usable), sharing.STREAM))
        return chosen

    def push(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], note: str) -> SyncResult:
        """Pause every server, stage `weights()` on each, commit on all, resume them all; the new
        common version. `weights()` is called once per server, or once per collective group."""
        started = time.perf_counter()
        update_id = uuid.uuid4().hex
        chosen = self.transports()
        transfers: list[ServerSync] = []
        sent = 0
        with ThreadPoolExecutor(max_workers=len(self._stubs)) as pool:
            try:
                list(pool.map(self._pause, self.addresses, self._stubs))
                for index, (address, transport) in enumerate(zip(self.addresses, chosen)):
                    if transport in collective.BACKENDS:
                        continue
                    began = time.perf_counter()
                    try:
                        response = None
                        if transport in (sharing.SHM, sharing.CUDA_IPC):
                            try:
                                host = transport == sharing.SHM
                                response = self._send_shared(index, weights(), note, update_id, host=host)
                            except (grpc.RpcError, HostBuffersUnavailable) as exc:
                                if isinstance(exc, grpc.RpcError) and exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                                    raise
                                # The same boot id but another /dev/shm (containers of one host), a
                                # server that does not see the trainer's GPU (CUDA_VISIBLE_DEVICES apart),
                                # or no room in shared memory here: the stream.
                                self._sharing_refused.add(index)
                                transport = sharing.STREAM
                        if response is None:
                            response = self._updates[index](
                                tensor_messages(weights(), note, update_id, self.adapter), timeout=RPC_TIMEOUT_S
                            )
                    except grpc.RpcError as exc:
                        raise WeightSyncError(
                            f"inference server {address} failed while receiving the weights ({transport}): "
                            f"{exc.code().name}: {exc.details()}; no server was switched to them"
                        ) from None
                    sent = response.bytes_received
                    transfers.append(ServerSync(address, transport, time.perf_counter() - began, sent))
                for backend in collective.BACKENDS:
                    members = [i for i, t in enumerate(chosen) if t == backend]
                    if not members:
                        continue
                    began = time.perf_counter()
                    try:
                        group = self._collective.send(
                            backend, [(self.addresses[i], self._stubs[i]) for i in members], weights(), note, update_id
                        )
                    except GroupFailed as exc:
                        raise WeightSyncError(f"{exc}; no server was switched to them") from None
                    seconds = time.perf_counter() - began
                    for i, response in zip(members, group.results):
                        sent = response.bytes_received
                        transfers.append(
                            ServerSync(self.addresses[i], backend, seconds, sent, "new" if group.new_group else "kept")
                        )
                responses = list(pool.map(self._commit, self.addresses, self._stubs, [update_id] * len(self._stubs)))
            finally:
                list(pool.map(self._resume, self.addresses, self._stubs))
        versions = {r.policy_version for r in responses}
        if len(versions) != 1:
            listed = ", ".join(f"{a}: {r.policy_version}" for a, r in zip(self.addresses, responses))
            raise WeightSyncError(f"inference servers disagree on the policy version after the update ({listed})")
        return SyncResult(versions.pop(), sent, time.perf_counter() - started, tuple(transfers))

    def _send_shared(
        self, index: int, weights: Iterable[tuple[str, torch.Tensor]], note: str, update_id: str, *, host: bool = False
    ) -> inference_pb2.UpdateWeightsResponse:
        """UpdateWeightsShared through two buffers, on this process's GPU (CUDA IPC) or, with `host`,
        in shared memory: the server's answer for each bucket frees its buffer for the next one."""
        tensors = sized(weights)
        free: queue.Queue = queue.Queue()
        header = inference_pb2.SharedWeightsHeader(
            tensor_count=len(tensors), note=note, update_id=update_id, adapter=self.adapter
        )
        if host:
            blocks = self._host_buffers.get(index)
            if blocks is None:
                try:
                    blocks = self._host_buffers[index] = sharing.HostBuffers(2, self.bucket_bytes)
                except OSError as exc:
                    raise HostBuffersUnavailable(
                        f"no room for two {self.bucket_bytes >> 20} MiB blocks in shared memory: {exc}"
                    ) from None
            buffers, device = blocks.tensors, None
            header.host_buffers.extend(blocks.described)
        else:
            blocks, device = None, self._gpu or torch.device("cuda", torch.cuda.current_device())
            buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            header.buffers.extend(sharing.share(b) for b in buffers)
        for buffer_index in range(len(buffers)):
            free.put(buffer_index)

        failed: list[BaseException] = []

        def requests() -> Iterator[inference_pb2.UpdateWeightsSharedRequest]:
            yield inference_pb2.UpdateWeightsSharedRequest(header=header)
            try:
                # gRPC reads this iterator on a thread of its own: the CUDA device is set there.
                with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                    yield from bucket_messages(tensors, buffers, free)
            except Exception as exc:  # gRPC would only cancel the call: the cause is raised below
                failed.append(exc)
                raise

        stub = self._stubs[index]
        result = None
        try:
            for response in stub.UpdateWeightsShared(requests(), timeout=RPC_TIMEOUT_S):
                if response.WhichOneof("payload") == "result":
                    result = response.result
                else:
                    free.put(response.buffer_released)
        except BaseException as exc:
            if blocks is not None:  # a failed sync's blocks are not used again
                self._host_buffers.pop(index, None)
                blocks.close()
            if isinstance(exc, grpc.RpcError) and failed:
                raise failed[0] from None
            raise
        finally:
            free.put(None)  # a stream that ended early must not leave the iterator waiting
        if result is None:
            raise WeightSyncError(f"inference server {self.addresses[index]} ended the shared update without a result")
        return result

    @staticmethod
    def _pause(address: str, stub) -> None:
        try:
            stub.Pause(inference_pb2.PauseRequest(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise WeightSyncError(
                f"inference server {address}: Pause failed: {exc.code().name}: {exc.details()}"
            ) from None

    @staticmethod
    def _commit(address: str, stub, update_id: str) -> inference_pb2.UpdateWeightsResponse:
        try:
            return stub.CommitWeights(
                inference_pb2.CommitWeightsRequest(update_id=update_id), timeout=RPC_TIMEOUT_S
            ).result
        except grpc.RpcError as exc:
            raise WeightSyncError(
                f"inference server {address}: CommitWeights failed: {exc.code().name}: {exc.details()}"
            ) from None

    @staticmethod
    def _resume(address: str, stub) -> None:
        try:
            stub.Resume(inference_pb2.ResumeRequest(), timeout=60)
        except grpc.RpcError:
            pass  # a server that cannot be resumed is also one that is gone; the push reports it
