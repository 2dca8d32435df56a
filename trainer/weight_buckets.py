"""Tensors packed into flat byte buffers, a bucket at a time: how the CUDA IPC and the collective
transports carry weights (trainer/weight_sync.py, trainer/weight_collective.py).

A bucket is one buffer's worth of pieces of tensors, each piece a byte range of one tensor at an
aligned offset of the buffer; a tensor larger than the room left is split over several buckets. The
receiver (polar/inference/weights.py) checks that each tensor's pieces cover it exactly.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator, Sequence, Sized

import torch

from polar.inference.weights import byte_view
from polar.v1 import inference_pb2

WIRE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
PIECE_ALIGN = 256  # bytes: each piece starts aligned in its bucket


def sized(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """The tensors as a collection that knows its length (an update's header counts them)."""
    return named_tensors if isinstance(named_tensors, Sized) else list(named_tensors)


def wire_form(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The tensor as it travels (contiguous; a dtype without a wire name as float32), and that name."""
    wire = WIRE_DTYPES.get(tensor.dtype)
    if wire is None:
        tensor, wire = tensor.float(), "float32"
    return tensor.detach().contiguous(), wire


def bucket_messages(
    named_tensors: Iterable[tuple[str, torch.Tensor]], buffers: Sequence[torch.Tensor], free: queue.Queue
) -> Iterator[inference_pb2.UpdateWeightsSharedRequest]:
    """The buckets of an update: the tensors copied into `buffers` (flat uint8, all of one size, on
    the GPU or in host memory), a tensor larger than the room left split into pieces. Before filling a buffer it
    takes its index from `free` (None there ends the stream); each bucket is yielded once the copies
    into it are done."""
    index = free.get()
    if index is None:
        return
    size = buffers[0].numel()
    offset, pieces = 0, []
    for name, tensor in named_tensors:
        tensor, wire = wire_form(tensor)
        flat = byte_view(tensor)
        done, total, shape = 0, flat.numel(), list(tensor.shape)
        while True:
            if offset >= size:
                _copied(buffers[index])
                yield _bucket(index, pieces)
                index = free.get()
                if index is None:
                    return
                offset, pieces = 0, []
            length = min(size - offset, total - done)
            buffers[index][offset : offset + length].copy_(flat[done : done + length], non_blocking=True)
            pieces.append(
                inference_pb2.SharedTensor(
                    name=name, dtype=wire, shape=shape, offset=offset, tensor_offset=done, size_bytes=length
                )
            )
            offset = min(size, -(-(offset + length) // PIECE_ALIGN) * PIECE_ALIGN)
            done += length
            if done == total:
                break
    if pieces:
        _copied(buffers[index])
        yield _bucket(index, pieces)


def _copied(buffer: torch.Tensor) -> None:
    """Wait for the copies into `buffer`: the server reads it as soon as it hears of the bucket."""
    if buffer.device.type == "cuda":
        torch.cuda.current_stream(buffer.device).synchronize()


def _bucket(index: int, pieces: list) -> inference_pb2.UpdateWeightsSharedRequest:
    return inference_pb2.UpdateWeightsSharedRequest(bucket=inference_pb2.SharedBucket(buffer=index, tensors=pieces))
