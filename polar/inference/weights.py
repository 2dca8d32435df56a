"""Assemble the messages of an UpdateWeights stream into named tensors.

A stream is a header (how many tensors follow) and then chunks; one tensor may be split across
several chunks, in any order, which must cover its byte buffer exactly and without overlap. Every
chunk is checked as it arrives against the engine's parameter specs, so a bad stream fails at its
first bad chunk rather than after the whole model has been received. Tensors are built only by
`finish()`, once every announced tensor is complete: a stream cut off half-way yields nothing.

Errors are WeightUpdateError (the servicer answers INVALID_ARGUMENT), naming the tensor and field.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from polar.inference.engines.base import ParameterSpec, WeightUpdateError
from polar.v1 import inference_pb2

# Wire dtype names (little-endian) -> torch dtypes. Tensors are converted to the parameter's dtype.
WIRE_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class _PartialTensor:
    """One tensor being received: its buffer and the byte ranges already written."""

    dtype: str
    shape: tuple[int, ...]
    buffer: bytearray
    starts: list[int] = field(default_factory=list)  # sorted starts of the received ranges
    ends: list[int] = field(default_factory=list)  # ends matching `starts`, position for position
    received: int = 0  # bytes written so far

    @property
    def complete(self) -> bool:
        return self.received == len(self.buffer)


class WeightsAssembler:
    """Feed it every message of one UpdateWeights stream with `add`, then call `finish`."""

    def __init__(self, specs: Mapping[str, ParameterSpec]) -> None:
        self._specs = specs
        self._tensors: dict[str, _PartialTensor] = {}
        self.tensor_count = 0  # announced by the header; 0 until the header arrived
        self.note = ""
        self.bytes_received = 0

    def add(self, message: inference_pb2.UpdateWeightsRequest) -> None:
        """Check one message and copy its bytes; raise WeightUpdateError at the first problem."""
        kind = message.WhichOneof("payload")
        if kind == "header":
            self._add_header(message.header)
        elif kind == "chunk":
            self._add_chunk(message.chunk)
        else:
            raise WeightUpdateError("a message of the stream carries neither a header nor a chunk")

    def finish(self) -> dict[str, torch.Tensor]:
        """The stream ended normally: return every tensor, in the parameter's dtype."""
        if not self.tensor_count:
            raise WeightUpdateError("the stream ended without a header")
        incomplete = [
            f"{name!r} ({tensor.received} of {len(tensor.buffer)} bytes)"
            for name, tensor in self._tensors.items()
            if not tensor.complete
        ]
        if incomplete or len(self._tensors) < self.tensor_count:
            raise WeightUpdateError(
                f"the stream ended before every tensor was complete: header announced "
                f"tensor_count = {self.tensor_count}, {len(self._tensors)} arrived"
                + (f"; incomplete: {', '.join(incomplete)}" if incomplete else "")
            )
        return {name: self._build(name, tensor) for name, tensor in self._tensors.items()}

    def _add_header(self, header: inference_pb2.WeightsHeader) -> None:
        if self.tensor_count:
            raise WeightUpdateError("a second header arrived; only the first message may be a header")
        if header.tensor_count <= 0:
            raise WeightUpdateError(f"header.tensor_count = {header.tensor_count} must be > 0")
        self.tensor_count = header.tensor_count
        self.note = header.note

    def _add_chunk(self, chunk: inference_pb2.TensorChunk) -> None:
        if not self.tensor_count:
            raise WeightUpdateError(f"chunk of {chunk.name!r} arrived before the header")
        tensor = self._tensors.get(chunk.name) or self._open(chunk)
        shape = tuple(chunk.shape)
        if chunk.dtype != tensor.dtype:
            raise WeightUpdateError(
                f"tensor {chunk.name!r}: chunk dtype {chunk.dtype!r} differs from its first chunk's {tensor.dtype!r}"
            )
        if shape != tensor.shape:
            raise WeightUpdateError(
                f"tensor {chunk.name!r}: chunk shape {list(shape)} differs from its first chunk's {list(tensor.shape)}"
            )
        self._write(chunk.name, tensor, chunk.offset, chunk.data)

    def _open(self, chunk: inference_pb2.TensorChunk) -> _PartialTensor:
        """First chunk of a tensor: check name, dtype and shape against the parameter."""
        spec = self._specs.get(chunk.name)
        if spec is None:
            raise WeightUpdateError(f"unknown parameter name {chunk.name!r}")
        if chunk.dtype not in WIRE_DTYPES:
            raise WeightUpdateError(
                f"tensor {chunk.name!r}: dtype {chunk.dtype!r} is not one of {', '.join(WIRE_DTYPES)}"
            )
        shape = tuple(chunk.shape)
        if shape != tuple(spec.shape):
            raise WeightUpdateError(
                f"tensor {chunk.name!r}: shape {list(shape)} does not match the parameter's {list(spec.shape)}"
            )
        if len(self._tensors) == self.tensor_count:
            raise WeightUpdateError(
                f"tensor {chunk.name!r} is one more than the header's tensor_count = {self.tensor_count}"
            )
        itemsize = WIRE_DTYPES[chunk.dtype].itemsize
        tensor = _PartialTensor(chunk.dtype, shape, bytearray(itemsize * math.prod(shape)))
        self._tensors[chunk.name] = tensor
        return tensor

    def _write(self, name: str, tensor: _PartialTensor, offset: int, data: bytes) -> None:
        start, end, size = offset, offset + len(data), len(tensor.buffer)
        if not data and size:
            raise WeightUpdateError(f"tensor {name!r}: chunk at offset {offset} carries no data")
        if start < 0 or end > size:
            raise WeightUpdateError(
                f"tensor {name!r}: chunk bytes [{start}, {end}) fall outside its buffer of {size} bytes"
            )
        # Ranges are disjoint and sorted, so only the neighbours of the insertion point can overlap.
        at = bisect.bisect_right(tensor.starts, start)
        if (at > 0 and tensor.ends[at - 1] > start) or (at < len(tensor.starts) and tensor.starts[at] < end):
            raise WeightUpdateError(
                f"tensor {name!r}: chunk bytes [{start}, {end}) overlap bytes already received"
            )
        tensor.starts.insert(at, start)
        tensor.ends.insert(at, end)
        tensor.buffer[start:end] = data
        tensor.received += len(data)
        self.bytes_received += len(data)

    def _build(self, name: str, tensor: _PartialTensor) -> torch.Tensor:
        wire = WIRE_DTYPES[tensor.dtype]
        if tensor.buffer:
            values = torch.frombuffer(tensor.buffer, dtype=wire)
        else:
            values = torch.empty(0, dtype=wire)
        return values.reshape(tensor.shape).to(self._specs[name].dtype)

