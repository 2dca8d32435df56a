"""The rollout server's durable state: tasks, sessions, released groups and nodes in one SQLite file.

Every change is one transaction committed before the method returns (WAL, synchronous=FULL), and one
server owns a store at a time. A session's life, when a group is released, and the exceptions:
docs/design/rollout-server.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from polar import codec
from polar.v1 import common_pb2, rollout_pb2

SCHEMA_VERSION = 3
PENDING = rollout_pb2.SESSION_STATE_PENDING
INIT = rollout_pb2.SESSION_STATE_INIT
POSTRUN = rollout_pb2.SESSION_STATE_POSTRUN
DONE = rollout_pb2.SESSION_STATE_DONE
HELD_STATES = (INIT, rollout_pb2.SESSION_STATE_READY, rollout_pb2.SESSION_STATE_RUNNING, POSTRUN)
# Pools whose capacity bounds what a node holds: harness slots plus the prepared-runtime buffer.
DISPATCH_POOLS = ("running", "ready")

_SCHEMA = f"""
CREATE TABLE tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,    -- submission order
    task_id TEXT NOT NULL UNIQUE,
    priority INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    task BLOB NOT NULL,                       -- the normalized Task, serialized
    submitted_at REAL NOT NULL,
    released_seq INTEGER                      -- released_groups.seq; NULL until released
);
CREATE TABLE sessions (
    session_id TEXT PRIMARY KEY,              -- f"{{task_id}}.{{idx}}"
    task_seq INTEGER NOT NULL REFERENCES tasks (seq),
    idx INTEGER NOT NULL,                     -- index within the group, from 0
    priority INTEGER NOT NULL,                -- the task's, copied here for the dispatch index
    runtime_kind TEXT NOT NULL,               -- the task's runtime.kind, likewise
    state INTEGER NOT NULL,                   -- SessionState
    node_id TEXT NOT NULL DEFAULT '',         -- its node while held; the last one once DONE
    attempts INTEGER NOT NULL DEFAULT 0,      -- times dispatched
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    pending_since REAL,                       -- set while PENDING
    queued_s REAL NOT NULL DEFAULT 0,         -- seconds PENDING before the current dispatch
    init_s REAL NOT NULL DEFAULT 0,           -- the node's stage timings, as last reported
    ready_s REAL NOT NULL DEFAULT 0,
    running_s REAL NOT NULL DEFAULT 0,
    postrun_s REAL NOT NULL DEFAULT 0,
    call_count INTEGER NOT NULL DEFAULT 0,
    outcome INTEGER NOT NULL DEFAULT 0,       -- SessionOutcome, once DONE
    reward REAL NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    trajectory BLOB,                          -- zstd(serialized Trajectory), once DONE
    trajectory_bytes INTEGER NOT NULL DEFAULT 0,  -- its size before compression
    UNIQUE (task_seq, idx)
);
-- Dispatch order: priority, then submission, then index in the group.
CREATE INDEX pending_sessions ON sessions (priority DESC, task_seq, idx) WHERE state = {PENDING};
CREATE INDEX held_sessions ON sessions (node_id) WHERE state BETWEEN {INIT} AND {POSTRUN};
CREATE TABLE released_groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,    -- the results cursor
    task_seq INTEGER NOT NULL UNIQUE REFERENCES tasks (seq),
    released_at REAL NOT NULL
);
-- Calls a node reported in its heartbeats, kept until the session's result holds them: the calls of
-- an attempt whose node died become the result's abandoned_calls.
CREATE TABLE partial_calls (
    session_id TEXT NOT NULL REFERENCES sessions (session_id),
    attempt INTEGER NOT NULL,
    call_id TEXT NOT NULL,
    record BLOB NOT NULL,                     -- serialized CallRecord
    PRIMARY KEY (session_id, attempt, call_id)
);
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY,
    gateway_address TEXT NOT NULL,
    base_url TEXT NOT NULL,
    runtimes TEXT NOT NULL,                   -- JSON list of runtime kinds
    pools TEXT NOT NULL,                      -- JSON {{name: [capacity, depth]}}, as last reported
    registered_at REAL NOT NULL,
    secret_sha256 TEXT NOT NULL DEFAULT ''    -- of the secret RegisterNode issued with the id (hex);
                                              -- '' for a node of schema 2, which must register again
);
"""
# Schema 2 lacks the nodes' secrets: its nodes keep their sessions until they are declared dead.
_MIGRATE_FROM_2 = "ALTER TABLE nodes ADD COLUMN secret_sha256 TEXT NOT NULL DEFAULT ''"


# What a heartbeat reports of each session, in the order record_heartbeat compares them.
_PROGRESS_COLUMNS = ("state", "call_count", "init_s", "ready_s", "running_s", "postrun_s")
# Sessions a task's mean reward counts: finished, and not cancelled (those were never scored).
_SCORED = f"s.state = {DONE} AND s.outcome != {common_pb2.SESSION_OUTCOME_CANCELLED}"


class StoreError(Exception):
    """Base of the store's errors; raised itself when the file cannot be opened as a rollout store."""


class TaskExists(StoreError):
    def __init__(self, index: int, task_id: str) -> None:
        super().__init__(f"tasks[{index}].task_id: task {task_id!r} already exists")
        self.index = index
        self.task_id = task_id


class UnknownTask(StoreError, LookupError):
    pass


class UnknownSession(StoreError, LookupError):
    pass


class NotAssigned(StoreError):
    pass


class WrongNodeSecret(StoreError):
    pass


class InvalidCursor(StoreError, ValueError):
    pass


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    gateway_address: str
    base_url: str
    runtimes: tuple[str, ...]
    pools: dict[str, tuple[int, int]]  # name -> (capacity, depth)


@dataclass(frozen=True)
class Requeued:
    """Sessions taken back from a node: dispatched again, or finished after their last attempt."""

    pending: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    released_groups: int = 0


@dataclass(frozen=True)
class HeartbeatRecord:
    lost: Requeued  # held by the node here, missing from its heartbeat
    foreign: tuple[str, ...]  # listed by the node, yet not its own: it should drop them


@dataclass(frozen=True)
class CancelRecord:
    cancelled: int
    held: dict[str, list[str]]  # node id -> its sessions that must be told to stop
    released_groups: int


@dataclass(frozen=True)
class ReportTarget:
    """What the server adds to a reported trajectory; None from `report_target` when already DONE."""

    task: rollout_pb2.Task
    attempt: int
    queued_seconds: float


@dataclass(frozen=True)
class ReleasedGroup:
    seq: int
    trajectories: list[bytes]  # zstd(serialized Trajectory) each, in session index order


class RolloutStore:
    """The rollout server's state in the SQLite file at `path` (created when missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # Each task's harness preset by its seq, read from its Task once (a task never changes).
        self._presets: dict[int, str] = {}
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=0)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the rollout store {self.path}: {exc}") from exc
        self._db.row_factory = sqlite3.Row
        try:
            self._db.execute("PRAGMA locking_mode = EXCLUSIVE")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("PRAGMA foreign_keys = ON")
            # The first write takes the exclusive lock, kept until close: a second server fails here.
            with self._transaction() as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                self._db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA}; PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
            elif version == 2:
                self._db.executescript(
                    f"BEGIN IMMEDIATE; {_MIGRATE_FROM_2}; PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
                )
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} is a rollout store of schema version {version}; this Polar reads {SCHEMA_VERSION}"
                )
        except sqlite3.OperationalError as exc:
            self._db.close()
            if "locked" in str(exc):
                raise StoreError(f"the rollout store {self.path} is in use by another rollout server") from exc
            raise StoreError(f"cannot open the rollout store {self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(f"{self.path} is not a rollout store: {exc}") from exc
        except StoreError:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # --- tasks -------------------------------------------------------------------------------------

    def add_tasks(self, tasks: Sequence[rollout_pb2.Task], now: float) -> None:
        """Adds normalized, validated tasks and their PENDING sessions, all or none."""
        with self._transaction() as db:
            for index, task in enumerate(tasks):
                try:
                    cursor = db.execute(
                        "INSERT INTO tasks (task_id, priority, group_size, task, submitted_at) VALUES (?, ?, ?, ?, ?)",
                        (task.task_id, task.priority, task.group_size, task.SerializeToString(), now),
                    )
                except sqlite3.IntegrityError as exc:
                    raise TaskExists(index, task.task_id) from exc
                db.executemany(
                    "INSERT INTO sessions (session_id, task_seq, idx, priority, runtime_kind, state, pending_since)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        (f"{task.task_id}.{i}", cursor.lastrowid, i, task.priority, task.runtime.kind, PENDING, now)
                        for i in range(task.group_size)
                    ),
                )

    def task_statuses(self, task_ids: Sequence[str]) -> list[rollout_pb2.TaskStatus]:
        """Status of the given tasks (every task when empty), in submission order."""
        seqs = sorted(set(self._task_seqs(task_ids).values()))
        rows = self._db.execute(
            "SELECT t.seq, t.task_id, t.group_size, t.released_seq, s.state, COUNT(*) AS sessions,"
            f" TOTAL(CASE WHEN {_SCORED} THEN s.reward END) AS reward_sum,"
            f" COUNT(CASE WHEN {_SCORED} THEN 1 END) AS done"
            " FROM tasks t JOIN sessions s ON s.task_seq = t.seq"
            + (f" WHERE t.seq IN ({','.join('?' * len(seqs))})" if task_ids else "")
            + " GROUP BY t.seq, s.state ORDER BY t.seq",
            seqs,
        ).fetchall()
        statuses: dict[int, rollout_pb2.TaskStatus] = {}
        reward_sums: dict[int, tuple[float, int]] = {}  # seq -> (sum, count) of scored rewards
        for row in rows:
            status = statuses.get(row["seq"])
            if status is None:
                status = statuses[row["seq"]] = rollout_pb2.TaskStatus(
                    task_id=row["task_id"], group_size=row["group_size"], released=row["released_seq"] is not None
                )
            status.sessions_by_state[state_name(row["state"])] = row["sessions"]
            total, done = reward_sums.get(row["seq"], (0.0, 0))
            reward_sums[row["seq"]] = (total + row["reward_sum"], done + row["done"])
        for seq, (total, done) in reward_sums.items():
            statuses[seq].mean_reward = total / done if done else 0.0
        for seq, preset in self._task_presets(list(statuses)).items():
            statuses[seq].harness = preset
        return list(statuses.values())

    def _task_presets(self, seqs: Sequence[int]) -> dict[int, str]:
        """The harness preset of each task by its seq."""
        unread = [seq for seq in seqs if seq not in self._presets]
        for start in range(0, len(unread), 500):  # SQLite's limit on a statement's parameters
            chunk = unread[start : start + 500]
            rows = self._db.execute(f"SELECT seq, task FROM tasks WHERE seq IN ({','.join('?' * len(chunk))})", chunk)
            for row in rows:
                self._presets[row["seq"]] = rollout_pb2.Task.FromString(row["task"]).harness.preset
        return {seq: self._presets[seq] for seq in seqs}

    def _task_seqs(self, task_ids: Iterable[str]) -> dict[str, int]:
        known = {}
        missing = []
        for task_id in dict.fromkeys(task_ids):
            row = self._db.execute("SELECT seq FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
            if row is None:
                missing.append(task_id)
            else:
                known[task_id] = row["seq"]
        if missing:
            raise UnknownTask(f"no task {', '.join(map(repr, missing))}")
        return known

    # --- nodes -------------------------------------------------------------------------------------

    def add_node(self, node_id: str, request: rollout_pb2.RegisterNodeRequest, now: float, *, secret: str) -> None:
        """A registered node, proven by `secret` (only its hash is stored)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO nodes (node_id, gateway_address, base_url, runtimes, pools, registered_at, secret_sha256)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    node_id,
                    request.gateway_address,
                    request.base_url,
                    json.dumps(sorted(set(request.runtimes))),
                    _pools_json(request.pools),
                    now,
                    _digest(secret),
                ),
            )

    def node(self, node_id: str) -> NodeRecord | None:
        row = self._db.execute("SELECT * FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
        return None if row is None else _node_record(row)

    def has_secret(self, node_id: str) -> bool:
        """Whether the node is registered with a secret (False for unknown nodes and for those of a
        schema 2 store, registered before secrets)."""
        row = self._db.execute("SELECT secret_sha256 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
        return row is not None and row["secret_sha256"] != ""

    def check_node_secret(self, node_id: str, secret: str) -> None:
        """Raises WrongNodeSecret unless `secret` is the one the registered node `node_id` was
        issued (compared as hashes, in constant time)."""
        row = self._db.execute("SELECT secret_sha256 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
        stored = row["secret_sha256"] if row is not None else ""
        if not (stored and hmac.compare_digest(_digest(secret), stored)):
            raise WrongNodeSecret(
                f"node {node_id!r}: the node_secret sent is not the one RegisterNode issued with this id;"
                " refused, nothing changed"
            )

    def nodes(self) -> list[NodeRecord]:
        return [_node_record(row) for row in self._db.execute("SELECT * FROM nodes ORDER BY registered_at")]

    def record_heartbeat(
        self,
        node_id: str,
        pools: Sequence[rollout_pb2.PoolStatus],
        sessions: Sequence[rollout_pb2.SessionProgress],
        now: float,
        max_attempts: int,
    ) -> HeartbeatRecord:
        """Stores the node's pools and its sessions' progress; takes back the sessions it lost.
        Writes only what changed, so an idle node's heartbeats cost no disk writes."""
        listed = {progress.session_id: progress for progress in sessions}
        pools_json = _pools_json(pools)
        pools_changed = (
            self._db.execute("SELECT pools FROM nodes WHERE node_id = ?", (node_id,)).fetchone()["pools"] != pools_json
        )
        held = self._held(node_id)
        lost = [row for row in held if row["session_id"] not in listed]
        progressed = []
        new_calls = []
        for row in held:
            if (progress := listed.get(row["session_id"])) is not None:
                new_calls += [
                    (row["session_id"], row["attempts"], call.call_id, call.SerializeToString())
                    for call in progress.new_calls
                ]
                timings = progress.stage_timings
                values = (
                    progress.state,
                    progress.call_count,
                    timings.init_seconds,
                    timings.ready_seconds,
                    timings.running_seconds,
                    timings.postrun_seconds,
                )
                if values != tuple(row[column] for column in _PROGRESS_COLUMNS):
                    progressed.append((*values, row["session_id"]))
        requeued = Requeued()
        if pools_changed or lost or progressed or new_calls:
            with self._transaction() as db:
                db.execute("UPDATE nodes SET pools = ? WHERE node_id = ?", (pools_json, node_id))
                db.executemany(
                    "INSERT OR IGNORE INTO partial_calls (session_id, attempt, call_id, record) VALUES (?, ?, ?, ?)",
                    new_calls,
                )
                db.executemany(
                    f"UPDATE sessions SET {', '.join(f'{column} = ?' for column in _PROGRESS_COLUMNS)}"
                    " WHERE session_id = ?",
                    progressed,
                )
                requeued = self._take_back(lost, f"node {node_id} lost the session", now, max_attempts)
        mine = {row["session_id"] for row in held}
        foreign = []
        for session_id in listed.keys() - mine:
            row = self._db.execute("SELECT state, node_id FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            # A DONE session of this node is one whose report is being acknowledged: still its own.
            if row is None or row["state"] != DONE or row["node_id"] != node_id:
                foreign.append(session_id)
        return HeartbeatRecord(lost=requeued, foreign=tuple(sorted(foreign)))

    def dispatch(self, node_id: str, now: float) -> list[rollout_pb2.SessionAssignment]:
        """Assigns pending sessions to the node's free slots (its running + ready capacity minus the
        sessions it holds), by priority then submission order, among the runtime kinds it offers."""
        node = self.node(node_id)
        if node is None or not node.runtimes:
            return []
        capacity = sum(node.pools.get(name, (0, 0))[0] for name in DISPATCH_POOLS)
        free = capacity - len(self._held(node_id))
        if free <= 0:
            return []
        rows = self._db.execute(
            "SELECT s.session_id, s.attempts, s.pending_since, s.queued_s, t.task FROM sessions s"
            f" JOIN tasks t ON t.seq = s.task_seq WHERE s.state = {PENDING}"
            f" AND s.runtime_kind IN ({','.join('?' * len(node.runtimes))})"
            " ORDER BY s.priority DESC, s.task_seq, s.idx LIMIT ?",
            (*node.runtimes, free),
        ).fetchall()
        assignments = []
        if not rows:
            return assignments
        with self._transaction() as db:
            for row in rows:
                db.execute(
                    "UPDATE sessions SET state = ?, node_id = ?, attempts = attempts + 1, pending_since = NULL,"
                    " queued_s = ?, init_s = 0, ready_s = 0, running_s = 0, postrun_s = 0, call_count = 0"
                    " WHERE session_id = ?",
                    (INIT, node_id, row["queued_s"] + max(0.0, now - row["pending_since"]), row["session_id"]),
                )
                assignments.append(
                    rollout_pb2.SessionAssignment(
                        session_id=row["session_id"],
                        task=rollout_pb2.Task.FromString(row["task"]),
                        attempt=row["attempts"],
                    )
                )
        return assignments

    def cancels_for(self, node_id: str, exclude: Iterable[str] = ()) -> list[str]:
        """The node's sessions whose cancel was requested, but for `exclude`."""
        rows = self._db.execute(
            f"SELECT session_id FROM sessions WHERE node_id = ? AND state BETWEEN {INIT} AND {POSTRUN}"
            " AND cancel_requested ORDER BY task_seq, idx",
            (node_id,),
        )
        skip = set(exclude)
        return [row["session_id"] for row in rows if row["session_id"] not in skip]

    def remove_node(self, node_id: str, reason: str, now: float, max_attempts: int) -> Requeued:
        """Forgets a dead node; its sessions are dispatched again, or finished after their last attempt."""
        with self._transaction() as db:
            requeued = self._take_back(self._held(node_id), reason, now, max_attempts)
            db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
        return requeued

    def held_count(self, node_id: str) -> int:
        """Sessions assigned to the node and not yet reported."""
        return self._db.execute(
            f"SELECT COUNT(*) FROM sessions WHERE node_id = ? AND state BETWEEN {INIT} AND {POSTRUN}", (node_id,)
        ).fetchone()[0]

    def _held(self, node_id: str) -> list[sqlite3.Row]:
        return self._db.execute(
            f"SELECT * FROM sessions WHERE node_id = ? AND state BETWEEN {INIT} AND {POSTRUN} ORDER BY task_seq, idx",
            (node_id,),
        ).fetchall()

    def _take_back(self, rows: Sequence[sqlite3.Row], reason: str, now: float, max_attempts: int) -> Requeued:
        """Within a transaction: held sessions back to PENDING, or DONE when cancelled or out of attempts."""
        pending, finished, released = [], [], 0
        for row in rows:
            if row["cancel_requested"]:
                released += self._finish(row, common_pb2.SESSION_OUTCOME_CANCELLED, "", now)
                finished.append(row["session_id"])
            elif row["attempts"] >= max_attempts:
                error = f"{reason} (attempt {row['attempts']} of {max_attempts})"
                released += self._finish(row, common_pb2.SESSION_OUTCOME_FAILED, error, now)
                finished.append(row["session_id"])
            else:
                self._db.execute(
                    "UPDATE sessions SET state = ?, node_id = '', pending_since = ?, init_s = 0, ready_s = 0,"
                    " running_s = 0, postrun_s = 0, call_count = 0 WHERE session_id = ?",
                    (PENDING, now, row["session_id"]),
                )
                pending.append(row["session_id"])
        return Requeued(tuple(pending), tuple(finished), released)

    # --- finishing sessions ------------------------------------------------------------------------

    def cancel(self, task_ids: Sequence[str], session_ids: Sequence[str], now: float) -> CancelRecord:
        """Pending sessions become DONE (CANCELLED) now; held ones are marked for their node to stop.
        Raises UnknownTask / UnknownSession, cancelling nothing, if any id is unknown."""
        with self._transaction() as db:
            seqs = self._task_seqs(task_ids)
            rows = {}
            for seq in seqs.values():
                for row in db.execute("SELECT * FROM sessions WHERE task_seq = ? ORDER BY idx", (seq,)):
                    rows[row["session_id"]] = row
            missing = []
            for session_id in dict.fromkeys(session_ids):
                row = db.execute("SELECT * FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
                if row is None:
                    missing.append(session_id)
                else:
                    rows[session_id] = row
            if missing:
                raise UnknownSession(f"no session {', '.join(map(repr, missing))}")
            cancelled, released = 0, 0
            held: dict[str, list[str]] = {}
            for session_id, row in rows.items():
                if row["state"] == PENDING:
                    released += self._finish(row, common_pb2.SESSION_OUTCOME_CANCELLED, "", now)
                    cancelled += 1
                elif row["state"] in HELD_STATES and not row["cancel_requested"]:
                    db.execute("UPDATE sessions SET cancel_requested = 1 WHERE session_id = ?", (session_id,))
                    held.setdefault(row["node_id"], []).append(session_id)
                    cancelled += 1
        return CancelRecord(cancelled, held, released)

    def report_target(self, node_id: str, session_id: str) -> ReportTarget | None:
        """What a report of the session by the node gets from the server; None if the session is
        DONE already (a repeated report). Raises UnknownSession, or NotAssigned when the node does
        not hold it."""
        row = self._db.execute(
            "SELECT s.state, s.node_id, s.attempts, s.queued_s, t.task FROM sessions s"
            " JOIN tasks t ON t.seq = s.task_seq WHERE s.session_id = ?",
            (session_id,),
        ).fetchone()
        if row is None:
            raise UnknownSession(f"no session {session_id!r}")
        if row["state"] == DONE:
            return None
        if row["state"] not in HELD_STATES or row["node_id"] != node_id:
            holder = f"node {row['node_id']}" if row["state"] in HELD_STATES else "no node (it waits to be dispatched)"
            raise NotAssigned(f"session {session_id!r} is not held by node {node_id!r} but by {holder}")
        return ReportTarget(rollout_pb2.Task.FromString(row["task"]), row["attempts"], row["queued_s"])

    def record_report(
        self,
        node_id: str,
        session_id: str,
        attempt: int,
        trajectory: common_pb2.Trajectory,
        zstd_trajectory: bytes,
        now: float,
    ) -> int:
        """Stores a session's result (`zstd_trajectory` compresses `trajectory`); returns the groups
        released (0 or 1). A session DONE meanwhile is left as it is; one taken back meanwhile raises
        NotAssigned."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                raise UnknownSession(f"no session {session_id!r}")
            if row["state"] == DONE:
                return 0
            if row["state"] not in HELD_STATES or row["node_id"] != node_id or row["attempts"] != attempt:
                raise NotAssigned(f"session {session_id!r} was taken back from node {node_id!r} during its report")
            abandoned = self._take_partial_calls(session_id, before_attempt=attempt)
            if abandoned:
                trajectory = common_pb2.Trajectory.FromString(trajectory.SerializeToString())
                trajectory.abandoned_calls.extend(abandoned)
                zstd_trajectory = codec.compress(trajectory.SerializeToString())
            timings = trajectory.stage_timings
            db.execute(
                "UPDATE sessions SET init_s = ?, ready_s = ?, running_s = ?, postrun_s = ? WHERE session_id = ?",
                (
                    timings.init_seconds,
                    timings.ready_seconds,
                    timings.running_seconds,
                    timings.postrun_seconds,
                    session_id,
                ),
            )
            return self._store_result(
                row["task_seq"],
                session_id,
                trajectory.outcome,
                trajectory.reward,
                len(trajectory.calls),
                trajectory.error,
                zstd_trajectory,
                trajectory.ByteSize(),
                now,
            )

    def _finish(self, row: sqlite3.Row, outcome: int, error: str, now: float) -> int:
        """Within a transaction: the session DONE with an empty trajectory saying how it ended;
        returns the groups released (0 or 1)."""
        task = rollout_pb2.Task.FromString(
            self._db.execute("SELECT task FROM tasks WHERE seq = ?", (row["task_seq"],)).fetchone()["task"]
        )
        queued = row["queued_s"] + (max(0.0, now - row["pending_since"]) if row["state"] == PENDING else 0.0)
        trajectory = common_pb2.Trajectory(
            trajectory_id=row["session_id"],
            session_id=row["session_id"],
            task_id=task.task_id,
            group_id=task.task_id,
            weight=1.0,
            outcome=outcome,
            error=error,
            builder=task.builder,
            stage_timings=common_pb2.StageTimings(
                queued_seconds=queued,
                init_seconds=row["init_s"],
                ready_seconds=row["ready_s"],
                running_seconds=row["running_s"],
                postrun_seconds=row["postrun_s"],
            ),
            metadata=task.metadata,
            attempt=row["attempts"],
            abandoned_calls=self._take_partial_calls(row["session_id"]),
        )
        self._db.execute(
            "UPDATE sessions SET queued_s = ?, pending_since = NULL WHERE session_id = ?", (queued, row["session_id"])
        )
        serialized = trajectory.SerializeToString()
        return self._store_result(
            row["task_seq"],
            row["session_id"],
            outcome,
            0.0,
            row["call_count"],
            error,
            codec.compress(serialized),
            len(serialized),
            now,
        )

    def _take_partial_calls(self, session_id: str, before_attempt: int | None = None) -> list[common_pb2.CallRecord]:
        """Within a transaction: the session's heartbeat-reported calls (of attempts before
        `before_attempt`, or all), in attempt and call order; every stored row of it is deleted,
        since the result about to be stored holds what is kept."""
        limit = "" if before_attempt is None else " AND attempt < ?"
        arguments = (session_id,) if before_attempt is None else (session_id, before_attempt)
        rows = self._db.execute(
            f"SELECT record FROM partial_calls WHERE session_id = ?{limit} ORDER BY attempt, call_id", arguments
        ).fetchall()
        self._db.execute("DELETE FROM partial_calls WHERE session_id = ?", (session_id,))
        return [common_pb2.CallRecord.FromString(row["record"]) for row in rows]

    def _store_result(
        self,
        task_seq: int,
        session_id: str,
        outcome: int,
        reward: float,
        call_count: int,
        error: str,
        zstd_trajectory: bytes,
        trajectory_bytes: int,
        now: float,
    ) -> int:
        self._db.execute(
            "UPDATE sessions SET state = ?, outcome = ?, reward = ?, call_count = ?, error = ?, trajectory = ?,"
            " trajectory_bytes = ? WHERE session_id = ?",
            (DONE, outcome, reward, call_count, error, zstd_trajectory, trajectory_bytes, session_id),
        )
        unfinished = self._db.execute(
            f"SELECT COUNT(*) FROM sessions WHERE task_seq = ? AND state != {DONE}", (task_seq,)
        ).fetchone()[0]
        if unfinished:
            return 0
        cursor = self._db.execute("INSERT INTO released_groups (task_seq, released_at) VALUES (?, ?)", (task_seq, now))
        self._db.execute("UPDATE tasks SET released_seq = ? WHERE seq = ?", (cursor.lastrowid, task_seq))
        return 1

    # --- sessions and results ----------------------------------------------------------------------

    def session_status(self, session_id: str, now: float) -> rollout_pb2.SessionStatus:
        row = self._db.execute(
            "SELECT s.*, t.task_id FROM sessions s JOIN tasks t ON t.seq = s.task_seq WHERE s.session_id = ?",
            (session_id,),
        ).fetchone()
        if row is None:
            raise UnknownSession(f"no session {session_id!r}")
        pending = row["state"] == PENDING
        return rollout_pb2.SessionStatus(
            session_id=session_id,
            task_id=row["task_id"],
            node_id="" if pending else row["node_id"],
            state=row["state"],
            outcome=row["outcome"],
            reward=row["reward"],
            call_count=row["call_count"],
            stage_timings=common_pb2.StageTimings(
                queued_seconds=row["queued_s"] + (max(0.0, now - row["pending_since"]) if pending else 0.0),
                init_seconds=row["init_s"],
                ready_seconds=row["ready_s"],
                running_seconds=row["running_s"],
                postrun_seconds=row["postrun_s"],
            ),
            error=row["error"],
            attempts=row["attempts"],
        )

    def session_counts(self) -> dict[int, int]:
        """Sessions per SessionState (states with none left out)."""
        return dict(self._db.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state").fetchall())

    def last_release(self) -> int:
        """Cursor of the newest released group; 0 when none was released."""
        return self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM released_groups").fetchone()[0]

    def parse_cursor(self, cursor: str) -> int:
        """The release seq a results cursor stands for ("" = before the first)."""
        if cursor == "":
            return 0
        if not (cursor.isascii() and cursor.isdigit()):
            raise InvalidCursor(f"cursor {cursor!r} is not a results cursor (a decimal number)")
        seq = int(cursor)
        last = self.last_release()
        if seq > last:
            raise InvalidCursor(f"cursor {cursor!r} is past the last released group ({last}): not from this store")
        return seq

    def released_groups(
        self, after: int, *, max_groups: int, max_bytes: int, up_to: int | None = None
    ) -> list[ReleasedGroup]:
        """Released groups after cursor `after` (up to `up_to`), oldest first: at most `max_groups`,
        and no more than `max_bytes` of serialized trajectories, though always at least one group."""
        rows = self._db.execute(
            "SELECT g.seq, g.task_seq, SUM(s.trajectory_bytes) AS size FROM released_groups g"
            " JOIN sessions s ON s.task_seq = g.task_seq WHERE g.seq > ? AND g.seq <= ?"
            " GROUP BY g.seq ORDER BY g.seq LIMIT ?",
            (after, up_to if up_to is not None else 2**63 - 1, max_groups),
        ).fetchall()
        groups = []
        total = 0
        for row in rows:
            total += row["size"]
            if groups and total > max_bytes:
                break
            trajectories = [
                blob
                for (blob,) in self._db.execute(
                    "SELECT trajectory FROM sessions WHERE task_seq = ? ORDER BY idx", (row["task_seq"],)
                )
            ]
            groups.append(ReleasedGroup(row["seq"], trajectories))
        return groups


def state_name(state: int) -> str:
    """ "RUNNING" for SESSION_STATE_RUNNING, as TaskStatus.sessions_by_state keys them."""
    return rollout_pb2.SessionState.Name(state).removeprefix("SESSION_STATE_")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _pools_json(pools: Iterable[rollout_pb2.PoolStatus]) -> str:
    return json.dumps({pool.name: [pool.capacity, pool.depth] for pool in pools}, sort_keys=True)


def _node_record(row: sqlite3.Row) -> NodeRecord:
    return NodeRecord(
        node_id=row["node_id"],
        gateway_address=row["gateway_address"],
        base_url=row["base_url"],
        runtimes=tuple(json.loads(row["runtimes"])),
        pools={name: (capacity, depth) for name, (capacity, depth) in json.loads(row["pools"]).items()},
    )
