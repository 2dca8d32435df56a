"""What a step does with sessions that are more than one plain chain of calls, and what it counts.

Every case below has a defined behaviour and counters in each step's line of metrics.jsonl; none stops
the run, and nothing is left out without being counted:

    case                                 what the step does                               metrics
    a trace longer than                  too_long = "group" (default): its whole group    traces_too_long
      max_tokens_per_microbatch            leaves the step; "session": only its session   groups_too_long_dropped
                                           does, the group's advantages taken over the    sessions_too_long_dropped
                                           rest; a warning names the trace and its length
    a fork (compaction, sub-agent,       sibling traces of the session (the builder's),   forks_<reason>
      edit, parallel branch)               each with the session's advantage and a share
                                           of its weight
    a call cut by a cap or the context   its trace is marked truncated, and trained       calls_truncated
                                           unless train_truncated = false                 traces_truncated(_skipped)
    an aborted stream, a failed call     its partial sample is trained once, in the       calls_aborted, calls_failed
                                           context it was sampled in (an "aborted_call"   forks_aborted_call
                                           trace)
    a retried call                       the retry continues the chain                    calls_retried
    a prompt over the context            recorded, nothing to train; what the harness     calls_prompt_too_long
                                           sends after it (compacted) starts a new trace
    a first call over the context        the session failed (the rollout node says why)   sessions_first_call_too_long
                                           and a warning says so, once per run

Why the whole group by default. GRPO centres the advantages within a group. Leaving one session out
of the gradient while its reward stays in the group's mean pushes every kept session up (their
advantages no longer sum to 0): a step that imitates whatever was short. Taking the advantages over
the kept sessions only ("session") keeps them centred, but chooses sessions by their length, so a
group trains as if its long sessions had never been sampled. Dropping the group keeps every trained
group exactly as GRPO defines it and costs its rollouts; either way a trace that does not fit teaches
nothing, and the remedy the warning names is a larger max_tokens_per_microbatch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from polar.trajectory import FORK_REASONS, views_from_protos
from polar.trajectory.call_stats import CALL_COUNTS, call_counts
from polar.v1 import common_pb2
from trainer.rollout_link import Group

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
