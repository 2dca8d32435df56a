"""Run folders for the viewer's tests: recorded sessions put into a real rollout store the way a node
reports them (RegisterNode's record, dispatch, ReportSession's record), and `polar view` started on
a folder as a user starts it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from polar import codec
from polar.rollout.store import RolloutStore
from polar.trajectory.session_file import read_trajectory
from polar.v1 import common_pb2, rollout_pb2

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"
HARNESSES = ("claude-code", "codex", "gemini-cli", "pi", "qwen-code")
NODE = "replay-node"


def recorded(harness: str) -> common_pb2.Trajectory:
    return read_trajectory(FIXTURES / f"{harness}.json.zst")


def break_first_sampled_token(trajectory: common_pb2.Trajectory) -> int:
    """Changes the first trained token of the first trace, as a trace that is not what the engine
    sampled; returns its position."""
    trace = trajectory.traces[0]
    position = list(trace.loss_mask).index(1)
    trace.token_ids[position] = (trace.token_ids[position] + 1) % 49152
    return position


def store_sessions(
    path: Path, groups: dict[str, list[tuple[common_pb2.Trajectory, float]]], preset: str = "command"
) -> None:
    """A rollout store at `path` holding each task's group of finished sessions (trajectory, reward),
    released, as a node's reports leave them."""
    store = RolloutStore(path)
    try:
        tasks = [
            rollout_pb2.Task(
                task_id=task_id,
                instruction=f"instruction of {task_id}",
                group_size=len(sessions),
                harness=rollout_pb2.HarnessSpec(preset=preset),
                runtime=rollout_pb2.RuntimeSpec(kind="local"),
            )
            for task_id, sessions in groups.items()
        ]
        store.add_tasks(tasks, now=1.0)
        pools = [
            rollout_pb2.PoolStatus(name="running", capacity=1000),
            rollout_pb2.PoolStatus(name="ready", capacity=0),
        ]
        store.add_node(NODE, rollout_pb2.RegisterNodeRequest(runtimes=["local"], pools=pools), 1.0, secret="s")
        assigned = {a.session_id: a for a in store.dispatch(NODE, 2.0)}
        for task_id, sessions in groups.items():
            for index, (recorded_trajectory, reward) in enumerate(sessions):
                session_id = f"{task_id}.{index}"
                trajectory = common_pb2.Trajectory()
                trajectory.CopyFrom(recorded_trajectory)
                trajectory.session_id = trajectory.trajectory_id = session_id
                trajectory.task_id = trajectory.group_id = task_id
                trajectory.reward = reward
                trajectory.outcome = common_pb2.SESSION_OUTCOME_COMPLETED
                for call in trajectory.calls:
                    call.session_id = session_id
                attempt = assigned[session_id].attempt + 1
                store.record_report(
                    NODE, session_id, attempt, trajectory, codec.compress(trajectory.SerializeToString()), 3.0
                )
    finally:
        store.close()


@contextlib.contextmanager
def viewing(spawn, *args: str) -> Iterator[str]:
    """`polar view ARGS --port 0` running; yields its base URL."""
    process, lines = spawn("view", "--port", "0", *args)
    url = lines.wait_for(r"^polar view: serving (http://\S+/) ").group(1)
    yield url
    process.terminate()
    process.wait(timeout=30)


def url_port(url: str) -> int:
    return int(re.search(r":(\d+)/", url).group(1))
