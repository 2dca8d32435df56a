"""The pure part of `polar generate`: which attempt runs next, whether one is accepted, the counts.

An attempt is (task index, attempt number). Attempts run in rounds: every task's attempt 0, then
every task's attempt 1, ..., each round in an order shuffled by the run's seed, so a run stopped early
has spread its attempts over the tasks, and the same seed picks the same attempts (and, with a cap,
the same accepted ones when the rewards are the same).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

Attempt = tuple[int, int]  # (task index in the task file, attempt number from 0)


def attempt_order(tasks: int, attempts: int, seed: int) -> Iterator[Attempt]:
    """Every attempt of a run, in the order they are started."""
    for number in range(attempts):
        order = list(range(tasks))
        random.Random(seed * 1_000_003 + number).shuffle(order)
        for task in order:
            yield task, number


def accepted(*, outcome: str, reward: float, threshold: float, failed_calls: int) -> bool:
    """An attempt is kept when its harness completed, its reward reaches the threshold and none of
    its calls failed (an engine error, or a tool call that failed to parse)."""
    return outcome == "completed" and reward >= threshold and failed_calls == 0


@dataclass
class Tally:
    """What a run has done so far (attempts recorded, by outcome; accepted per task)."""

    attempts: int = 0
    accepted: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    accepted_per_task: dict[int, int] = field(default_factory=dict)

    def add(self, task: int, outcome: str, kept: bool) -> None:
        self.attempts += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if kept:
            self.accepted += 1
            self.accepted_per_task[task] = self.accepted_per_task.get(task, 0) + 1

    @property
    def rate(self) -> float:
        return self.accepted / self.attempts if self.attempts else 0.0

    def capped(self, task: int, max_per_task: int, running: int = 0) -> bool:
        """Whether the task has, or with its `running` attempts may reach, `max_per_task` accepted
        attempts (0: no cap). An attempt of a capped task is not started, so no task ends with more
        accepted attempts than the cap."""
        return max_per_task > 0 and self.accepted_per_task.get(task, 0) + running >= max_per_task


def next_attempt(
    order: list[Attempt], started: set[Attempt], tally: Tally, running: dict[int, int], max_per_task: int
) -> Attempt | None:
    """The first attempt in `order` not started yet (or recorded) whose task is not capped, counting
    its attempts still running as if they will be accepted; None when there is none now. An attempt
    passed over for its task's cap is taken later if a running one of that task fails."""
    for attempt in order:
        if attempt not in started and not tally.capped(attempt[0], max_per_task, running.get(attempt[0], 0)):
            return attempt
    return None
