"""The run's task file in a seeded order.

The n-th task a run submits is fixed by n alone (epoch n // len, a fresh shuffle per epoch), and its
task id says so (`{prefix}-{n:06d}`), so a resumed run knows what it submitted before and neither
repeats nor skips a task.
"""

from __future__ import annotations

import random
from pathlib import Path

from polar.rollout.tasks import TaskFileError, parse_task_lines
from polar.v1 import rollout_pb2


class DatasetError(ValueError):
    """A task file that cannot be trained on; the message names the file (and line)."""


class Dataset:
    """A task file, cycled in a seeded order, with group size and id prefix applied."""

    def __init__(self, path: str, *, seed: int, prefix: str, group_size: int = 0) -> None:
        if not path:
            raise DatasetError(
                "no dataset: set [trainer] dataset to a task file (JSON Lines, the `polar submit` format)"
            )
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
