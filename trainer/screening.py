"""What a step does with sessions that are more than one plain chain of calls, and what it counts.

Long traces, forks, cut, aborted, failed, retried and refused calls each have a defined behaviour and
counters in every metrics.jsonl line; none stops the run. The cases, their counters and why a long
trace drops its whole group by default: docs/design/screening.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from polar.rollout.client import Group
from polar.trajectory import FORK_REASONS, views_from_protos
from polar.trajectory.call_stats import CALL_COUNTS, call_counts
from polar.v1 import common_pb2

TOO_LONG_POLICIES = ("group", "session")
# Keys every step's line carries, zero when nothing of the kind happened.
SCREEN_KEYS = (
    "traces_too_long",
    "groups_too_long_dropped",
    "sessions_too_long_dropped",
    "traces_truncated",
    "sessions_first_call_too_long",
    *CALL_COUNTS,
    *(f"forks_{reason}" for reason in FORK_REASONS),
)


@dataclass
class Screened:
    """The groups a step trains on, and what screening them counted."""

    groups: list[Group]
    counts: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # task ids of the groups left out whole


class Screener:
    """Screens the groups of each step (see the module docstring); `warn` gets each warning's text."""

    def __init__(self, max_tokens: int, too_long: str, warn: Callable[[str], None]) -> None:
        if too_long not in TOO_LONG_POLICIES:
            raise ValueError(f"too_long must be one of {', '.join(TOO_LONG_POLICIES)}, not {too_long!r}")
        self.max_tokens = max_tokens
        self.too_long = too_long
        self.warn = warn
        self._warned_first_call = False

    def screen(self, groups: Sequence[Group]) -> Screened:
        counts: Counter[str] = Counter(dict.fromkeys(SCREEN_KEYS, 0))
        kept, dropped = [], []
        for group in groups:
            for trajectory in group.trajectories:
                self._count(trajectory, counts)
            screened = self._fitting(group, counts)
            if screened is None:
                dropped.append(group.trajectories[0].task_id)
            else:
                kept.append(screened)
        return Screened(kept, dict(counts), dropped)

    def _count(self, trajectory: common_pb2.Trajectory, counts: Counter[str]) -> None:
        for reason, forks in trajectory.stats.forks.items():
            counts[f"forks_{reason}"] += forks
        counts["traces_truncated"] += sum(trace.truncated for trace in trajectory.traces)
        counts.update(call_counts(views_from_protos(trajectory.calls)))
        if trajectory.calls and trajectory.calls[0].prompt_too_long:
            counts["sessions_first_call_too_long"] += 1
            if not self._warned_first_call:
                self._warned_first_call = True
                self.warn(
                    f"task {trajectory.task_id}: the harness's first call does not fit the served model's context "
                    f"({trajectory.calls[0].error}); such sessions fail before anything is sampled (counted as "
                    "sessions_first_call_too_long): serve a model with a longer context or give the harness less to send"
                )

    def _fitting(self, group: Group, counts: Counter[str]) -> Group | None:
        """The group as the step trains on it: whole, without its sessions that hold a trace too
        long to train on (too_long = "session"), or None when it is left out."""
        keep, over = [], []  # over: (length, session, trace) of each session's longest trace too long
        for trajectory in group.trajectories:
            long = [(len(t.token_ids), t.trace_id) for t in trajectory.traces if len(t.token_ids) > self.max_tokens]
            counts["traces_too_long"] += len(long)
            if long:
                length, trace_id = max(long)
                over.append((length, trajectory.session_id, trace_id))
            else:
                keep.append(trajectory)
        if not over:
            return group
        dropped = self.too_long == "group" or len(keep) < 2  # one session alone has no advantage
        length, session_id, trace_id = max(over)
        self.warn(
            f"task {group.trajectories[0].task_id}: {len(over)} of its {len(group.trajectories)} sessions hold a trace "
            f"longer than max_tokens_per_microbatch = {self.max_tokens} (the longest: trace {trace_id} of session "
            f"{session_id}, {length} tokens); {'the group' if dropped else 'those sessions'} left out of this step "
            f"(too_long = {self.too_long!r})"
        )
        if dropped:
            counts["groups_too_long_dropped"] += 1
            return None
        counts["sessions_too_long_dropped"] += len(over)
        return Group(group.cursor, keep)
