"""Run one black-box command (a harness, a prepare step, an evaluator) and always get it back.

`run_process` starts the command in its own session, hence its own process group, with stdin from
/dev/null and the kernel asked to SIGKILL it should this process die (PR_SET_PDEATHSIG through
polar.child_processes, tied to the thread running the event loop). Its stdout and stderr share one pipe
that is drained while it runs, so a command that floods its output never blocks on a full pipe, and
only the first and last bytes are kept (`OutputCap`), so memory stays bounded.

A timeout or a cancel sends SIGTERM to the whole group and SIGKILL to whatever is left after a short
grace. The group is stopped the same way after the leader exits by itself, so background children
(`server &`) never outlive the command. A process that left the group (setsid, a daemon) is out of
reach; its copy of the pipe is closed under it, so it cannot hold up the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from polar.child_processes import dying_with_parent

OUTPUT_LIMIT = 65536
KILL_GRACE_S = 2.0
# After the group is gone, how long the pipe may stay open (held by a process that left the group).
DRAIN_AFTER_EXIT_S = 1.0
GROUP_POLL_S = 0.02
# SIGKILL cannot be refused, but a process in uninterruptible sleep (disk, a hung mount) dies late.
SIGKILL_WAIT_S = 1.0
READ_CHUNK = 256 * 1024


@dataclass(frozen=True)
class ProcessResult:
    exit_code: int  # negative = killed by that signal
    timed_out: bool
    cancelled: bool
    output: str  # stdout+stderr interleaved, capped: head + "\n[… N bytes omitted …]\n" + tail
    output_bytes: int  # total bytes it wrote
    seconds: float  # from start until the whole group was stopped


class ProcessStartError(Exception):
    """The command could not be started (binary missing or not executable, working folder missing);
    the message names what was missing."""


class OutputCap:
    """Keeps the first `limit // 2` and the last `limit - limit // 2` bytes of a stream fed in chunks,
    and counts all of them."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"output limit must be >= 0, got {limit}")
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if self.tail_limit == 0:
            return
        self.tail += data[-self.tail_limit :]
        # Deleting from the front of a bytearray is cheap (CPython moves its start, not the bytes).
        del self.tail[: max(0, len(self.tail) - self.tail_limit)]

    @property
    def omitted(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def capped(self) -> bytes:
        """The whole stream if it fit, else head + a marker naming the omitted byte count + tail."""
        if self.omitted == 0:
            return bytes(self.head + self.tail)
        return bytes(self.head) + omission_marker(self.omitted).encode() + bytes(self.tail)

    def text(self) -> str:
        # Decoded in two parts: a cut through a multi-byte character only replaces that character.
        if self.omitted == 0:
            return (self.head + self.tail).decode("utf-8", "replace")
        head = self.head.decode("utf-8", "replace")
        return head + omission_marker(self.omitted) + self.tail.decode("utf-8", "replace")


def omission_marker(omitted: int) -> str:
    return f"\n[… {omitted} bytes omitted …]\n"


class _OutputReader:
    """Drains the child's output pipe into an OutputCap from the loop's reader callbacks, and sets
    `pipe_closed` at its end (which comes after the leader's exit when a background child keeps the
    pipe open). It owns the read end, which only `close` closes: a transport over a file object
    would have uvloop close the descriptor twice, the second time maybe another thread's new file."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, cap: OutputCap) -> None:
        os.set_blocking(fd, False)
        self._loop = loop
        self._fd = fd
        self.cap = cap
        self.pipe_closed = asyncio.Event()
        loop.add_reader(fd, self._read)

    def _read(self) -> None:
        # One read per wake-up: a flood of output takes its turns with everything else on the loop.
        try:
            data = os.read(self._fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.cap.feed(data)
        else:
            self.close()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        self.pipe_closed.set()


def _watch_exit(loop: asyncio.AbstractEventLoop, process: subprocess.Popen, exited: asyncio.Event) -> None:
    """Reap the leader and set `exited` once it exits, from the loop's callbacks: woken by its pidfd
    where the kernel has them (Linux 5.3), else by polling."""

    def poll() -> None:
        if process.poll() is None:
            loop.call_later(GROUP_POLL_S, poll)
        else:
            exited.set()

    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        poll()
        return

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        process.wait()  # it has exited: this reaps it at once
        exited.set()

    loop.add_reader(pidfd, reap)


async def run_process(
    argv: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str],
    timeout_s: float | None,
    output_limit: int = OUTPUT_LIMIT,
    cancel: asyncio.Event | None = None,
    kill_grace_s: float = KILL_GRACE_S,
) -> ProcessResult:
    """Run argv in cwd with exactly env until it exits, timeout_s passes (None: no limit) or cancel is
    set; its whole process group is stopped before this returns. Raises ProcessStartError when it
    cannot start; if the awaiting task is cancelled, the group is SIGKILLed and the cancel goes on."""
    if not argv:
        raise ProcessStartError("empty command")
    cap = OutputCap(output_limit)
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    path = env.get("PATH", os.defpath)
    # Resolved here, not by the exec inside `setpriv`, so a missing command is an error, not exit 127.
    executable = resolve_command(argv[0], cwd, path)
    read_fd, write_fd = os.pipe()
    try:
        # subprocess.Popen, not the loop's subprocess_exec: CPython starts the child with vfork, where
        # uvloop forks, which runs gRPC's fork handlers in this process (and logs that it skips them).
        process = subprocess.Popen(
            dying_with_parent([executable, *argv[1:]], "KILL"),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        os.close(read_fd)
        raise ProcessStartError(_start_error_text(argv[0], cwd, path, exc)) from exc
    finally:
        os.close(write_fd)  # the child's copies are the only writers now
    group = process.pid  # a session leader's process group id is its pid
    exited = asyncio.Event()
    _watch_exit(loop, process, exited)
    output = _OutputReader(loop, read_fd, cap)
    try:
        ending = await _wait_first(exited, cancel, timeout_s)
        timed_out, cancelled = ending == "timed out", ending == "cancelled"
        await _stop_group(group, exited, kill_grace_s)
        await exited.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(output.pipe_closed.wait(), DRAIN_AFTER_EXIT_S)
    except BaseException:
        _signal_group(group, signal.SIGKILL)  # the exit watch reaps the leader once it is gone
        raise
    finally:
        # Closes our end of the pipe: a writer that escaped the group gets EPIPE instead of blocking.
        output.close()
    return ProcessResult(
        exit_code=process.returncode,
        timed_out=timed_out,
        cancelled=cancelled,
        output=cap.text(),
        output_bytes=cap.total,
        seconds=time.monotonic() - started,
    )


async def _wait_first(exited: asyncio.Event, cancel: asyncio.Event | None, timeout_s: float | None) -> str:
    """Wait until the leader exits ("exited"), cancel is set ("cancelled") or timeout_s passes
    ("timed out"); an exit wins a tie."""
    waiters = {asyncio.create_task(exited.wait()): exited}
    if cancel is not None:
        waiters[asyncio.create_task(cancel.wait())] = cancel
    timeout = None if timeout_s is None or math.isinf(timeout_s) else max(0.0, timeout_s)
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if exited.is_set():
        return "exited"
    return "cancelled" if done else "timed out"


async def _stop_group(group: int, exited: asyncio.Event, grace_s: float) -> None:
    """SIGTERM to the group, then SIGKILL to what is left after grace_s; returns once the leader has
    exited and nothing else of the group runs (or, should SIGKILL not take at once, shortly after).
    Costs nothing when the group is already empty."""
    if exited.is_set() and not _group_alive(group):
        return
    _signal_group(group, signal.SIGTERM)
    if await _group_stopped(group, exited, grace_s):
        return
    _signal_group(group, signal.SIGKILL)
    await _group_stopped(group, exited, SIGKILL_WAIT_S)


async def _group_stopped(group: int, exited: asyncio.Event, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not (exited.is_set() and not _group_alive(group)):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(GROUP_POLL_S)
    return True


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    """Whether a process of the group is still running. Exited members linger as zombies until their
    parent reaps them (an orphan's new parent may never do so), so they do not count."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after it.
        state, _ppid, pgrp = stat.rpartition(")")[2].split()[:3]
        if int(pgrp) == group and state not in ("Z", "X"):
            return True
    return False


def exit_text(exit_code: int) -> str:
    """A ProcessResult.exit_code in words: "exited with code N" or "killed by signal SIGNAME"."""
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = str(-exit_code)
    return f"killed by signal {name}"


def resolve_command(command: str, cwd: str | Path, path: str) -> str:
    """The file that `command` names (looked up on `path` when it has no slash); ProcessStartError
    when there is none or it cannot be executed."""
    if not Path(cwd).is_dir():
        raise ProcessStartError(f"cannot start {command!r}: working folder {str(cwd)!r}: no such folder")
    if os.sep not in command:
        found = shutil.which(command, path=path)
        if found is None:
            raise ProcessStartError(f"cannot start {command!r}: no such command on PATH")
        return found
    file = Path(cwd) / command
    if not file.exists():
        raise ProcessStartError(f"cannot start {command!r}: no such file")
    if file.is_dir() or not os.access(file, os.X_OK):
        raise ProcessStartError(f"cannot start {command!r}: not executable")
    return command


def _start_error_text(command: str, cwd: str | Path, path: str, exc: OSError) -> str:
    if exc.filename is not None and str(exc.filename) == str(cwd):
        return f"cannot start {command!r}: working folder {str(cwd)!r}: {exc.strerror}"
    if os.sep not in command and shutil.which(command, path=path) is None:
        # Looked up on PATH: an unreadable PATH folder on the way turns "not found" into EACCES.
        return f"cannot start {command!r}: no such command on PATH"
    if isinstance(exc, PermissionError):
        return f"cannot start {command!r}: not executable ({exc.strerror})"
    if isinstance(exc, FileNotFoundError):
        return f"cannot start {command!r}: no such file"
    return f"cannot start {command!r}: {exc.strerror or exc}"
