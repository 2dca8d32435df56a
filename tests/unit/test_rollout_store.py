"""polar.rollout.store over real SQLite files: durability across reopening, dispatch order and
capacity, taking sessions back, cancels, reports, group release and result batches; a state machine
drives random operation sequences and checks the session life cycle's invariants after each."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from polar import codec
from polar.rollout.store import (
    SCHEMA_VERSION,
    InvalidCursor,
    NotAssigned,
    RolloutStore,
    StoreError,
    TaskExists,
    UnknownSession,
    UnknownTask,
    WrongNodeSecret,
)
from polar.rollout.tasks import normalize_task
from polar.v1 import common_pb2, rollout_pb2

PENDING, INIT, RUNNING, POSTRUN, DONE = (
    rollout_pb2.SESSION_STATE_PENDING,
    rollout_pb2.SESSION_STATE_INIT,
    rollout_pb2.SESSION_STATE_RUNNING,
    rollout_pb2.SESSION_STATE_POSTRUN,
    rollout_pb2.SESSION_STATE_DONE,
)
COMPLETED, CANCELLED, FAILED = (
    common_pb2.SESSION_OUTCOME_COMPLETED,
    common_pb2.SESSION_OUTCOME_CANCELLED,
    common_pb2.SESSION_OUTCOME_FAILED,
)


def task(task_id: str, group_size: int = 1, priority: int = 0, runtime: str = "local") -> rollout_pb2.Task:
    return normalize_task(
        rollout_pb2.Task(
            task_id=task_id,
            instruction="x",
            group_size=group_size,
            priority=priority,
            harness=rollout_pb2.HarnessSpec(preset="codex"),
            runtime=rollout_pb2.RuntimeSpec(kind=runtime, image="i" if runtime == "docker" else ""),
        )
    )


def add_node(store: RolloutStore, node_id: str, running: int = 1, ready: int = 0, runtimes=("local",)) -> None:
    request = rollout_pb2.RegisterNodeRequest(
        gateway_address="127.0.0.1:1",
        pools=[
            rollout_pb2.PoolStatus(name="running", capacity=running),
            rollout_pb2.PoolStatus(name="ready", capacity=ready),
        ],
        runtimes=runtimes,
    )
    store.add_node(node_id, request, 0.0, secret=f"{node_id}-secret")


def report(store: RolloutStore, node_id: str, session_id: str, reward: float = 1.0, now: float = 0.0) -> int:
    target = store.report_target(node_id, session_id)
    trajectory = common_pb2.Trajectory(session_id=session_id, outcome=COMPLETED, reward=reward)
    return store.record_report(
        node_id, session_id, target.attempt, trajectory, codec.compress(trajectory.SerializeToString()), now
    )


def state(store: RolloutStore, session_id: str) -> rollout_pb2.SessionStatus:
    return store.session_status(session_id, now=1000.0)


@pytest.fixture
def store(tmp_path):
    opened = RolloutStore(tmp_path / "rollout.db")
    yield opened
    opened.close()


# --- the file -----------------------------------------------------------------------------------------


def test_reopening_keeps_tasks_results_and_nodes(tmp_path):
    path = tmp_path / "rollout.db"
    store = RolloutStore(path)
    store.add_tasks([task("t", 2)], now=1.0)
    add_node(store, "n", running=2)
    store.dispatch("n", now=2.0)
    report(store, "n", "t.0", reward=0.5)
    store.close()

    store = RolloutStore(path)
    assert [node.node_id for node in store.nodes()] == ["n"]
    assert (state(store, "t.0").state, state(store, "t.0").reward) == (DONE, 0.5)
    assert (state(store, "t.1").state, state(store, "t.1").node_id) == (INIT, "n")
    report(store, "n", "t.1")
    assert store.last_release() == 1
    store.close()


def test_a_store_in_use_is_refused(store):
    with pytest.raises(StoreError, match="in use by another rollout server"):
        RolloutStore(store.path)


def test_a_file_that_is_not_a_store_is_refused(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="is not a rollout store"):
        RolloutStore(junk)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("PRAGMA user_version = 7")
    with pytest.raises(StoreError, match=f"schema version 7; this Polar reads {SCHEMA_VERSION}"):
        RolloutStore(other)
    with pytest.raises(StoreError, match="cannot open the rollout store"):
        RolloutStore(tmp_path / "missing-folder" / "rollout.db")


def test_the_file_is_in_wal_mode_with_full_sync(store):
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_node_s_secret_is_kept_hashed_and_checked_across_reopening(tmp_path):
    path = tmp_path / "rollout.db"
    store = RolloutStore(path)
    add_node(store, "n")
    add_node(store, "m")
    store.check_node_secret("n", "n-secret")
    store.close()
    assert b"n-secret" not in b"".join(file.read_bytes() for file in tmp_path.iterdir())

    store = RolloutStore(path)
    store.check_node_secret("n", "n-secret")
    for node_id, secret in (("n", "m-secret"), ("n", ""), ("x", ""), ("x", "n-secret")):
        with pytest.raises(WrongNodeSecret, match=f"node '{node_id}': the node_secret sent is not the one"):
            store.check_node_secret(node_id, secret)
    assert (store.has_secret("n"), store.has_secret("x")) == (True, False)
    store.close()


def test_a_schema_2_store_is_migrated_and_its_nodes_must_register_again(tmp_path):
    path = tmp_path / "rollout.db"
    store = RolloutStore(path)
    store.add_tasks([task("t")], now=0.0)
    add_node(store, "old")
    store.dispatch("old", now=0.0)
    store.close()
    db = sqlite3.connect(path)  # the nodes table as schema 2 had it
    db.execute("ALTER TABLE nodes DROP COLUMN secret_sha256")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()

    store = RolloutStore(path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert [node.node_id for node in store.nodes()] == ["old"]
    assert not store.has_secret("old")
    with pytest.raises(WrongNodeSecret):
        store.check_node_secret("old", "")
    assert (state(store, "t.0").state, state(store, "t.0").node_id) == (INIT, "old")
    add_node(store, "new")
    store.check_node_secret("new", "new-secret")
    store.close()


# --- tasks and dispatch -------------------------------------------------------------------------------


def test_add_tasks_is_all_or_nothing(store):
    store.add_tasks([task("a")], now=0.0)
    with pytest.raises(TaskExists) as raised:
        store.add_tasks([task("b"), task("c"), task("a")], now=0.0)
    assert (raised.value.index, str(raised.value)) == (2, "tasks[2].task_id: task 'a' already exists")
    assert [status.task_id for status in store.task_statuses([])] == ["a"]
    with pytest.raises(UnknownTask, match="no task 'b'"):
        store.task_statuses(["b"])


def test_a_tasks_status_names_its_harness(store):
    command = task("b")
    command.harness.preset = "command"
    store.add_tasks([task("a"), command], now=0.0)
    assert [(s.task_id, s.harness) for s in store.task_statuses([])] == [("a", "codex"), ("b", "command")]
    assert [s.harness for s in store.task_statuses(["b"])] == ["command"]


@given(
    st.lists(st.tuples(st.integers(-2, 2), st.integers(1, 3), st.sampled_from(["local", "docker"])), max_size=8),
    st.integers(1, 4),
)
@settings(max_examples=40)
def test_dispatch_follows_priority_then_submission_then_index(tasks, slots):
    with tempfile.TemporaryDirectory() as folder:
        store = RolloutStore(Path(folder) / "rollout.db")
        try:
            store.add_tasks(
                [task(f"t{i}", size, priority, kind) for i, (priority, size, kind) in enumerate(tasks)], 0.0
            )
            add_node(store, "local-node", running=slots)
            dispatched = []
            while batch := store.dispatch("local-node", now=1.0):
                assert len(batch) <= slots
                assert store.dispatch("local-node", now=1.0) == []  # full until something is reported
                dispatched += [assignment.session_id for assignment in batch]
                for assignment in batch:
                    report(store, "local-node", assignment.session_id)
            expected = sorted(
                ((-priority, i, index), f"t{i}.{index}")
                for i, (priority, size, kind) in enumerate(tasks)
                if kind == "local"
                for index in range(size)
            )
            assert dispatched == [session_id for _, session_id in expected]
        finally:
            store.close()


def test_free_slots_count_running_and_ready_capacity_minus_held_sessions(store):
    store.add_tasks([task("t", 6)], now=0.0)
    add_node(store, "n", running=2, ready=1)
    assert [a.session_id for a in store.dispatch("n", now=0.0)] == ["t.0", "t.1", "t.2"]
    report(store, "n", "t.1")
    assert [a.session_id for a in store.dispatch("n", now=0.0)] == ["t.3"]
    store.record_heartbeat(
        "n", [rollout_pb2.PoolStatus(name="running", capacity=4)], progress("t.0", "t.2", "t.3"), 0.0, 3
    )
    assert [a.session_id for a in store.dispatch("n", now=0.0)] == ["t.4"]  # now 4 + 0 slots


def progress(*session_ids: str, state: int = RUNNING) -> list[rollout_pb2.SessionProgress]:
    return [rollout_pb2.SessionProgress(session_id=session_id, state=state) for session_id in session_ids]


def test_queued_time_adds_up_over_attempts(store):
    store.add_tasks([task("t")], now=100.0)
    assert store.session_status("t.0", now=101.0).stage_timings.queued_seconds == 1.0
    add_node(store, "n")
    [assignment] = store.dispatch("n", now=103.5)
    assert assignment.attempt == 0
    assert store.session_status("t.0", now=200.0).stage_timings.queued_seconds == 3.5
    store.remove_node("n", "node n stopped responding", now=110.0, max_attempts=3)
    add_node(store, "m")
    [assignment] = store.dispatch("m", now=112.0)
    assert assignment.attempt == 1
    status = store.session_status("t.0", now=300.0)
    assert (status.stage_timings.queued_seconds, status.attempts, status.node_id) == (5.5, 2, "m")
    assert store.report_target("m", "t.0").queued_seconds == 5.5


# --- taking sessions back -----------------------------------------------------------------------------


def test_a_dead_nodes_sessions_are_pending_again_failed_or_cancelled(store):
    store.add_tasks([task("again"), task("last"), task("stop")], now=0.0)
    add_node(store, "n", running=3)
    store.dispatch("n", now=0.0)
    store.cancel([], ["stop.0"], now=0.0)
    with store._transaction() as db:  # "last" is on its last attempt
        db.execute("UPDATE sessions SET attempts = 2 WHERE session_id = 'last.0'")
    requeued = store.remove_node("n", "node n stopped responding", now=5.0, max_attempts=2)
    assert (requeued.pending, requeued.finished, requeued.released_groups) == (("again.0",), ("last.0", "stop.0"), 2)
    assert (state(store, "again.0").state, state(store, "again.0").node_id) == (PENDING, "")
    failed = state(store, "last.0")
    assert (failed.state, failed.outcome, failed.error) == (DONE, FAILED, "node n stopped responding (attempt 2 of 2)")
    assert (state(store, "stop.0").outcome, state(store, "stop.0").error) == (CANCELLED, "")
    assert store.node("n") is None


def test_heartbeat_takes_back_unlisted_sessions_and_names_foreign_ones(store):
    store.add_tasks([task("t", 3)], now=0.0)
    add_node(store, "n", running=2)
    add_node(store, "m", running=1)
    store.dispatch("n", now=0.0)
    store.dispatch("m", now=0.0)
    beat = store.record_heartbeat("n", [], progress("t.0", "t.2", "x.0"), now=1.0, max_attempts=3)
    assert beat.lost.pending == ("t.1",)
    assert beat.foreign == ("t.2", "x.0")
    assert state(store, "t.0").state == RUNNING


def test_an_idle_heartbeat_writes_nothing(store):
    add_node(store, "n")
    pools = [rollout_pb2.PoolStatus(name="running", capacity=1), rollout_pb2.PoolStatus(name="ready", capacity=0)]
    changes = store._db.total_changes
    store.record_heartbeat("n", pools, [], now=1.0, max_attempts=3)
    assert store._db.total_changes == changes


# --- cancels, reports, release ------------------------------------------------------------------------


def test_cancel_counts_pending_and_held_sessions_once(store):
    store.add_tasks([task("t", 3)], now=0.0)
    add_node(store, "n", running=1)
    store.dispatch("n", now=0.0)
    record = store.cancel(["t"], ["t.0", "t.1"], now=1.0)
    assert (record.cancelled, record.held, record.released_groups) == (3, {"n": ["t.0"]}, 0)
    assert store.cancel(["t"], [], now=1.0).cancelled == 0
    assert store.cancels_for("n") == ["t.0"] and store.cancels_for("n", exclude=["t.0"]) == []
    with pytest.raises(UnknownSession, match="no session 'u.0'"):
        store.cancel([], ["u.0"], now=1.0)


def test_a_report_needs_the_holder_and_a_repeat_changes_nothing(store):
    store.add_tasks([task("t", 2)], now=0.0)
    add_node(store, "n", running=1)
    add_node(store, "m", running=1)
    store.dispatch("n", now=0.0)
    with pytest.raises(NotAssigned, match="not held by node 'm' but by node n"):
        store.report_target("m", "t.0")
    with pytest.raises(NotAssigned, match="waits to be dispatched"):
        store.report_target("n", "t.1")
    with pytest.raises(UnknownSession):
        store.report_target("n", "t.5")
    assert report(store, "n", "t.0", reward=0.5) == 0
    assert store.report_target("n", "t.0") is None
    trajectory = common_pb2.Trajectory(outcome=COMPLETED, reward=9.0)
    assert store.record_report("n", "t.0", 1, trajectory, codec.compress(b""), 0.0) == 0
    assert state(store, "t.0").reward == 0.5


def test_a_report_for_a_session_taken_back_meanwhile_is_refused(store):
    store.add_tasks([task("t")], now=0.0)
    add_node(store, "n")
    store.dispatch("n", now=0.0)
    target = store.report_target("n", "t.0")
    store.remove_node("n", "gone", now=1.0, max_attempts=3)
    trajectory = common_pb2.Trajectory(outcome=COMPLETED)
    with pytest.raises(NotAssigned, match="taken back"):
        store.record_report("n", "t.0", target.attempt, trajectory, codec.compress(b""), 2.0)


def test_groups_release_once_all_sessions_are_done_with_cursors_in_order(store):
    store.add_tasks([task("a", 2), task("b"), task("c")], now=0.0)
    add_node(store, "n", running=4)
    store.dispatch("n", now=0.0)
    assert report(store, "n", "a.0") == 0
    assert report(store, "n", "b.0") == 1
    assert report(store, "n", "a.1") == 1
    assert store.cancel(["c"], [], now=0.0).released_groups == 0  # held: its node must stop it first
    assert [(s.task_id, s.released) for s in store.task_statuses([])] == [("a", True), ("b", True), ("c", False)]
    groups = store.released_groups(0, max_groups=10, max_bytes=1 << 20)
    assert [g.seq for g in groups] == [1, 2]
    assert [len(g.trajectories) for g in groups] == [1, 2]  # b released first, then a's two sessions
    first = common_pb2.Trajectory.FromString(codec.decompress(groups[1].trajectories[0], max_bytes=1 << 20))
    assert first.session_id == "a.0"


def test_result_batches_respect_group_and_byte_limits(store):
    store.add_tasks([task(f"t{i}") for i in range(4)], now=0.0)
    add_node(store, "n", running=4)
    store.dispatch("n", now=0.0)
    for i in range(4):
        report(store, "n", f"t{i}.0")
    assert [g.seq for g in store.released_groups(0, max_groups=3, max_bytes=1 << 20)] == [1, 2, 3]
    assert [g.seq for g in store.released_groups(1, max_groups=3, max_bytes=1)] == [2]  # always one group
    assert [g.seq for g in store.released_groups(0, max_groups=9, max_bytes=1 << 20, up_to=2)] == [1, 2]
    assert store.released_groups(4, max_groups=9, max_bytes=1 << 20) == []


@pytest.mark.parametrize("cursor", ["x", "1.5", " 1", "-0", "٣", "5"])
def test_cursors_this_store_never_gave_out_are_invalid(store, cursor):
    store.add_tasks([task("t")], now=0.0)
    add_node(store, "n")
    store.dispatch("n", now=0.0)
    report(store, "n", "t.0")
    assert (store.parse_cursor(""), store.parse_cursor("0"), store.parse_cursor("1")) == (0, 0, 1)
    with pytest.raises(InvalidCursor):
        store.parse_cursor(cursor)


def test_mean_reward_counts_finished_sessions_but_not_cancelled_ones(store):
    store.add_tasks([task("t", 3)], now=0.0)
    add_node(store, "n", running=2)
    store.dispatch("n", now=0.0)
    report(store, "n", "t.0", reward=1.0)
    store.cancel([], ["t.2"], now=0.0)
    assert store.task_statuses(["t"])[0].mean_reward == 1.0
    report(store, "n", "t.1", reward=0.0)
    [status] = store.task_statuses(["t"])
    assert (status.mean_reward, dict(status.sessions_by_state), status.released) == (0.5, {"DONE": 3}, True)


# --- random operation sequences -----------------------------------------------------------------------


class StoreLifecycle(RuleBasedStateMachine):
    """Random submits, dispatches, heartbeats that drop sessions, reports, cancels and node deaths;
    the store must keep every session in one consistent place and release each group exactly once."""

    MAX_ATTEMPTS = 2

    nodes = Bundle("nodes")

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.TemporaryDirectory()
        self.store = RolloutStore(Path(self.folder.name) / "rollout.db")
        self.now = 0.0
        self.tasks: dict[str, int] = {}  # task id -> group size
        self.capacity: dict[str, int] = {}
        self.released: list[int] = []

    def teardown(self) -> None:
        self.store.close()
        self.folder.cleanup()

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    @rule(group_size=st.integers(1, 3), priority=st.integers(0, 1))
    def submit(self, group_size, priority):
        task_id = f"t{len(self.tasks)}"
        self.store.add_tasks([task(task_id, group_size, priority)], self.tick())
        self.tasks[task_id] = group_size

    @rule(target=nodes, slots=st.integers(1, 3))
    def register(self, slots):
        node_id = f"n{len(self.capacity)}"
        add_node(self.store, node_id, running=slots)
        self.capacity[node_id] = slots
        return node_id

    @rule(node_id=nodes)
    def dispatch(self, node_id):
        self.store.dispatch(node_id, self.tick())

    @rule(node_id=nodes, data=st.data())
    def heartbeat_losing_one(self, node_id, data):
        held = self.held(node_id)
        if held:
            held.remove(data.draw(st.sampled_from(held)))
        self.store.record_heartbeat(node_id, [], progress(*held), self.tick(), self.MAX_ATTEMPTS)

    @rule(node_id=nodes, data=st.data())
    def report_one(self, node_id, data):
        held = self.held(node_id)
        if held:
            report(self.store, node_id, data.draw(st.sampled_from(held)), now=self.tick())

    @rule(data=st.data())
    def cancel_a_task(self, data):
        if self.tasks:
            self.store.cancel([data.draw(st.sampled_from(sorted(self.tasks)))], [], self.tick())

    @rule(node_id=consumes(nodes))
    def node_dies(self, node_id):
        self.store.remove_node(node_id, f"node {node_id} stopped responding", self.tick(), self.MAX_ATTEMPTS)

    def held(self, node_id: str) -> list[str]:
        return [row["session_id"] for row in self.store._held(node_id)]

    @invariant()
    def sessions_are_consistent(self):
        nodes = {node.node_id for node in self.store.nodes()}
        held_per_node: dict[str, int] = {}
        for task_id, group_size in self.tasks.items():
            for index in range(group_size):
                status = self.store.session_status(f"{task_id}.{index}", self.now)
                assert 0 <= status.attempts <= self.MAX_ATTEMPTS
                if status.state == PENDING:  # and so to be dispatched again: an attempt must be left
                    assert status.node_id == "" and status.outcome == 0 and status.attempts < self.MAX_ATTEMPTS
                elif status.state == DONE:
                    assert status.outcome in (COMPLETED, CANCELLED, FAILED)
                else:
                    assert status.node_id in nodes and status.attempts >= 1
                    held_per_node[status.node_id] = held_per_node.get(status.node_id, 0) + 1
        for node_id, held in held_per_node.items():
            assert held <= self.capacity[node_id]

    @invariant()
    def groups_release_exactly_when_complete(self):
        statuses = {status.task_id: status for status in self.store.task_statuses([])}
        for task_id, group_size in self.tasks.items():
            status = statuses[task_id]
            assert status.released == (status.sessions_by_state.get("DONE", 0) == group_size)
        groups = self.store.released_groups(0, max_groups=1000, max_bytes=1 << 30)
        assert [g.seq for g in groups] == list(range(1, len(groups) + 1))
        assert len(groups) == sum(status.released for status in statuses.values())
        for group in groups:
            trajectories = [
                common_pb2.Trajectory.FromString(codec.decompress(t, max_bytes=1 << 20)) for t in group.trajectories
            ]
            assert all(t.outcome != 0 for t in trajectories)


TestStoreLifecycle = StoreLifecycle.TestCase
TestStoreLifecycle.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
