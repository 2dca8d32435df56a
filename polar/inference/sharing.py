"""Weights through GPU memory the trainer shares with an inference server on its machine (CUDA IPC).

The trainer's side, `share`: a flat CUDA buffer described as a CudaIpcBuffer (the fields torch's
own multiprocessing shares a CUDA storage with: the allocation's IPC handle, the storage's offset
in it, and torch's reference counter, which keeps the allocation alive while the server holds it).
The server's side, `open_header` and `copy_bucket`: open the buffers once per update, then copy
each bucket's tensors out of them into the staged tensors on the server's device (one device copy
per byte), and wait for those copies before telling the trainer the buffer is free again.

Only the torch engine on a CUDA device offers it (`transports`); the trainer uses it only when the
server's `host_id` is its own machine's.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from polar.inference.engines.base import WeightUpdateError
from polar.inference.weights import Header, WeightsReceiver, unpack_bucket
from polar.v1 import inference_pb2

CUDA_IPC = "cuda_ipc"
STREAM = "stream"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class SharingUnavailable(RuntimeError):
    """This server cannot open the trainer's GPU buffers (FAILED_PRECONDITION); the message says why."""


@functools.cache
def host_id() -> str:
    """This machine's boot id: the same in every process of one machine, empty where unknown."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def transports(device: str) -> list[str]:
    """The weight transports a server whose engine runs on `device` offers, fastest first."""
    return [CUDA_IPC, STREAM] if device.startswith("cuda") and host_id() else [STREAM]


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


# ----------------------------------------------------------------------------- the server's side


def open_buffer(described: inference_pb2.CudaIpcBuffer) -> torch.Tensor:
    """The trainer's buffer as a flat uint8 tensor of this process."""
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


def open_header(message: inference_pb2.UpdateWeightsSharedRequest, receiver: WeightsReceiver, device: torch.device) -> list[torch.Tensor]:
    """The first message of an UpdateWeightsShared stream: its header to `receiver`, its buffers opened."""
    if message.WhichOneof("payload") != "header":
        raise WeightUpdateError("the first message of the stream must be a header")
    header = message.header
    if not header.buffers:
        raise WeightUpdateError("the header shares no buffer")
    receiver.header(Header(header.tensor_count, header.note, header.update_id))
    with torch.cuda.device(device):
        return [open_buffer(b) for b in header.buffers]


def copy_bucket(message: inference_pb2.UpdateWeightsSharedRequest, receiver: WeightsReceiver, buffers: list[torch.Tensor]) -> int:
    """Copy one bucket's tensors out of its buffer into the staged tensors; return the buffer's
    index once the copies are done (the trainer may then write it again)."""
    if message.WhichOneof("payload") != "bucket":
        raise WeightUpdateError("only the first message of the stream may be a header; every later one is a bucket")
    bucket = message.bucket
    if not 0 <= bucket.buffer < len(buffers):
        raise WeightUpdateError(f"bucket names buffer {bucket.buffer}; the header shared {len(buffers)}")
    buffer = buffers[bucket.buffer]
    unpack_bucket(bucket, receiver, buffer)
    torch.cuda.current_stream(buffer.device).synchronize()
    return bucket.buffer
