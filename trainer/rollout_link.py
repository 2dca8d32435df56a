"""The trainer's side of the rollout server: its dataset submitted ahead, its groups read back.

`Dataset` is the run's task file in a seeded order: the n-th task the run submits is fixed by n
alone (epoch n // len, a fresh shuffle per epoch), and its task id says so (`{prefix}-{n:06d}`), so a
resumed run knows what it submitted before and neither repeats nor skips a task. `GroupStream` reads
WatchResults one group per message from a cursor, in a thread, and reconnects from the last cursor
it saw when the rollout server goes away for a moment.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from polar import codec, credentials
from polar.rollout.tasks import TaskFileError, parse_task_lines
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

RECEIVE_LIMIT = 256 * 1024 * 1024  # the rollout server's own message limit
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 5.0


class DatasetError(ValueError):
    """A task file that cannot be trained on; the message names the file (and line)."""


class Dataset:
    """A task file, cycled in a seeded order, with group size and id prefix applied."""

    def __init__(self, path: str, *, seed: int, prefix: str, group_size: int = 0) -> None:
        if not path:
            raise DatasetError("no dataset: set [trainer] dataset to a task file (JSON Lines, the `polar submit` format)")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise DatasetError(f"cannot read dataset {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise DatasetError(f"dataset {path} is not UTF-8 text: {exc.reason}") from None
        try:
            self.tasks = parse_task_lines(text, path)
        except TaskFileError as exc:
            raise DatasetError(f"dataset {'; '.join(str(exc).splitlines())}") from None
        if not self.tasks:
            raise DatasetError(f"dataset {path} holds no tasks")
        self.seed = seed
        self.prefix = prefix
        self.group_size = group_size

    def __len__(self) -> int:
        return len(self.tasks)

    def task_id(self, n: int) -> str:
        return f"{self.prefix}-{n:06d}"

    def owns(self, task_id: str) -> bool:
        """Whether a task id is one this dataset's run submitted (a rollout server may hold others)."""
        head, _, number = task_id.rpartition("-")
        return head == self.prefix and number.isdigit()

    def task(self, n: int) -> rollout_pb2.Task:
        """The n-th task the run submits (0-based)."""
        epoch, index = divmod(n, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        task = rollout_pb2.Task()
        task.CopyFrom(self.tasks[order[index]])
        task.metadata["dataset_task"] = task.task_id or str(order[index])
        task.task_id = self.task_id(n)
        if self.group_size > 0:
            task.group_size = self.group_size
        return task


class RolloutLink:
    """Unary calls to the rollout server, with failures as RolloutError naming the call."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = credentials.channel(
            address, credentials.TRAINER, credentials.of_process(), options=[("grpc.max_receive_message_length", RECEIVE_LIMIT)]
        )
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def call(self, method: str, request, timeout: float = 60.0):
        try:
            return getattr(self.stub, method)(request, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise RolloutError(f"{method} on {self.address}: {exc.code().name}: {exc.details()}") from None

    def existing_task_ids(self) -> set[str]:
        return {t.task_id for t in self.call("GetTaskStatus", rollout_pb2.GetTaskStatusRequest()).tasks}

    def submit(self, tasks: list[rollout_pb2.Task]) -> None:
        if tasks:
            self.call("SubmitTasks", rollout_pb2.SubmitTasksRequest(tasks=tasks))


class RolloutError(RuntimeError):
    """A rollout server call failed."""


@dataclass(frozen=True)
class Group:
    """One released GRPO group and the cursor just after it."""

    cursor: str
    trajectories: list[common_pb2.Trajectory]


class GroupStream:
    """Released groups from a cursor on, one at a time, read by a background thread."""

    def __init__(self, link: RolloutLink, cursor: str) -> None:
        self._link = link
        self._cursor = cursor
        self._groups: queue.Queue[Group | BaseException] = queue.Queue()
        self._stopping = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._read, name="polar-trainer-results", daemon=True)
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
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)

    def _read(self) -> None:
        delay = RECONNECT_FIRST_S
        while not self._stopping.is_set():
            request = rollout_pb2.WatchResultsRequest(cursor=self._cursor, max_groups_per_batch=1)
            try:
                self._call = self._link.stub.WatchResults(request, wait_for_ready=True)
                for response in self._call:
                    trajectories = codec.read_trajectory_batch(response.zstd_trajectories)
                    self._cursor = response.cursor
                    self._groups.put(Group(response.cursor, trajectories))
                    delay = RECONNECT_FIRST_S
            except grpc.RpcError as exc:
                if self._stopping.is_set():
                    return
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self._groups.put(RolloutError(f"WatchResults on {self._link.address}: {exc.code().name}: {exc.details()}"))
                    return
            except codec.CodecError as exc:
                self._groups.put(RolloutError(f"WatchResults on {self._link.address}: a batch is unreadable: {exc}"))
                return
            time.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)
