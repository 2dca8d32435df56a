"""A gateway node's worker pools and its buffer of prewarmed runtimes.

A session passes INIT (its runtime is prepared) → READY (prepared, waiting for a harness slot) →
RUNNING (the harness runs) → POSTRUN (evaluate, rebuild, report). Each stage is a `Pool`: a number
of slots and the sessions in it now, which is what heartbeats report.

Prewarming: runtimes do not depend on the task, only on its `RuntimeSpec` (kind, template, prepare
commands, image), so INIT may prepare them before any session asks. `ReadyBuffer` keeps up to
`capacity` such runtimes, keyed by the spec's fingerprint; a session whose spec has one takes it and
skips INIT entirely. Which specs to keep warm: those of recently assigned tasks, sharing the buffer
evenly with the most recent first; before any task was seen, the node's configured specs (the default
empty workspace), which step aside as soon as a task wants another spec. When the buffer is full of
other specs and a session finds none of its own, the least recently wanted spec gives up a runtime
so the next refill can serve the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from polar.v1 import common_pb2, rollout_pb2

PrewarmedRuntime = TypeVar("PrewarmedRuntime")


class Pool:
    """`capacity` slots; `active` sessions hold one, `waiting` ones queue for one."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the {name} pool needs at least 1 slot, not {capacity}")
        self.name = name
        self.capacity = capacity
        self.active = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(capacity)

    @property
    def free(self) -> int:
        return self.capacity - self.active

    async def acquire(self) -> None:
        """Take a slot, waiting for one if none is free (returns at once when `free` and no one waits)."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._slots.release()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


@dataclass
class _Warm(Generic[PrewarmedRuntime]):
    spec: rollout_pb2.RuntimeSpec
    runtimes: deque[tuple[PrewarmedRuntime, float]] = field(default_factory=deque)  # (runtime, ready since)


class ReadyBuffer(Generic[PrewarmedRuntime]):
    """Prewarmed runtimes by spec fingerprint, at most `capacity` (plus those being prepared)."""

    def __init__(self, capacity: int, configured: Iterable[tuple[str, rollout_pb2.RuntimeSpec]] = ()) -> None:
        self.capacity = capacity
        # Every spec worth keeping warm, least recently wanted first (at most `capacity` of them).
        self._warm: OrderedDict[str, _Warm[PrewarmedRuntime]] = OrderedDict(
            (key, _Warm(spec)) for key, spec in configured
        )
        # Configured specs no task has wanted yet: warm only until a task wants something else.
        self._placeholders = set(self._warm)
        self.preparing = 0

    @property
    def size(self) -> int:
        return sum(len(warm.runtimes) for warm in self._warm.values())

    def want(self, key: str, spec: rollout_pb2.RuntimeSpec) -> list[PrewarmedRuntime]:
        """A session asked for this spec: keep it warm, ahead of the others. Returns the prewarmed
        runtimes no longer worth keeping (of placeholders, or of specs pushed out), for closing."""
        dropped: list[PrewarmedRuntime] = []
        if key in self._placeholders:
            self._placeholders.discard(key)
        elif self._placeholders:
            for placeholder in self._placeholders:
                dropped += [runtime for runtime, _ in self._warm.pop(placeholder).runtimes]
            self._placeholders.clear()
        if key not in self._warm:
            self._warm[key] = _Warm(spec)
        self._warm.move_to_end(key)
        while len(self._warm) > self.capacity:
            _, oldest = self._warm.popitem(last=False)
            dropped += [runtime for runtime, _ in oldest.runtimes]
        return dropped

    def take(self, key: str) -> tuple[PrewarmedRuntime, float] | None:
        """A prewarmed runtime of this spec and the time it became ready, oldest first; None if none."""
        warm = self._warm.get(key)
        if warm is None or not warm.runtimes:
            return None
        return warm.runtimes.popleft()

    def put(self, key: str, spec: rollout_pb2.RuntimeSpec, runtime: PrewarmedRuntime) -> None:
        if key not in self._warm:  # given up while it was being prepared: warm again, as least wanted
            self._warm[key] = _Warm(spec)
            self._warm.move_to_end(key, last=False)
        self._warm[key].runtimes.append((runtime, time.monotonic()))

    def next_to_prepare(self) -> tuple[str, rollout_pb2.RuntimeSpec] | None:
        """The spec the next prewarmed runtime should have, or None while the buffer is full.

        The most recently wanted spec with the fewest prewarmed runtimes: the buffer is shared evenly
        among the warm specs, favouring recent ones.
        """
        if self.size + self.preparing >= self.capacity or not self._warm:
            return None
        recent_first = list(reversed(self._warm.items()))
        key, warm = min(recent_first, key=lambda item: len(item[1].runtimes))
        return key, warm.spec

    def evict_for(self, key: str) -> PrewarmedRuntime | None:
        """When full, a runtime of the least recently wanted other spec, removed so `key` can be
        prepared next; None when there is room or nothing else to give up."""
        if self.size + self.preparing < self.capacity:
            return None
        for other, warm in self._warm.items():
            if other != key and warm.runtimes:
                runtime, _ = warm.runtimes.pop()
                return runtime
        return None

    def forget(self, key: str) -> None:
        """Stop keeping this spec warm (its prewarmed runtimes stay until taken or drained)."""
        warm = self._warm.get(key)
        if warm is not None and not warm.runtimes:
            del self._warm[key]
            self._placeholders.discard(key)

    def drain(self) -> list[PrewarmedRuntime]:
        """Every prewarmed runtime, removed (for shutdown)."""
        runtimes = [runtime for warm in self._warm.values() for runtime, _ in warm.runtimes]
        for warm in self._warm.values():
            warm.runtimes.clear()
        return runtimes


class StageClock:
    """When a session entered each stage; its StageTimings so far."""

    _FIELDS = {
        "init": "init_seconds",
        "ready": "ready_seconds",
        "running": "running_seconds",
        "postrun": "postrun_seconds",
    }

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._current: str | None = None
        self._since = 0.0

    @property
    def stage(self) -> str | None:
        return self._current

    def enter(self, stage: str, since: float | None = None) -> None:
        """Start `stage` now (or at monotonic time `since`, for time already spent in it)."""
        now = time.monotonic()
        self._stop(now)
        self._current = stage
        self._since = now if since is None else since

    def stop(self) -> None:
        self._stop(time.monotonic())
        self._current = None

    def _stop(self, now: float) -> None:
        if self._current is not None:
            self._seconds[self._current] = self._seconds.get(self._current, 0.0) + now - self._since

    def timings(self) -> common_pb2.StageTimings:
        seconds = dict(self._seconds)
        if self._current is not None:
            seconds[self._current] = seconds.get(self._current, 0.0) + time.monotonic() - self._since
        return common_pb2.StageTimings(**{self._FIELDS[stage]: value for stage, value in seconds.items()})
