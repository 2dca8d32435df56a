"""Receive a weight update into staged tensors, each byte copied once.

An update is a header (how many tensors follow) and then pieces of named tensors: byte ranges that
may come in any order and must cover each tensor's buffer exactly, without overlap. Two transports
carry pieces: the UpdateWeights stream (a chunk's bytes, read from the serialized message without
parsing it into a protobuf object, which would copy them) and the UpdateWeightsShared stream (a
slice of a GPU buffer the trainer shares). Either way a piece is copied once, into the staged
tensor of its parameter (`Staging`, kept from one update to the next), or, when it travels in
another dtype than the parameter's, into a buffer of the wire dtype that `finish()` converts.

Every piece is checked as it arrives against the engine's parameter specs, so a bad update fails
at its first bad piece. Nothing is applied here: `finish()` hands the staged tensors over once every
announced tensor is complete, and the engine applies them (polar/inference/server.py).

Errors are WeightUpdateError (the servicer answers INVALID_ARGUMENT), naming the tensor and field.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from google.protobuf.message import DecodeError

from polar.inference.engines.base import ParameterSpec, WeightUpdateError, unknown_parameter
from polar.v1 import inference_pb2

# Wire dtype names (little-endian) -> torch dtypes. Tensors are converted to the parameter's dtype.
WIRE_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


# ----------------------------------------------------------------------------- the wire format


@dataclass(frozen=True)
class Header:
    tensor_count: int
    note: str = ""
    update_id: str = ""
    adapter: str = ""  # the named LoRA adapter whose matrices the update replaces; "" = the engine's own


@dataclass(frozen=True)
class Chunk:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    data: memoryview  # a slice of the received message: not copied


def parse_update_request(raw: bytes) -> Header | Chunk:
    """One serialized UpdateWeightsRequest, read as protobuf would read it, except that a chunk's
    data stays a slice of `raw`. A message that sets its oneof more than once (no encoder does,
    but protobuf merges them) is handed to protobuf whole."""
    view = memoryview(raw)
    fields = _fields(view)
    payload = [(number, start, end) for number, _, start, end in fields if number in (1, 2)]
    if not payload:
        raise WeightUpdateError("a message of the stream carries neither a header nor a chunk")
    if len(payload) > 1:
        return _parsed_whole(raw)
    number, start, end = payload[0]
    if number == 1:
        header = _parse(inference_pb2.WeightsHeader, view[start:end])
        return Header(header.tensor_count, header.note, header.update_id, header.adapter)
    # A chunk: every field but data (5) goes to protobuf, which keeps its rules for the rest
    # (repeated shape packed or not, a field given twice); data is the last one given, sliced.
    rest, data = [], view[0:0]
    for number, whole_start, field_start, field_end in _fields(view[start:end], base=start):
        if number == 5:
            data = view[field_start:field_end]
        else:
            rest.append(view[whole_start:field_end])
    chunk = _parse(inference_pb2.TensorChunk, b"".join(rest))
    return Chunk(chunk.name, chunk.dtype, tuple(chunk.shape), chunk.offset, data)


def _parsed_whole(raw: bytes) -> Header | Chunk:
    message = _parse(inference_pb2.UpdateWeightsRequest, raw)
    if message.WhichOneof("payload") == "header":
        h = message.header
        return Header(h.tensor_count, h.note, h.update_id, h.adapter)
    c = message.chunk
    return Chunk(c.name, c.dtype, tuple(c.shape), c.offset, memoryview(c.data))


def _parse(message_class, data):
    try:
        return message_class.FromString(bytes(data))
    except DecodeError as exc:
        raise WeightUpdateError(f"a message of the stream is not a valid {message_class.__name__}: {exc}") from None


def _fields(view: memoryview, base: int = 0) -> list[tuple[int, int, int, int]]:
    """(field number, start of its tag, start of its value, end) of every field, positions in the
    buffer `view` was sliced from at `base`. Values of length-delimited fields are their bytes."""
    fields, at, size = [], 0, len(view)
    while at < size:
        tag_start = at
        tag, at = _varint(view, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, end = _varint(view, at)
        elif wire == 1:
            end = at + 8
        elif wire == 2:
            length, at = _varint(view, at)
            end = at + length
        elif wire == 5:
            end = at + 4
        else:
            raise WeightUpdateError(
                f"a message of the stream has a field of wire type {wire}, which protobuf 3 never writes"
            )
        if number == 0 or end > size:
            raise WeightUpdateError("a message of the stream is not valid protobuf (truncated or a field number of 0)")
        fields.append((number, base + tag_start, base + at, base + end))
        at = end
    return fields


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(view) or shift > 63:
            raise WeightUpdateError("a message of the stream is not valid protobuf (a varint runs past its end)")
        byte = view[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


# ----------------------------------------------------------------------------- staging


class Staging:
    """The tensors updates are written into before they are applied, one per parameter, allocated
    on first use and kept: an engine that takes a staged tensor as its parameter gives the one it
    replaced back (`put_back`), so updates alternate between two buffers and allocate nothing."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, spec: ParameterSpec) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            self._tensors[name] = tensor
        return tensor

    def put_back(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """After an update was applied: `tensors` (what the engine left in the update's dict) are
        the buffers of the next one."""
        for name, tensor in tensors.items():
            if tensor.device == self.device:
                self._tensors[name] = tensor


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class _Incoming:
    """One tensor being received: where its bytes go and the byte ranges already written."""

    dtype: str
    shape: tuple[int, ...]
    target: torch.Tensor  # the staged tensor (parameter dtype)
    landing: torch.Tensor  # flat uint8: the target's bytes, or a wire-dtype buffer to convert
    starts: list[int] = field(default_factory=list)  # sorted starts of the received ranges
    ends: list[int] = field(default_factory=list)  # ends matching `starts`, position for position
    received: int = 0  # bytes written so far

    @property
    def size(self) -> int:
        return self.landing.numel()

    @property
    def complete(self) -> bool:
        return self.received == self.size


class WeightsReceiver:
    """Feed it one update: `header`, then `chunk` (stream bytes) or `piece` (a GPU slice) for
    every piece; then call `finish`."""

    def __init__(
        self,
        specs: Mapping[str, ParameterSpec] | Callable[[str], Mapping[str, ParameterSpec]],
        staging: Staging | Callable[[str], Staging],
    ) -> None:
        """`specs`: what the update may replace, and `staging`: where it is written; or functions of
        the header's adapter giving them (raising for an adapter the engine does not hold)."""
        self._specs = specs
        self.staging = staging
        self._tensors: dict[str, _Incoming] = {}
        self.tensor_count = 0  # announced by the header; 0 until the header arrived
        self.note = ""
        self.update_id = ""
        self.adapter = ""
        self.bytes_received = 0

    def add(self, raw: bytes) -> None:
        """One serialized UpdateWeightsRequest."""
        message = parse_update_request(raw)
        if isinstance(message, Header):
            self.header(message)
        else:
            self.chunk(message)

    def header(self, header: Header) -> None:
        if self.tensor_count:
            raise WeightUpdateError("a second header arrived; only the first message may be a header")
        if header.tensor_count <= 0:
            raise WeightUpdateError(f"header.tensor_count = {header.tensor_count} must be > 0")
        if callable(self._specs):
            self._specs = self._specs(header.adapter)
        if callable(self.staging):
            self.staging = self.staging(header.adapter)
        self.tensor_count = header.tensor_count
        self.note = header.note
        self.update_id = header.update_id
        self.adapter = header.adapter

    def chunk(self, chunk: Chunk) -> None:
        """A chunk of the stream: its bytes, from the received message, into the staged tensor."""
        incoming = self._incoming(chunk.name, chunk.dtype, chunk.shape)
        start, end = self._claim(chunk.name, incoming, chunk.offset, len(chunk.data))
        if start == end:
            return
        landing = incoming.landing
        if landing.device.type == "cpu":
            landing.numpy()[start:end] = np.frombuffer(chunk.data, dtype=np.uint8)
        else:
            landing[start:end].copy_(torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8))

    def piece(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, source: torch.Tensor) -> None:
        """Bytes [offset, offset + len(source)) of tensor `name`, from `source` (flat uint8, on any
        device), copied into the staged tensor; the copy may still run on the device's stream."""
        incoming = self._incoming(name, dtype, shape)
        start, end = self._claim(name, incoming, offset, source.numel())
        if start < end:
            incoming.landing[start:end].copy_(source, non_blocking=True)

    def finish(self) -> dict[str, torch.Tensor]:
        """The update ended normally: every tensor, staged in its parameter's dtype."""
        if not self.tensor_count:
            raise WeightUpdateError("the stream ended without a header")
        incomplete = [
            f"{name!r} ({tensor.received} of {tensor.size} bytes)"
            for name, tensor in self._tensors.items()
            if not tensor.complete
        ]
        if incomplete or len(self._tensors) < self.tensor_count:
            raise WeightUpdateError(
                f"the stream ended before every tensor was complete: header announced "
                f"tensor_count = {self.tensor_count}, {len(self._tensors)} arrived"
                + (f"; incomplete: {', '.join(incomplete)}" if incomplete else "")
            )
        staged = {}
        for name, tensor in self._tensors.items():
            if tensor.landing.data_ptr() != tensor.target.data_ptr() or tensor.landing.device != tensor.target.device:
                wire = WIRE_DTYPES[tensor.dtype]
                tensor.target.copy_(tensor.landing.view(wire).reshape(tensor.shape))
            staged[name] = tensor.target
        return staged

    def _incoming(self, name: str, dtype: str, shape: tuple[int, ...]) -> _Incoming:
        if not self.tensor_count:
            raise WeightUpdateError(f"chunk of {name!r} arrived before the header")
        incoming = self._tensors.get(name) or self._open(name, dtype, shape)
        if dtype != incoming.dtype:
            raise WeightUpdateError(
                f"tensor {name!r}: chunk dtype {dtype!r} differs from its first chunk's {incoming.dtype!r}"
            )
        if shape != incoming.shape:
            raise WeightUpdateError(
                f"tensor {name!r}: chunk shape {list(shape)} differs from its first chunk's {list(incoming.shape)}"
            )
        return incoming

    def _open(self, name: str, dtype: str, shape: tuple[int, ...]) -> _Incoming:
        """First piece of a tensor: check name, dtype and shape against the parameter."""
        spec = self._specs.get(name)
        if spec is None:
            raise WeightUpdateError(unknown_parameter(name, self._specs))
        if dtype not in WIRE_DTYPES:
            raise WeightUpdateError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        if shape != tuple(spec.shape):
            raise WeightUpdateError(
                f"tensor {name!r}: shape {list(shape)} does not match the parameter's {list(spec.shape)}"
            )
        if len(self._tensors) == self.tensor_count:
            raise WeightUpdateError(f"tensor {name!r} is one more than the header's tensor_count = {self.tensor_count}")
        target = self.staging.tensor(name, spec)
        wire = WIRE_DTYPES[dtype]
        if wire == spec.dtype:
            landing = byte_view(target)
        else:
            landing = torch.empty(wire.itemsize * math.prod(shape), dtype=torch.uint8, device=target.device)
        incoming = _Incoming(dtype, shape, target, landing)
        self._tensors[name] = incoming
        return incoming

    def _claim(self, name: str, tensor: _Incoming, offset: int, length: int) -> tuple[int, int]:
        """Check that bytes [offset, offset + length) are inside the tensor and new; record them."""
        start, end, size = offset, offset + length, tensor.size
        if not length and size:
            raise WeightUpdateError(f"tensor {name!r}: chunk at offset {offset} carries no data")
        if start < 0 or end > size:
            raise WeightUpdateError(
                f"tensor {name!r}: chunk bytes [{start}, {end}) fall outside its buffer of {size} bytes"
            )
        # Ranges are disjoint and sorted, so only the neighbours of the insertion point can overlap.
        at = bisect.bisect_right(tensor.starts, start)
        if (at > 0 and tensor.ends[at - 1] > start) or (at < len(tensor.starts) and tensor.starts[at] < end):
            raise WeightUpdateError(f"tensor {name!r}: chunk bytes [{start}, {end}) overlap bytes already received")
        tensor.starts.insert(at, start)
        tensor.ends.insert(at, end)
        tensor.received += length
        self.bytes_received += length
        return start, end


def unpack_bucket(bucket: inference_pb2.SharedBucket, receiver: WeightsReceiver, buffer: torch.Tensor) -> None:
    """Hand each piece of `bucket` (a byte range of `buffer`, flat uint8 on any device) to
    `receiver`; the copies may still run on the device's stream."""
    for piece in bucket.tensors:
        start, end = piece.offset, piece.offset + piece.size_bytes
        if piece.offset < 0 or piece.size_bytes < 0 or end > buffer.numel():
            raise WeightUpdateError(
                f"tensor {piece.name!r}: bytes [{start}, {end}) fall outside buffer {bucket.buffer} of {buffer.numel()} bytes"
            )
        receiver.piece(piece.name, piece.dtype, tuple(piece.shape), piece.tensor_offset, buffer[start:end])
