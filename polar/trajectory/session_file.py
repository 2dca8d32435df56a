"""Session files: a session's call records and traces in one file, for ``polar verify`` and fixtures.

A session file holds one ``polar.v1.Trajectory`` message: its ``calls`` are the session's call records,
its ``traces`` the traces to check (``stats``, ``builder`` and the other fields are kept when set). The
file name says the encoding:

* ``*.json``: the protobuf JSON mapping (``google.protobuf.json_format``), readable by people;
* ``*.pb`` or ``*.binpb``: the binary protobuf encoding;
* either of them followed by ``.zst``: zstd-compressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import zstandard
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from polar.trajectory.records import (
    BuildResult,
    BuiltTrace,
    CallView,
    SessionFileError,
    views_from_protos,
)
from polar.v1 import common_pb2

SUFFIXES = (".json", ".pb", ".binpb", ".json.zst", ".pb.zst", ".binpb.zst")


def _encoding(path: Path) -> tuple[str, bool]:
    name = path.name
    compressed = name.endswith(".zst")
    if compressed:
        name = name[: -len(".zst")]
    if name.endswith(".json"):
        return "json", compressed
    if name.endswith((".pb", ".binpb")):
        return "binary", compressed
    raise SessionFileError(f"{path}: unknown session file suffix (expected one of {', '.join(SUFFIXES)})")


def session_trajectory(
    calls: Sequence[CallView | common_pb2.CallRecord], result: BuildResult, session_id: str = ""
) -> common_pb2.Trajectory:
    """A Trajectory message holding the calls, the traces and the merge statistics."""
    records = [c if isinstance(c, common_pb2.CallRecord) else c.to_proto(session_id) for c in calls]
    return common_pb2.Trajectory(
        trajectory_id=session_id,
        session_id=session_id,
        traces=result.to_proto_traces(),
        weight=1.0,
        stats=result.stats.to_proto(),
        builder=result.builder,
        calls=records,
    )


def write_session(path: str | Path, trajectory: common_pb2.Trajectory) -> None:
    path = Path(path)
    encoding, compressed = _encoding(path)
    if encoding == "json":
        data = json_format.MessageToJson(trajectory, indent=1).encode()
    else:
        data = trajectory.SerializeToString()
    if compressed:
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def read_trajectory(path: str | Path) -> common_pb2.Trajectory:
    path = Path(path)
    encoding, compressed = _encoding(path)
    try:
        data = path.read_bytes()
        if compressed:
            data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        trajectory = common_pb2.Trajectory()
        if encoding == "json":
            json_format.Parse(data.decode(), trajectory)
        else:
            trajectory.ParseFromString(data)
    except (OSError, zstandard.ZstdError, UnicodeDecodeError, json_format.ParseError, DecodeError) as exc:
        raise SessionFileError(f"{path}: {exc}") from exc
    return trajectory


def read_session(path: str | Path) -> tuple[tuple[CallView, ...], tuple[BuiltTrace, ...]]:
    """The call views and traces stored in a session file."""
    trajectory = read_trajectory(path)
    try:
        calls = views_from_protos(trajectory.calls)
    except ValueError as exc:
        raise SessionFileError(f"{path}: {exc}") from exc
    return calls, tuple(BuiltTrace.from_proto(trace) for trace in trajectory.traces)
