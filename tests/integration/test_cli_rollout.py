"""`polar serve rollout`, `polar submit`, `polar status` and `polar results` as a user runs them.

The rollout server is a real `polar serve rollout` subprocess on a fresh store; groups are released
without a node by cancelling their tasks (each cancelled session still reports a trajectory). The
example task set runs end to end on a real node (polar/testing/rollout.py, in a thread of this
process) with a scripted model that solves it.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from polar.testing.rollout import running_rollout
from polar.v1 import rollout_pb2, rollout_pb2_grpc
from tests.helpers.polar_command import assert_one_line_error, run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "tasks.jsonl"


def _task_line(**fields) -> str:
    task = {"instruction": "Say hi.", "groupSize": 1, "harness": {"preset": "command", "command": ["true"]}}
    return json.dumps({**task, **fields})


@pytest.fixture
def rollout(spawn, tmp_path: Path) -> str:
    """The address of a `polar serve rollout` on a free port and a fresh store."""
    _, lines = spawn("serve", "rollout", "--port", "0", "--store", str(tmp_path / "rollout.db"))
    return lines.wait_for(r"^rollout: RolloutService on (127\.0\.0\.1:\d+); store ").group(1)


@contextlib.contextmanager
def _stub(address: str) -> Iterator[rollout_pb2_grpc.RolloutServiceStub]:
    with grpc.insecure_channel(address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


def _submit(rollout: str, tmp_path: Path, *lines: str) -> list[str]:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(line + "\n" for line in lines))
    result = run("submit", str(tasks), "--rollout", rollout)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def _cancel(rollout: str, *task_ids: str) -> None:
    """Release these tasks' groups: their pending sessions end cancelled at once."""
    with _stub(rollout) as stub:
        stub.Cancel(rollout_pb2.CancelRequest(task_ids=task_ids), timeout=10)


def _exported(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cursor(stdout: str) -> str:
    return re.search(r"^cursor: (\S+)$", stdout, re.MULTILINE).group(1)


# ------------------------------------------------------------------------------------ serve rollout


def test_serve_rollout_writes_its_port_to_the_ready_fd_and_stops_on_sigterm(tmp_path):
    read_fd, write_fd = os.pipe()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar",
            "serve",
            "rollout",
            "--port",
            "0",
            "--store",
            str(tmp_path / "rollout.db"),
            "--ready-fd",
            str(write_fd),
        ],
        pass_fds=(write_fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as ready:
            port = int(ready.readline())
        with _stub(f"127.0.0.1:{port}") as stub:
            assert list(stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(), timeout=10).tasks) == []
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert f"RolloutService on 127.0.0.1:{port}" in server.stdout.read()
    assert "Traceback" not in server.stderr.read()
    assert (tmp_path / "rollout.db").exists()


def test_a_store_that_cannot_be_opened_is_a_one_line_error(tmp_path):
    store = tmp_path / "no-such-folder" / "rollout.db"
    assert_one_line_error(run("serve", "rollout", "--port", "0", "--store", str(store)), "cannot open", str(store))


# --------------------------------------------------------------------------------- submit, status


def test_submit_prints_the_task_ids_and_status_shows_them(rollout, tmp_path):
    ids = _submit(rollout, tmp_path, "# two tasks", _task_line(taskId="first", groupSize=2), "", _task_line())

    assert ids[0] == "first" and len(ids) == 2 and ids[1]  # the second id is the server's
    status = run("status", "--rollout", rollout)
    assert status.returncode == 0, status.stderr
    nodes, table = status.stdout.split("\n\n")
    assert nodes.startswith("no live nodes")
    header, *rows, total = table.splitlines()
    assert header.split() == [
        "task",
        "group",
        "pending",
        "init",
        "ready",
        "running",
        "postrun",
        "done",
        "reward",
        "released",
    ]
    assert [row.split() for row in rows] == [
        ["first", "2", "2", "0", "0", "0", "0", "0", "-", "no"],
        [ids[1], "1", "1", "0", "0", "0", "0", "0", "-", "no"],
    ]
    assert total == "total: 2 tasks, 0 released; 3 sessions: 3 pending; mean reward none finished yet"
    # Chosen tasks only, by id.
    only = run("status", "first", "--rollout", rollout)
    assert [line.split()[0] for line in only.stdout.split("\n\n")[1].splitlines()[1:-1]] == ["first"]


def test_a_bad_line_is_named_and_nothing_is_submitted(rollout, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(_task_line() + "\n\n" + _task_line(harness={"preset": "cursor"}) + "\n" + "{not json\n")

    result = run("submit", str(tasks), "--rollout", rollout)

    error = assert_one_line_error(result, f"{tasks}:3", "harness.preset", "'cursor'", f"{tasks}:4", "nothing submitted")
    assert result.returncode == 1
    assert f"{tasks}:1" not in error
    assert run("status", "--rollout", rollout).stdout.endswith("\n\nno tasks\n")


def test_the_servers_refusal_is_a_one_line_error(rollout, tmp_path):
    _submit(rollout, tmp_path, _task_line(taskId="once"))
    tasks = tmp_path / "again.jsonl"
    tasks.write_text(_task_line(taskId="once") + "\n")

    assert_one_line_error(run("submit", str(tasks), "--rollout", rollout), "SubmitTasks", "ALREADY_EXISTS", "once")


def test_submit_without_a_file_or_a_server_is_a_one_line_error(tmp_path):
    assert_one_line_error(run("submit", str(tmp_path / "missing.jsonl")), "cannot read task file", "missing.jsonl")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(_task_line() + "\n")
    closed = f"127.0.0.1:{_closed_port()}"
    assert_one_line_error(run("submit", str(tasks), "--rollout", closed), "SubmitTasks", closed, "UNAVAILABLE")
    assert_one_line_error(run("status", "--rollout", closed), "ListNodes", "UNAVAILABLE")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("# nothing yet\n\n")
    assert_one_line_error(run("submit", str(empty), "--rollout", closed), "holds no tasks")


def test_status_watch_without_a_terminal_logs_changes_and_ends_once_all_are_released(spawn, rollout, tmp_path):
    [task_id] = _submit(rollout, tmp_path, _task_line(groupSize=2))
    watch, lines = spawn("status", "--watch", "--interval", "0.1", "--rollout", rollout)
    lines.wait_for(r"^1 task, 0 released; 2 sessions: 2 pending; ")

    _cancel(rollout, task_id)

    assert watch.wait(timeout=30) == 0
    output = lines.rest()
    assert "\x1b" not in "".join(output)  # plain text: no terminal control sequences
    assert output[-2].split()[-1] == "yes" and output[-2].split()[0] == task_id
    assert output[-1].startswith("total: 1 task, 1 released; 2 sessions: 2 done")


def test_status_watch_on_a_terminal_redraws_with_progress_bars(rollout, tmp_path):
    [task_id] = _submit(rollout, tmp_path, _task_line(groupSize=2))
    controller, terminal = pty.openpty()
    watch = subprocess.Popen(
        [sys.executable, "-m", "polar", "status", "--watch", "--interval", "0.1", "--rollout", rollout],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=subprocess.PIPE,
    )
    os.close(terminal)
    screen = _PtyReader(controller)
    try:
        screen.wait_for(b"[" + b"." * 20 + b"] 0/2")
        _cancel(rollout, task_id)
        assert watch.wait(timeout=30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    text = screen.wait_for(b"] 2/2").decode()
    assert "\x1b[H\x1b[J" in text  # each draw replaces the last
    assert "[" + "#" * 20 + "] 2/2" in text


class _PtyReader:
    """Everything a child wrote to its terminal, read by a thread."""

    def __init__(self, fd: int) -> None:
        self.data = b""
        self._changed = threading.Condition()
        threading.Thread(target=self._pump, args=(fd,), daemon=True).start()

    def _pump(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO once the child closed the terminal
                chunk = b""
            with self._changed:
                self.data += chunk
                self._changed.notify_all()
            if not chunk:
                os.close(fd)
                return

    def wait_for(self, needle: bytes, timeout: float = 30) -> bytes:
        with self._changed:
            if not self._changed.wait_for(lambda: needle in self.data, timeout):
                raise AssertionError(f"{needle!r} never appeared; got {self.data[-2000:]!r}")
            return self.data


# ------------------------------------------------------------------------------------------ results


def test_an_export_resumes_after_the_cursor_it_printed(rollout, tmp_path):
    first, second, third = _submit(rollout, tmp_path, _task_line(), _task_line(groupSize=2), _task_line())
    _cancel(rollout, first, second)

    result = run("results", "--export", str(tmp_path / "a.jsonl"), "--rollout", rollout)

    assert result.returncode == 0, result.stderr
    assert f"exported 3 trajectories of 2 groups to {tmp_path / 'a.jsonl'}" in result.stdout
    exported = _exported(tmp_path / "a.jsonl")
    assert [t["sessionId"] for t in exported] == [f"{first}.0", f"{second}.0", f"{second}.1"]
    assert {t["outcome"] for t in exported} == {"SESSION_OUTCOME_CANCELLED"}
    assert [t["groupId"] for t in exported] == [first, second, second]
    cursor = _cursor(result.stdout)

    # Nothing new yet: an empty export, and the same cursor to resume from.
    again = run("results", "--export", str(tmp_path / "b.jsonl"), "--cursor", cursor, "--rollout", rollout)
    assert (tmp_path / "b.jsonl").read_text() == ""
    assert _cursor(again.stdout) == cursor

    _cancel(rollout, third)
    resumed = run("results", "--export", str(tmp_path / "c.jsonl"), "--cursor", cursor, "--rollout", rollout)
    assert [t["sessionId"] for t in _exported(tmp_path / "c.jsonl")] == [f"{third}.0"]
    assert _cursor(resumed.stdout) != cursor


def test_an_export_before_anything_is_released_has_no_cursor(rollout, tmp_path):
    result = run("results", "--export", "-", "--rollout", rollout)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # the trajectories' stream; the summary goes to stderr
    assert "exported 0 trajectories of 0 groups to stdout" in result.stderr
    assert "cursor: none (nothing released yet)" in result.stderr


def test_a_bad_cursor_is_the_servers_one_line_error(rollout, tmp_path):
    assert_one_line_error(
        run("results", "--export", str(tmp_path / "x.jsonl"), "--cursor", "not-a-cursor", "--rollout", rollout),
        "WatchResults",
        "INVALID_ARGUMENT",
    )


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_follow_exports_groups_as_they_are_released_until_stopped(spawn, rollout, tmp_path, stop, code):
    [task_id] = _submit(rollout, tmp_path, _task_line())
    out = tmp_path / "follow.jsonl"
    follow, lines = spawn("results", "--export", str(out), "--follow", "--rollout", rollout)

    _cancel(rollout, task_id)
    deadline = time.monotonic() + 30
    while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t["sessionId"] for t in _exported(out)] == [f"{task_id}.0"]

    follow.send_signal(stop)
    assert follow.wait(timeout=30) == code
    output = lines.rest()
    assert output[0] == f"exported 1 trajectories of 1 groups to {out}"
    assert re.fullmatch(r"cursor: \S+", output[1])
    assert "Traceback" not in follow.stderr.read()


# ---------------------------------------------------------------------------- the example task set

EXAMPLE_SCRIPT = {
    "name": "polar-scripted",
    "cycle": True,
    "rules": [
        {"prompt_regex": "<tool_response>", "text": "Done."},
        {
            "prompt_regex": "6 times 7",
            "text": '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "42"}}\n</tool_call>',
        },
        {
            "prompt_regex": "word hello",
            "text": '<tool_call>\n{"name": "write_file", "arguments": {"path": "hello.txt", "content": "hello"}}\n</tool_call>',
        },
    ],
    "outputs": [{"text": "I cannot help with that."}],
}


@contextlib.contextmanager
def _rollout_in_a_thread(script: dict) -> Iterator[str]:
    """polar.testing.rollout's stack (rollout server, scripted inference, Envoy, a node) on its own
    event loop in a thread, so this test can drive it with blocking `polar` subprocesses; yields the
    rollout server's address."""
    started: concurrent.futures.Future[str] = concurrent.futures.Future()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        try:
            async with running_rollout(script, heartbeat_interval_s=0.2) as handle:
                started.set_result(handle.address)
                await stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield started.result(timeout=120)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        loop.close()


def test_the_example_tasks_run_end_to_end(tmp_path, monkeypatch):
    # A task's template path is the node's: relative to where it runs, the repository root here.
    monkeypatch.chdir(REPO)
    with _rollout_in_a_thread(EXAMPLE_SCRIPT) as rollout:
        submitted = run("submit", str(EXAMPLES), "--rollout", rollout)
        assert submitted.returncode == 0, submitted.stderr
        task_ids = submitted.stdout.split()
        assert len(task_ids) == 2
        watched = run("status", "--watch", "--interval", "0.2", "--rollout", rollout, timeout=180)
        exported = run("results", "--export", str(tmp_path / "examples.jsonl"), "--rollout", rollout)
    assert exported.returncode == 0, exported.stderr

    trajectories = _exported(tmp_path / "examples.jsonl")
    assert sorted(t["metadata"]["example"] for t in trajectories) == [
        "hello-file",
        "hello-file",
        "multiply",
        "multiply",
    ]
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", trajectory
        assert trajectory["reward"] == 1.0, trajectory
        # The agent called the model, ran the tool, and called it again with the result: one merged trace.
        assert len(trajectory["calls"]) == 2 and len(trajectory["traces"]) == 1
        assert "Done." in trajectory["harnessOutput"]
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.splitlines()[-1] == "total: 2 tasks, 2 released; 4 sessions: 4 done; mean reward 1.000"


def test_an_export_takes_batches_past_grpcs_default_message_limit(tmp_path):
    # Task metadata is copied into every trajectory: two sessions of 3 MB each that do not compress
    # make one results message past gRPC's default 4 MB receive limit.
    blob = base64.b64encode(os.urandom(2_250_000)).decode()
    with _rollout_in_a_thread(EXAMPLE_SCRIPT) as rollout:
        _submit(rollout, tmp_path, _task_line(groupSize=2, metadata={"blob": blob}))
        watched = run("status", "--watch", "--interval", "0.2", "--rollout", rollout, timeout=120)
        assert watched.returncode == 0, watched.stderr
        exported = run("results", "--export", str(tmp_path / "big.jsonl"), "--rollout", rollout)
    assert exported.returncode == 0, exported.stderr
    assert [t["metadata"]["blob"] == blob for t in _exported(tmp_path / "big.jsonl")] == [True, True]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
