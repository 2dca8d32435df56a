"""What `polar status` and `polar results` print (polar/rollout/report.py), from RolloutService messages."""

from __future__ import annotations

import json

from google.protobuf import json_format

from polar.codec import compress, trajectory_batch
from polar.rollout.report import render_nodes, render_status, render_totals, summarize, trajectory_lines
from polar.v1 import common_pb2, rollout_pb2


def _task(
    task_id: str, group: int, released: bool = False, mean_reward: float = 0.0, **states: int
) -> rollout_pb2.TaskStatus:
    return rollout_pb2.TaskStatus(
        task_id=task_id, group_size=group, sessions_by_state=states, released=released, mean_reward=mean_reward
    )


TASKS = [
    _task("alpha", 2, released=True, mean_reward=0.5, DONE=2),
    _task("beta", 4, mean_reward=1.0, PENDING=1, RUNNING=2, DONE=1),
]


def test_the_totals_weight_each_tasks_mean_by_its_finished_sessions():
    totals = summarize(TASKS)
    assert (totals.tasks, totals.released, totals.sessions) == (2, 1, 6)
    assert totals.by_state == {"PENDING": 1, "INIT": 0, "READY": 0, "RUNNING": 2, "POSTRUN": 0, "DONE": 3}
    assert totals.mean_reward == (0.5 * 2 + 1.0 * 1) / 3


def test_the_totals_line_names_only_the_states_in_use():
    assert render_totals(summarize(TASKS)) == (
        "2 tasks, 1 released; 6 sessions: 1 pending, 2 running, 3 done; mean reward 0.667"
    )
    assert render_totals(summarize([_task("a", 1, PENDING=1)])) == (
        "1 task, 0 released; 1 session: 1 pending; mean reward none finished yet"
    )


def test_the_table_has_a_row_per_task_in_submission_order():
    lines = render_status(TASKS).splitlines()
    assert lines[0].split() == [
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
    assert lines[1].split() == ["alpha", "2", "0", "0", "0", "0", "0", "2", "0.500", "yes"]
    assert lines[2].split() == ["beta", "4", "1", "0", "0", "2", "0", "1", "1.000", "no"]
    assert lines[3].startswith("total: 2 tasks, 1 released")
    # Columns line up: every "done" count ends where the header's "done" ends.
    end = lines[0].index("done") + len("done")
    assert lines[1][end - 1] == "2" and lines[2][end - 1] == "1"


def test_a_task_with_no_finished_session_has_no_reward_yet():
    [_, row, _] = render_status([_task("fresh", 3, PENDING=3)]).splitlines()
    assert row.split()[-2:] == ["-", "no"]


def test_progress_bars_count_finished_sessions():
    lines = render_status(TASKS, bars=True).splitlines()
    assert lines[0].endswith("progress")
    assert lines[1].endswith("[" + "#" * 20 + "] 2/2")
    assert lines[2].endswith("[" + "#" * 5 + "." * 15 + "] 1/4")
    assert lines[3].endswith("[" + "#" * 10 + "." * 10 + "] 3/6")


def test_a_short_screen_leaves_out_released_tasks_first():
    tasks = [_task(f"done{i}", 1, released=True, DONE=1) for i in range(5)] + [_task("busy", 1, RUNNING=1)]
    lines = render_status(tasks, max_rows=3).splitlines()
    ids = [line.split()[0] for line in lines[1:-2]]
    assert ids == ["done0", "busy"]  # submission order among those shown
    assert lines[-2] == "... and 4 more tasks (4 released)"
    assert lines[-1].startswith("total: 6 tasks, 5 released")


def test_no_tasks():
    assert render_status([]) == "no tasks"


def test_a_batch_becomes_one_json_object_per_trajectory_in_the_protobuf_mapping():
    trajectories = [
        common_pb2.Trajectory(
            trajectory_id="t.0",
            session_id="t.0",
            group_id="t",
            reward=1.0,
            attempt=1,
            harness_output="done ✓\n",
            outcome=common_pb2.SESSION_OUTCOME_COMPLETED,
        ),
        common_pb2.Trajectory(trajectory_id="t.1", session_id="t.1", group_id="t", min_policy_version=3),
    ]
    batch = compress(trajectory_batch(t.SerializeToString() for t in trajectories))

    lines = trajectory_lines(batch)

    assert len(lines) == 2 and all("\n" not in line for line in lines)
    first = json.loads(lines[0])
    assert first["trajectoryId"] == "t.0" and first["outcome"] == "SESSION_OUTCOME_COMPLETED"
    second = json.loads(lines[1])
    assert second["minPolicyVersion"] == "3"  # int64 is a string in the JSON mapping
    assert second["reward"] == 0 and second["outcome"] == "SESSION_OUTCOME_UNSPECIFIED"  # zero values written
    # Parsing the lines back gives the same messages.
    assert [json_format.Parse(line, common_pb2.Trajectory()) for line in lines] == trajectories


def test_the_nodes_table_shows_each_pools_depth_of_capacity_and_the_credential_it_registered_with():
    pools = [
        rollout_pb2.PoolStatus(name=name, capacity=c, depth=d)
        for name, c, d in [("init", 4, 1), ("ready", 8, 2), ("running", 16, 3), ("postrun", 4, 0)]
    ]
    nodes = [
        rollout_pb2.NodeInfo(
            node_id="node-a", pools=pools, session_count=6, seconds_since_heartbeat=0.0, credential_role="node"
        ),
        rollout_pb2.NodeInfo(
            node_id="node-bb",
            pools=pools[:1],
            session_count=12,
            seconds_since_heartbeat=2.5,
            credential="edge-7",
            credential_role="node",
        ),
        rollout_pb2.NodeInfo(node_id="node-c", session_count=0, seconds_since_heartbeat=1.0),
    ]
    assert render_nodes(nodes).splitlines() == [
        "node     sessions  init  ready  running  postrun  heartbeat  credential",
        "node-a          6   1/4    2/8     3/16      0/4  now        stack's own (node)",
        "node-bb        12   1/4      -        -        -  2.5 s ago  edge-7 (node)",
        "node-c          0     -      -        -        -  1.0 s ago  -",
    ]
    assert render_nodes([]).startswith("no live nodes")
