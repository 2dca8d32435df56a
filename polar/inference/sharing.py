"""Weights through memory the trainer shares with an inference server on its machine: GPU memory
(CUDA IPC, "cuda_ipc") for a server on a GPU, POSIX shared memory ("shm") for one on a CPU.

The trainer's side: `share`, a flat CUDA buffer described as a CudaIpcBuffer (the fields torch's
own multiprocessing shares a CUDA storage with: the allocation's IPC handle, the storage's offset
in it, and torch's reference counter, which keeps the allocation alive while the server holds it);
or `HostBuffers`, blocks of shared memory the trainer keeps between updates.
The server's side, `open_header` and `copy_bucket`: open the buffers once per update (host blocks
stay mapped between updates, `HostMaps`), then copy
each bucket's tensors out of them into the staged tensors on the server's device (one copy per
byte), and wait for those copies before telling the trainer the buffer is free again.

Over loopback the gRPC stream moves a CPU server's weights at about 0.3 to 1.3 GB/s on two cores,
most of it spent in the messages' bytes passing through the kernel and gRPC; through shared memory
each byte is written once by the trainer and read once by the server.

The torch engine offers the one for its device (`transports`); the trainer uses it only when the
server's `host_id` is its own machine's.

A server opens a CUDA buffer on the trainer's GPU, by its index in the trainer's process (as torch's
multiprocessing does: both must number the GPUs alike, as under `polar train`), and copies it to its
engine's GPU, peer to peer when that is another. One that cannot open it (it does not see that GPU)
answers FAILED_PRECONDITION, and the trainer streams that update instead.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import secrets
from multiprocessing import resource_tracker
from pathlib import Path

import torch

from polar.inference.engines.base import WeightUpdateError
from polar.inference.weights import Header, WeightsReceiver, unpack_bucket
from polar.v1 import inference_pb2

CUDA_IPC = "cuda_ipc"
SHM = "shm"
STREAM = "stream"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_SHM_FOLDER = Path("/dev/shm")  # where Linux keeps POSIX shared memory, by name


class SharingUnavailable(RuntimeError):
    """This server cannot open the trainer's shared buffers (FAILED_PRECONDITION); the message says why."""


@functools.cache
def host_id() -> str:
    """This machine's boot id: the same in every process of one machine, empty where unknown."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def transports(device: str) -> list[str]:
    """The weight transports a server whose engine runs on `device` offers, fastest first."""
    if not host_id():
        return [STREAM]
    if device.startswith("cuda"):
        return [CUDA_IPC, STREAM]
    return [SHM, STREAM] if _SHM_FOLDER.is_dir() else [STREAM]


def require_cuda(device: str) -> torch.device:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise SharingUnavailable(f"this server's engine runs on {device or 'no device'}: it cannot open CUDA buffers")
    return torch.device(device)


# ----------------------------------------------------------------------------- the trainer's side


def share(buffer: torch.Tensor) -> inference_pb2.CudaIpcBuffer:
    """Describe a CUDA tensor's storage for another process of this machine to open."""
    (device, handle, size, offset, counter, counter_offset, event, event_sync) = buffer.untyped_storage()._share_cuda_()
    return inference_pb2.CudaIpcBuffer(
        device=device,
        handle=handle,
        size_bytes=size,
        offset_bytes=offset,
        ref_counter_handle=counter,
        ref_counter_offset=counter_offset,
        event_handle=event or b"",
        event_sync_required=event_sync,
    )


class HostBuffers:
    """`count` blocks of shared memory of `size` bytes each, as flat uint8 tensors (`tensors`) and as
    the header describes them (`described`); `close` unlinks them.

    A block is never unmapped by hand: a view of it may still be in a thread's hands (gRPC's request
    thread, when a sync fails mid-copy), and a write to an unmapped page kills the process. Each
    view holds a reference to its mapping (torch.frombuffer), which goes with the last view."""

    def __init__(self, count: int, size: int) -> None:
        self._names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        try:
            for _ in range(count):
                name = f"polar-{secrets.token_hex(8)}"
                descriptor = os.open(_SHM_FOLDER / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self._names.append(name)
                # The resource tracker unlinks the block if this process dies without doing so.
                resource_tracker.register(f"/{name}", "shared_memory")
                try:
                    # Reserve the pages now: /dev/shm may hold less than the block's size (64 MB in a
                    # default container), and a write past what it holds kills the process (SIGBUS).
                    os.posix_fallocate(descriptor, 0, size)
                    mapped = mmap.mmap(descriptor, size)
                finally:
                    os.close(descriptor)
                self.tensors.append(torch.frombuffer(mapped, dtype=torch.uint8, count=size))
        except OSError:
            self.close()
            raise
        self.described = [inference_pb2.HostSharedBuffer(name=name, size_bytes=size) for name in self._names]

    def close(self) -> None:
        self.tensors = []
        for name in self._names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_SHM_FOLDER / name)
            resource_tracker.unregister(f"/{name}", "shared_memory")
        self._names = []


# ----------------------------------------------------------------------------- the server's side


def open_buffer(described: inference_pb2.CudaIpcBuffer) -> torch.Tensor:
    """The trainer's buffer as a flat uint8 tensor of this process, on the GPU that holds it (the
    trainer's, whichever GPU this server's engine runs on)."""
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            described.device,
            described.handle,
            described.size_bytes,
            described.offset_bytes,
            described.ref_counter_handle,
            described.ref_counter_offset,
            described.event_handle or None,
            described.event_sync_required,
        )
    except RuntimeError as exc:
        raise SharingUnavailable(f"cannot open the trainer's CUDA buffer (is it on this machine?): {exc}") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{described.device}").set_(storage)


def open_host_buffer(described: inference_pb2.HostSharedBuffer) -> tuple[mmap.mmap, torch.Tensor]:
    """The trainer's block of shared memory, mapped, and its first size_bytes as a flat uint8 tensor.
    Mapped straight from /dev/shm rather than through multiprocessing.shared_memory, whose resource
    tracker (Python < 3.13) would take the trainer's block as this process's own and unlink it."""
    name = described.name
    if not name or "/" in name or name in (".", ".."):
        raise WeightUpdateError(f"shared memory name {name!r} is not a block's name")
    try:
        descriptor = os.open(_SHM_FOLDER / name, os.O_RDWR)
    except OSError as exc:
        raise SharingUnavailable(
            f"cannot open the trainer's shared memory {name!r} (is it on this machine?): {exc.strerror}"
        ) from None
    try:
        size = os.fstat(descriptor).st_size
        if not 0 < described.size_bytes <= size:
            raise WeightUpdateError(f"shared memory {name!r} holds {size} bytes, not {described.size_bytes}")
        mapped = mmap.mmap(descriptor, size)
    finally:
        os.close(descriptor)
    return mapped, torch.frombuffer(mapped, dtype=torch.uint8, count=described.size_bytes)


class HostMaps:
    """A server's mappings of the trainer's blocks, kept between updates (the trainer keeps its
    blocks too): mapping a block again would fault in every page again. Blocks the latest update no
    longer names are let go."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def open(self, described: list[inference_pb2.HostSharedBuffer]) -> list[torch.Tensor]:
        wanted = {d.name for d in described}
        for name in [n for n in self._maps if n not in wanted]:
            self._unmap(name)
        tensors = []
        for block in described:
            held = self._maps.get(block.name)
            if held is None or held[1].numel() < block.size_bytes:
                if held is not None:
                    self._unmap(block.name)
                held = self._maps[block.name] = open_host_buffer(block)
            tensors.append(held[1][: block.size_bytes])
        return tensors

    def close(self) -> None:
        for name in list(self._maps):
            self._unmap(name)

    def _unmap(self, name: str) -> None:
        # Not closed by hand: the mapping goes with the last view of it (see HostBuffers).
        del self._maps[name]


def open_header(
    message: inference_pb2.UpdateWeightsSharedRequest,
    receiver: WeightsReceiver,
    device: torch.device,
    host_maps: HostMaps,
) -> list[torch.Tensor]:
    """The first message of an UpdateWeightsShared stream: its header to `receiver`, its buffers
    opened as flat uint8 tensors (CUDA ones for an engine on a GPU, host ones, through `host_maps`,
    for one on a CPU)."""
    if message.WhichOneof("payload") != "header":
        raise WeightUpdateError("the first message of the stream must be a header")
    header = message.header
    if not header.buffers and not header.host_buffers:
        raise WeightUpdateError("the header shares no buffer")
    if header.buffers and header.host_buffers:
        raise WeightUpdateError("the header shares both GPU and host buffers; one kind per update")
    if header.host_buffers and device.type != "cpu":
        raise SharingUnavailable(f"this server's engine runs on {device}: it takes GPU buffers, not shared host memory")
    if header.buffers:
        require_cuda(str(device))
    receiver.header(Header(header.tensor_count, header.note, header.update_id, header.adapter))
    if header.host_buffers:
        return host_maps.open(list(header.host_buffers))
    with torch.cuda.device(device):
        return [open_buffer(b) for b in header.buffers]


def copy_bucket(
    message: inference_pb2.UpdateWeightsSharedRequest, receiver: WeightsReceiver, buffers: list[torch.Tensor]
) -> int:
    """Copy one bucket's tensors out of its buffer into the staged tensors; return the buffer's
    index once the copies are done (the trainer may then write it again)."""
    if message.WhichOneof("payload") != "bucket":
        raise WeightUpdateError("only the first message of the stream may be a header; every later one is a bucket")
    bucket = message.bucket
    if not 0 <= bucket.buffer < len(buffers):
        raise WeightUpdateError(f"bucket names buffer {bucket.buffer}; the header shared {len(buffers)}")
    buffer = buffers[bucket.buffer]
    unpack_bucket(bucket, receiver, buffer)
    if buffer.is_cuda:
        # torch runs a copy between two GPUs on the source's stream: this waits for the copies
        # whichever GPU the staged tensors are on.
        torch.cuda.current_stream(buffer.device).synchronize()
    return bucket.buffer
