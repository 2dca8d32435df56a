"""What `polar status` and `polar results` print: the live nodes, the task table with its totals, and
trajectories as JSON Lines.

Pure functions over the RolloutService's messages, so the command line stays a thin loop of calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import json_format

from polar.codec import read_trajectory_batch
from polar.v1 import rollout_pb2

# TaskStatus.sessions_by_state keys, in the order a session passes them.
STATES = ("PENDING", "INIT", "READY", "RUNNING", "POSTRUN", "DONE")
# A node's pools (PoolStatus.name), in the order a session passes them.
POOLS = ("init", "ready", "running", "postrun")
BAR_WIDTH = 20


@dataclass(frozen=True)
class Totals:
    """Every task of a status answer, added up."""

    tasks: int
    released: int
    sessions: int
    by_state: dict[str, int]  # STATES -> sessions in that state
    mean_reward: float | None  # over the finished sessions; None while none has finished


def summarize(tasks: Sequence[rollout_pb2.TaskStatus]) -> Totals:
    by_state = {state: sum(task.sessions_by_state.get(state, 0) for task in tasks) for state in STATES}
    done = by_state["DONE"]
    # Each task's mean covers its finished sessions, so weighting by them gives the mean over all.
    reward_sum = sum(task.mean_reward * task.sessions_by_state.get("DONE", 0) for task in tasks)
    return Totals(
        tasks=len(tasks),
        released=sum(task.released for task in tasks),
        sessions=sum(task.group_size for task in tasks),
        by_state=by_state,
        mean_reward=reward_sum / done if done else None,
    )


def render_totals(totals: Totals) -> str:
    """One line: "3 tasks, 1 released; 6 sessions: 1 pending, 1 running, 4 done; mean reward 0.250"."""
    states = ", ".join(f"{count} {state.lower()}" for state, count in totals.by_state.items() if count)
    reward = "none finished yet" if totals.mean_reward is None else f"{totals.mean_reward:.3f}"
    return (
        f"{_count(totals.tasks, 'task')}, {totals.released} released; "
        f"{_count(totals.sessions, 'session')}{': ' + states if states else ''}; mean reward {reward}"
    )


def render_status(tasks: Sequence[rollout_pb2.TaskStatus], *, bars: bool = False, max_rows: int | None = None) -> str:
    """The table of tasks (submission order) and a totals line; `bars` adds a progress bar of finished
    sessions to each row and to the totals. With more tasks than `max_rows`, released tasks are left
    out first and counted below the table."""
    if not tasks:
        return "no tasks"
    totals = summarize(tasks)
    shown = _rows_to_show(tasks, max_rows)
    header = ["task", "group", *(state.lower() for state in STATES), "reward", "released"]
    rows = [header] + [_row(tasks[i]) for i in shown]
    if bars:
        header.append("progress")
        for row, i in zip(rows[1:], shown):
            row.append(_bar(tasks[i].sessions_by_state.get("DONE", 0), tasks[i].group_size))
    words = [header.index("task"), header.index("released")] + ([header.index("progress")] if bars else [])
    lines = _columns(rows, left=tuple(words)).splitlines()
    if len(shown) < len(tasks):
        shown_set = set(shown)
        hidden = [task for i, task in enumerate(tasks) if i not in shown_set]
        lines.append(f"... and {_count(len(hidden), 'more task')} ({sum(task.released for task in hidden)} released)")
    total_line = "total: " + render_totals(totals)
    if bars:
        total_line += "  " + _bar(totals.by_state["DONE"], totals.sessions)
    lines.append(total_line)
    return "\n".join(lines)


def render_nodes(nodes: Sequence[rollout_pb2.NodeInfo]) -> str:
    """The live nodes (registration order): sessions held, each pool's depth/capacity, heartbeat age,
    and the credential each registered with."""
    if not nodes:
        return "no live nodes: sessions wait for one (`polar serve node`, or `polar up`)"
    header = ["node", "sessions", *POOLS, "heartbeat", "credential"]
    rows = [header]
    for node in nodes:
        pools = {pool.name: f"{pool.depth}/{pool.capacity}" for pool in node.pools}
        # 0 while a heartbeat is open: the node is waiting for work right now.
        heartbeat = f"{node.seconds_since_heartbeat:.1f} s ago" if node.seconds_since_heartbeat else "now"
        rows.append(
            [
                node.node_id,
                str(node.session_count),
                *(pools.get(name, "-") for name in POOLS),
                heartbeat,
                _credential(node),
            ]
        )
    return _columns(rows, left=(0, len(header) - 2, len(header) - 1))


def render_envoys(response: rollout_pb2.ListUpstreamsResponse) -> str:
    """Envoy's upstreams (cluster, address, draining) and each Envoy with the endpoint version it
    acknowledged against the version it should have, each with the credential it joined or
    connected with; "" when there are none."""
    if not response.upstreams and not response.envoys:
        return ""  # a rollout server no Envoy or upstream has used: nothing to show
    rows = [["upstream", "cluster", "address", "envoy", "state", "heartbeat", "credential"]]
    for u in response.upstreams:
        state = "draining" if u.draining else "serving"
        heartbeat = f"{u.seconds_since_heartbeat:.1f} s ago"
        rows.append([u.upstream_id, u.cluster, u.address, u.envoy or "every", state, heartbeat, _credential(u)])
    lines = [_columns(rows, left=tuple(range(7)))] if response.upstreams else []
    rows = [["envoy", "connected", "version", "acknowledged", "credential", "rejected"]]
    for e in response.envoys:
        rejected = f"{e.rejected_version}: {e.error}" if e.rejected_version else "-"
        connected = "yes" if e.connected else "no"
        rows.append([e.node_id, connected, e.version or "-", e.acknowledged_version or "-", _credential(e), rejected])
    if response.envoys:
        lines.append(_columns(rows, left=tuple(range(6))))
    return "\n\n".join(lines)


def trajectory_lines(zstd_trajectories: bytes) -> list[str]:
    """A WatchResults batch as JSON Lines: one Trajectory per line in the protobuf JSON mapping.
    Fields at their zero value are written too, so a reward of 0 reads as 0, not as a missing key."""
    return [
        json.dumps(
            json_format.MessageToDict(trajectory, always_print_fields_with_no_presence=True),
            separators=(",", ":"),
            ensure_ascii=False,
        )
        for trajectory in read_trajectory_batch(zstd_trajectories)
    ]


def _row(task: rollout_pb2.TaskStatus) -> list[str]:
    done = task.sessions_by_state.get("DONE", 0)
    return [
        task.task_id,
        str(task.group_size),
        *(str(task.sessions_by_state.get(state, 0)) for state in STATES),
        f"{task.mean_reward:.3f}" if done else "-",
        "yes" if task.released else "no",
    ]


def _credential(info: rollout_pb2.NodeInfo | rollout_pb2.UpstreamInfo | rollout_pb2.EnvoyInfo) -> str:
    """Which credential a node, upstream or Envoy came with: "NAME (ROLE)" for one issued by name,
    "stack's own (ROLE)" for the stack's own token, "-" where the server checks none."""
    if not info.credential_role:
        return "-"
    name = info.credential or "stack's own"
    return f"{name} ({info.credential_role})"


def _columns(rows: list[list[str]], left: tuple[int, ...]) -> str:
    """rows as aligned columns: those in `left` left-aligned (names, words), the others right-aligned
    under their headers (numbers)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    aligned = (
        "  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )
    return "\n".join(line.rstrip() for line in aligned)


def _rows_to_show(tasks: Sequence[rollout_pb2.TaskStatus], max_rows: int | None) -> list[int]:
    """Indices of the tasks that get a row, in submission order."""
    if max_rows is None or len(tasks) <= max_rows:
        return list(range(len(tasks)))
    # One row goes to the "... and N more" line.
    keep = max(max_rows - 1, 0)
    unreleased_first = sorted(range(len(tasks)), key=lambda i: tasks[i].released)
    return sorted(unreleased_first[:keep])


def _bar(done: int, total: int) -> str:
    filled = BAR_WIDTH * done // total if total else 0
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
