"""Where a session's request and response bodies are kept: in memory up to a cap, past it in a file.

Bodies are the bulk of what a session records: a harness sends the whole conversation again with every
call, so a long session's bodies grow with the square of its length, while its token ids (what the
trajectory is built from) grow with its length. The records a session holds leave the bodies out; it
keeps them beside the records, the bytes the gateway received and sent, in memory until they add up to
`[gateway] max_session_body_bytes`; the bodies of every later call are appended to one file of the
session's in the gateway's spill folder, and only where they went stays in memory. A record that
leaves the gateway (GetSession, WatchSession, `polar session show`, the node's reports to the rollout
server) gets its bodies back, from memory or the file, so callers see whole records. Token ids,
logprobs, timings and every other field always stay in memory.

If the file cannot be written (a full disk, the folder removed) the bodies are dropped, and the record
says so (`CallRecord.bodies_dropped`); the same when they cannot be read back. The spill folder is a
private folder (mode 0700) the gateway makes under `[gateway] body_spill_dir` on the first spill; a
session's file goes when the session is forgotten, the folder when the gateway stops.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from polar.codec import length_delimited
from polar.v1 import common_pb2

log = logging.getLogger("polar.gateway")

# A long harness session's bodies reach tens of MiB; this keeps a node of many sessions bounded
# while the usual session (a few hundred KiB) never touches the disk.
DEFAULT_MAX_SESSION_BODY_BYTES = 8 * 1024 * 1024

_REQUEST = common_pb2.CallRecord.REQUEST_BODY_FIELD_NUMBER
_RESPONSE = common_pb2.CallRecord.RESPONSE_BODY_FIELD_NUMBER
_BODIES_DROPPED = common_pb2.CallRecord(bodies_dropped=True).SerializeToString()


class SpillFolder:
    """The gateway's spill folder: made on first use under `parent` ("" = the system's temporary
    folder), removed with everything in it by `remove()`."""

    def __init__(self, parent: str = "") -> None:
        self._parent = parent
        self._path: Path | None = None

    def new_file(self) -> Path:
        """A fresh file name in the folder (the file itself is created by its first write)."""
        if self._path is None:
            if self._parent:
                Path(self._parent).mkdir(parents=True, exist_ok=True)
            self._path = Path(tempfile.mkdtemp(prefix="polar-gateway-bodies-", dir=self._parent or None))
        return self._path / f"{uuid.uuid4().hex}.bodies"

    @property
    def path(self) -> Path | None:
        """The folder, once something was spilled."""
        return self._path

    def remove(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


@dataclass(frozen=True)
class _Spilled:
    """Where one call's bodies are in its session's file: the request's bytes, then the response's."""

    offset: int
    request_length: int
    response_length: int


class SessionBodies:
    """One session's bodies: which are in memory (and how many bytes), which in its file."""

    def __init__(self, folder: SpillFolder, max_bytes: int) -> None:
        self._folder = folder
        self.max_bytes = max_bytes
        self.in_memory = 0  # bytes of the bodies held in memory
        self.over = False  # a call's bodies did not fit: this one's and every later call's leave memory
        self._file: Path | None = None
        self._end = 0  # bytes written to the file
        self._spilled: dict[str, _Spilled] = {}
        # The bodies in memory by call id, as the gateway received and sent them: the records leave
        # them out, so 80 kB of a harness's request is not copied into the record and out again.
        self._held: dict[str, tuple[bytes, bytes]] = {}

    @property
    def spilled(self) -> int:
        """How many calls' bodies are in the file."""
        return len(self._spilled)

    def keep(self, record: common_pb2.CallRecord, request: bytes, response: bytes) -> None:
        """Take a new call's bodies, which its record leaves out: held in memory until the session's
        first call that does not fit under the cap; from that call on, written to the file (or, when
        the file cannot be written, dropped and the record marked)."""
        size = len(request) + len(response)
        if not size:
            return
        if not self.over and self.in_memory + size <= self.max_bytes:
            self.in_memory += size
            self._held[record.call_id] = (request, response)
            return
        self.over = True
        try:
            if self._file is None:
                self._file = self._folder.new_file()
            # os-level calls: a buffered file object costs more than the write itself, once per call
            # of every session past its cap.
            out = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                written = os.writev(out, (request, response))
            finally:
                os.close(out)
            if written != size:  # a full disk: what was written stays, and later offsets count it
                self._end += written
                raise OSError(errno.ENOSPC, f"wrote {written} of {size} bytes")
        except OSError as exc:
            where = self._file or "a spill file"
            log.warning(
                "gateway: dropped the bodies of call %s of session %s: cannot write %s: %s",
                record.call_id,
                record.session_id,
                where,
                exc.strerror or exc,
            )
            record.bodies_dropped = True
        else:
            self._spilled[record.call_id] = _Spilled(self._end, len(request), len(response))
            self._end += size

    def held(self, record: common_pb2.CallRecord) -> bool:
        """Whether there are bodies of the record's call here (in memory or in the file)."""
        return record.call_id in self._held or record.call_id in self._spilled

    def missing_fields(self, record: common_pb2.CallRecord) -> bytes:
        """The serialized fields that complete the record: its call's bodies (read back from the file
        when they were spilled), or `bodies_dropped` when they cannot be read; nothing for a call
        without bodies here."""
        in_memory = self._held.get(record.call_id)
        if in_memory is not None:
            return _fields(*in_memory)
        where = self._spilled.get(record.call_id)
        if where is None:
            return b""
        try:
            with open(self._file, "rb") as spilled:
                spilled.seek(where.offset)
                data = spilled.read(where.request_length + where.response_length)
            if len(data) != where.request_length + where.response_length:
                raise OSError(f"the file ends {where.request_length + where.response_length - len(data)} bytes early")
        except OSError as exc:
            log.warning(
                "gateway: the spilled bodies of call %s of session %s cannot be read back from %s: %s",
                record.call_id,
                record.session_id,
                self._file,
                exc.strerror or exc,
            )
            return _BODIES_DROPPED
        return _fields(data[: where.request_length], data[where.request_length :])

    def discard(self) -> None:
        """Remove the session's file (it is being forgotten)."""
        if self._file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file)
            self._file = None
        self._spilled.clear()
        self._held.clear()


def _fields(request: bytes, response: bytes) -> bytes:
    """The bodies as a CallRecord's serialized fields."""
    bodies = ((_REQUEST, request), (_RESPONSE, response))
    return b"".join(length_delimited(number, body) for number, body in bodies if body)
