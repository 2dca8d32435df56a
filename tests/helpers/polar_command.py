"""Running the `polar` command as a user does, for the CLI tests: subprocesses, their output lines,
one-line errors, and whether a process is gone."""

from __future__ import annotations

import contextlib
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

POLAR = [sys.executable, "-m", "polar"]
# A liveness bound, not a speed target: a stack starts in seconds, far longer on a loaded 2-core machine.
STARTUP_SECONDS = 120


class Lines:
    """A child's output lines, read by a thread so that waits can time out; `errors` gives what the
    child wrote to stderr, for the message of a wait that fails because its output ended."""

    def __init__(self, stream, errors: Callable[[], str] = lambda: "") -> None:
        self.seen: list[str] = []
        self._errors = errors
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = STARTUP_SECONDS) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s; got {self.seen}") from None
            if line is None:
                raise AssertionError(
                    f"output ended without a line matching {pattern!r}; got {self.seen}; stderr: {self._errors()!r}"
                )
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match

    def rest(self, timeout: float = 30) -> list[str]:
        """Every line until the output ends."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                return self.seen
            self.seen.append(line)


@contextlib.contextmanager
def spawned() -> Iterator[Callable[..., tuple[subprocess.Popen, Lines]]]:
    """A function that starts a `polar` subprocess with piped output; whatever still runs at the end
    of the block is killed. The integration tests' `spawn` fixture wraps it.

    `prefix` goes before the command: e.g. `ip netns exec NAME`, which execs the command itself, so
    the process is polar's and takes its signals."""
    started: list[subprocess.Popen] = []

    def start(*args: str, prefix: Sequence[str] = (), **popen) -> tuple[subprocess.Popen, Lines]:
        process = subprocess.Popen(
            [*prefix, *POLAR, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )
        started.append(process)
        return process, Lines(process.stdout, errors=lambda: _stderr_after_exit(process))

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


def _stderr_after_exit(process: subprocess.Popen) -> str:
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return "(still running)"
    return process.stderr.read() if process.stderr else ""


def run(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*POLAR, *args],
        check=False,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        **kwargs,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The command failed with exactly one `polar: error:` line holding every needle; returns it."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("polar: error: ")
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
