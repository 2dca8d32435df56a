"""zstd framing of the results stream: one zstd frame per message, and TrajectoryBatch assembly.

A WatchResults message carries a serialized ``TrajectoryBatch`` compressed as one zstd frame. The
rollout server stores each trajectory already serialized, so ``trajectory_batch`` frames those bytes
as the batch's repeated field 1 directly: the same bytes a parse-and-reserialize would give, without
parsing them. ``decompress`` is bounded: a frame that would inflate past ``max_bytes`` is refused
before its output is held in memory.

Token ids cross the gateway as protobuf's packed wire form (``packed_ids``, ``length_delimited``): a
``repeated int32`` field is its tag, the payload's length, then one varint per id, and varints
concatenate, so the payload of ids a + b is the payload of a followed by that of b. A prompt made of
pieces the gateway has seen is then a join of their payloads, where putting 20k ids into a message
field one by one costs about half a millisecond.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

import zstandard
from google.protobuf.message import DecodeError

from polar.v1 import common_pb2, inference_pb2

# The RolloutService's message limit: a WatchResults message carries several whole trajectories (every
# call's token ids and bodies), so its clients need a receive limit this large too. What the server
# receives (a report carries one trajectory) is limited by RolloutConfig.max_request_bytes.
MAX_ROLLOUT_MESSAGE_BYTES = 256 * 1024 * 1024
# Protobuf refuses to parse messages of 2 GiB or more, so no batch can usefully be larger.
MAX_BATCH_BYTES = 2**31 - 1
# Tag of TrajectoryBatch.trajectories: field 1, wire type 2 (length-delimited).
_TRAJECTORIES_TAG = bytes([1 << 3 | 2])
_LEVEL = 3


class CodecError(ValueError):
    """Bytes that are not one complete zstd frame, inflate past the limit, or are not a batch."""


def compress(data: bytes) -> bytes:
    """One zstd frame holding `data`, its size recorded in the frame header."""
    return zstandard.ZstdCompressor(level=_LEVEL).compress(data)


def decompress(data: bytes, *, max_bytes: int) -> bytes:
    """The contents of the single zstd frame `data`; refuses one that inflates past `max_bytes`."""
    decompressor = zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"not a zstd frame ({len(data)} bytes): {exc}") from exc
    if declared > max_bytes:
        raise CodecError(f"zstd frame declares {declared} bytes, more than the limit of {max_bytes}")
    try:
        # Without a declared size the output is capped at max_bytes (ours always declare it).
        return decompressor.decompress(data, max_output_size=max_bytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        if declared < 0 and _inflates_past(decompressor, data, max_bytes):
            raise CodecError(f"zstd frame inflates past the limit of {max_bytes} bytes") from exc
        raise CodecError(f"corrupt or incomplete zstd frame: {exc}") from exc


def _inflates_past(decompressor: zstandard.ZstdDecompressor, data: bytes, max_bytes: int) -> bool:
    # Reads at most max_bytes + 1 bytes of output, so telling "too large" from "corrupt" stays bounded.
    try:
        return len(decompressor.stream_reader(io.BytesIO(data)).read(max_bytes + 1)) > max_bytes
    except zstandard.ZstdError:
        return False


def trajectory_batch(serialized_trajectories: Iterable[bytes]) -> bytes:
    """A serialized TrajectoryBatch whose trajectories are the given serialized Trajectory messages."""
    parts = []
    for trajectory in serialized_trajectories:
        parts += (_TRAJECTORIES_TAG, _varint(len(trajectory)), trajectory)
    return b"".join(parts)


def packed_ids(ids: Sequence[int]) -> bytes:
    """The payload of a packed ``repeated int32`` field holding ids (without its tag and length)."""
    if not ids:
        return b""
    # Protobuf writes the varints: a message holding only its field 1, a repeated int32, serializes
    # to the field's tag (one byte), the payload's length, then the payload.
    wire = inference_pb2.GenerateResponse(token_ids=ids).SerializeToString()
    start = 1
    while wire[start] & 0x80:
        start += 1
    return wire[start + 1 :]


def unpacked_ids(payload: bytes) -> tuple[int, ...]:
    """The ids a packed ``repeated int32`` payload holds (read by protobuf, in C)."""
    return tuple(inference_pb2.GenerateResponse.FromString(length_delimited(1, payload)).token_ids)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    """A length-delimited field (a packed repeated field's, a message's, bytes'): tag, length, payload."""
    return length_delimited_header(field_number, len(payload)) + payload


def length_delimited_header(field_number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field: what comes before its payload (joined with
    other parts, a large payload is copied once)."""
    return _varint(field_number << 3 | 2) + _varint(length)


def _varint(value: int) -> bytes:
    # Protobuf's base-128 varint: 7 bits per byte, least significant first, high bit = more follow.
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_trajectory_batch(zstd_bytes: bytes, *, max_bytes: int = MAX_BATCH_BYTES) -> list[common_pb2.Trajectory]:
    """The trajectories of one WatchResults message's `zstd_trajectories`."""
    batch = common_pb2.TrajectoryBatch()
    try:
        batch.ParseFromString(decompress(zstd_bytes, max_bytes=max_bytes))
    except DecodeError as exc:
        raise CodecError(f"not a serialized TrajectoryBatch: {exc}") from exc
    return list(batch.trajectories)
