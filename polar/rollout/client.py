"""The rollout server's one client, for the command line and the trainer alike.

`RolloutClient` owns a channel to the rollout server, calling as its role: the operator for the
`polar` commands (`polar submit`, `results`, `status`, `up --submit`, `generate`, `export`), the
trainer for the trainer. A failed call is a `RolloutError` whose message is one line naming the
method and the address. `GroupStream` reads released groups one per message from a cursor in a
thread, reconnecting from the last cursor it saw when the rollout server goes away for a moment;
`export_results` writes them to a file for `polar results`.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from polar import codec, credentials
from polar.rollout.report import trajectory_lines
from polar.rollout.tasks import TaskFileError, parse_task_lines
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

COMMAND_TIMEOUT_S = 30.0  # a command's call fails at once when nothing listens, else after this
WAITING_TIMEOUT_S = 60.0  # a waiting client's call waits this long for the server to come (back)
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 5.0
UNAVAILABLE_HINT = " (is `polar up` or `polar serve rollout` running there?)"


class RolloutError(RuntimeError):
    """A rollout server call that failed, or input that cannot be sent to it; the message says why
    in one line. `code` is the call's gRPC status, None when no call failed."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class RolloutClient:
    """A channel to the rollout server at `address` and the calls made over it.

    `role` is whose credential the calls carry: credentials.OPERATOR (the `polar` commands':
    credentials.for_commands()) or credentials.TRAINER (the served trainer's: its process's
    credentials). A client `waits` (by default: the trainer's) when its calls ride out a rollout
    server that is not up yet or restarting: each waits for it up to WAITING_TIMEOUT_S. Otherwise
    a call fails at once when nothing listens (with a hint for the operator) and after
    COMMAND_TIMEOUT_S at most. The channel takes messages as large as the server sends (results
    batches pass gRPC's default 4 MB).
    """

    def __init__(self, address: str, role: str = credentials.OPERATOR, *, waits: bool | None = None) -> None:
        if role == credentials.OPERATOR:
            found = credentials.for_commands()
        elif role == credentials.TRAINER:
            found = credentials.of_process()
        else:
            raise ValueError(f"a rollout client calls as {credentials.OPERATOR} or {credentials.TRAINER}, not {role!r}")
        self.address = address
        self.role = role
        self.waits = role == credentials.TRAINER if waits is None else waits
        options = [("grpc.max_receive_message_length", codec.MAX_ROLLOUT_MESSAGE_BYTES)]
        self.channel = credentials.channel(address, role, found, options=options)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def error(self, method: str, exc: grpc.RpcError) -> RolloutError:
        """The RolloutError of a failed call of `method`."""
        unavailable = exc.code() == grpc.StatusCode.UNAVAILABLE
        hint = UNAVAILABLE_HINT if unavailable and self.role == credentials.OPERATOR else ""
        return RolloutError(f"{method} on {self.address}: {exc.code().name}: {exc.details()}{hint}", exc.code())

    def call(self, method: str, request):
        """One unary RolloutService call; gRPC failures become RolloutErrors."""
        timeout = WAITING_TIMEOUT_S if self.waits else COMMAND_TIMEOUT_S
        try:
            return getattr(self.stub, method)(request, timeout=timeout, wait_for_ready=self.waits)
        except grpc.RpcError as exc:
            raise self.error(method, exc) from None

    def submit(self, tasks: list[rollout_pb2.Task]) -> list[str]:
        """The tasks submitted, all or none; their ids (none submitted: no call)."""
        if not tasks:
            return []
        return list(self.call("SubmitTasks", rollout_pb2.SubmitTasksRequest(tasks=tasks)).task_ids)

    def existing_task_ids(self) -> set[str]:
        """The id of every task the rollout server holds."""
        return {t.task_id for t in self.call("GetTaskStatus", rollout_pb2.GetTaskStatusRequest()).tasks}

    def status(self, task_ids: list[str]) -> tuple[list, list]:
        """(the live nodes, the tasks asked for: every task when task_ids is empty)."""
        nodes = self.call("ListNodes", rollout_pb2.ListNodesRequest()).nodes
        tasks = self.call("GetTaskStatus", rollout_pb2.GetTaskStatusRequest(task_ids=task_ids)).tasks
        return list(nodes), list(tasks)

    def upstreams(self) -> rollout_pb2.ListUpstreamsResponse:
        """Envoy's upstreams and the Envoys of the control plane, with the versions they acknowledged."""
        return self.call("ListUpstreams", rollout_pb2.ListUpstreamsRequest())

    def results(self, cursor: str = "", *, until_caught_up: bool = False, groups_per_batch: int = 0) -> ResultBatches:
        """The WatchResults stream of released groups after `cursor`: until caught up, or on; at most
        `groups_per_batch` groups a message (0: the server's default, 16)."""
        request = rollout_pb2.WatchResultsRequest(
            cursor=cursor, until_caught_up=until_caught_up, max_groups_per_batch=groups_per_batch
        )
        return ResultBatches(self, self.stub.WatchResults(request, wait_for_ready=self.waits))

    def groups(self, cursor: str) -> GroupStream:
        """Released groups after `cursor`, one at a time, read by a background thread."""
        return GroupStream(self, cursor)


class ResultBatches:
    """One WatchResults stream: its batches in release order, its failure a RolloutError. `cancel`
    ends it from another thread or a signal handler (the loop reading it gets code CANCELLED)."""

    def __init__(self, client: RolloutClient, call: grpc.Call) -> None:
        self._client = client
        self._call = call

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[rollout_pb2.WatchResultsResponse]:
        try:
            yield from self._call
        except grpc.RpcError as exc:
            raise self._client.error("WatchResults", exc) from None


@dataclass(frozen=True)
class Group:
    """One released GRPO group and the cursor just after it."""

    cursor: str
    trajectories: list[common_pb2.Trajectory]


class GroupStream:
    """Released groups from a cursor on, one at a time, read by a background thread that reconnects
    from the last cursor it saw when the stream breaks off (the server restarting)."""

    def __init__(self, client: RolloutClient, cursor: str) -> None:
        self._client = client
        self._cursor = cursor
        self._groups: queue.Queue[Group | BaseException] = queue.Queue()
        self._stopping = threading.Event()
        self._batches: ResultBatches | None = None
        self._thread = threading.Thread(target=self._read, name="polar-rollout-results", daemon=True)
        self._thread.start()

    def next(self, timeout: float) -> Group | None:
        """The next group, or None if none arrived within timeout seconds."""
        try:
            item = self._groups.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stopping.set()
        batches = self._batches
        if batches is not None:
            batches.cancel()
        self._thread.join(timeout=5)

    def _read(self) -> None:
        delay = RECONNECT_FIRST_S
        while not self._stopping.is_set():
            try:
                self._batches = self._client.results(self._cursor, groups_per_batch=1)
                for response in self._batches:
                    trajectories = codec.read_trajectory_batch(response.zstd_trajectories)
                    self._cursor = response.cursor
                    self._groups.put(Group(response.cursor, trajectories))
                    delay = RECONNECT_FIRST_S
            except RolloutError as exc:
                if self._stopping.is_set():
                    return
                if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self._groups.put(exc)
                    return
            except codec.CodecError as exc:
                self._groups.put(RolloutError(f"WatchResults on {self._client.address}: a batch is unreadable: {exc}"))
                return
            time.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)


def read_tasks(file: str) -> list[rollout_pb2.Task]:
    """Every task of a task file ("-": stdin), checked whole; RolloutError naming FILE:LINE otherwise."""
    source = "<stdin>" if file == "-" else file
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise RolloutError(f"cannot read task file {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise RolloutError(f"task file {source} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        tasks = parse_task_lines(text, source)
    except TaskFileError as exc:
        # One problem per line in the message; the error stays one line, nothing was submitted.
        raise RolloutError(f"nothing submitted: {'; '.join(str(exc).splitlines())}") from None
    if not tasks:
        raise RolloutError(f"nothing submitted: {source} holds no tasks (only blank or '#' lines)")
    return tasks


def export_results(address: str, export: str, cursor: str = "", follow: bool = False) -> int:
    """`polar results`: released groups written to `export` ("-": stdout) as JSON Lines, one
    Trajectory each, starting after `cursor`; until caught up, or with `follow` until Ctrl-C or
    SIGTERM (then 128 + the signal's number, as a process it ended: 130, 143). Prints what was
    written and the cursor to resume from, also when the stream fails.

    A signal cancels the stream rather than raising where it lands: the batch in hand is written
    whole first, so the file ends exactly at the printed cursor and `--cursor` resumes without a
    group twice. A signal this process was started ignoring (`nohup`, `cmd &` in a script) stays
    ignored.
    """
    to_stdout = export == "-"
    report = sys.stderr if to_stdout else sys.stdout
    groups = trajectories = 0
    stream: ResultBatches | None = None
    stopped_by: list[int] = []

    def summary() -> None:
        where = "stdout" if to_stdout else export
        print(f"exported {trajectories} trajectories of {groups} groups to {where}", file=report)
        # The file holds every group up to this cursor: `--cursor` with it resumes after them.
        print(f"cursor: {cursor}" if cursor else "cursor: none (nothing released yet)", file=report, flush=True)

    def stop(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        if stream is not None:
            stream.cancel()

    try:
        out = sys.stdout if to_stdout else open(export, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise RolloutError(f"cannot write {export}: {exc.strerror}") from None
    caught = [s for s in (signal.SIGINT, signal.SIGTERM) if follow and signal.getsignal(s) != signal.SIG_IGN]
    previous = {signum: signal.signal(signum, stop) for signum in caught}
    try:
        with RolloutClient(address) as client:
            stream = client.results(cursor, until_caught_up=not follow)
            if stopped_by:
                stream.cancel()
            for batch in stream:
                lines = trajectory_lines(batch.zstd_trajectories)
                out.writelines(line + "\n" for line in lines)
                out.flush()
                trajectories += len(lines)
                cursor = batch.cursor
                groups += batch.group_count
    except RolloutError:
        summary()
        if stopped_by:
            return 128 + stopped_by[0]
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if not to_stdout:
            out.close()
    summary()
    return 0
