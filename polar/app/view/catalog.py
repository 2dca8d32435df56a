"""What the viewer shows, read from where a run keeps it: the run folder (metrics.jsonl, and the
rollout store of a run that is over), or a running rollout server (its task status and its results
stream, which the viewer follows, so released groups appear while the page is open).

A rollout server holds its store file under an exclusive lock while it runs, so a live run is read
through the server (`--rollout`); a finished one straight from its file, opened read-only. Either
way the catalog keeps the same things: tasks in submission order, a summary of every session it
knows, and each finished session's trajectory (compressed, parsed only when a page asks for it).
`version` goes up whenever any of it changes; the page's event stream follows it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar import codec
from polar.v1 import common_pb2, rollout_pb2

log = logging.getLogger("polar.view")

ROLLOUT_STORE = "rollout.db"  # as `polar train` names it in its run folder (polar/app/train.py)
METRICS_FILE = "metrics.jsonl"  # trainer/metrics.py
TRAJECTORY_MAX_BYTES = 1 << 30
FIRST_STATUS_WAIT_S = 10.0  # how long opening the viewer waits for the first task status
STATUS_POLL_S = 1.0
RECONNECT_S = 2.0
DIALECT_HARNESS = {  # what a session's calls say of its harness when its task is not at hand
    common_pb2.DIALECT_OPENAI_CHAT: "openai_chat",
    common_pb2.DIALECT_OPENAI_RESPONSES: "openai_responses",
    common_pb2.DIALECT_ANTHROPIC_MESSAGES: "anthropic_messages",
    common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT: "google_generate_content",
}


def state_name(state: int) -> str:
    return rollout_pb2.SessionState.Name(state).removeprefix("SESSION_STATE_").lower()


def outcome_name(outcome: int) -> str:
    return common_pb2.SessionOutcome.Name(outcome).removeprefix("SESSION_OUTCOME_").lower()


def _timings(t: common_pb2.StageTimings) -> dict[str, float]:
    return {
        "queued": t.queued_seconds,
        "init": t.init_seconds,
        "ready": t.ready_seconds,
        "running": t.running_seconds,
        "postrun": t.postrun_seconds,
    }


@dataclass
class Catalog:
    """Tasks, session summaries and trajectories; every method is safe across threads."""

    source: str  # where it was read from, for the page
    problem: str = ""  # why nothing (or not everything) could be read; "" when all is well
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # task id -> row, submission order
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)  # session id -> summary
    _blobs: dict[str, bytes] = field(default_factory=dict)  # session id -> zstd(serialized Trajectory)
    version: int = 0
    cursor: str = ""  # the results stream's, for a live source
    lock: threading.Lock = field(default_factory=threading.Lock)

    def trajectory(self, session_id: str) -> common_pb2.Trajectory | None:
        with self.lock:
            blob = self._blobs.get(session_id)
        if blob is None:
            return None
        return common_pb2.Trajectory.FromString(codec.decompress(blob, max_bytes=TRAJECTORY_MAX_BYTES))

    def group_rewards(self, task_id: str) -> list[tuple[str, float, bool]]:
        """(session id, reward, finished) of the task's sessions, in group order."""
        with self.lock:
            rows = [s for s in self.sessions.values() if s["task_id"] == task_id]
        rows.sort(key=lambda s: s["index"])
        return [(s["session_id"], s["reward"], s["state"] == "done") for s in rows]

    def snapshot(self) -> tuple[list[dict], list[dict], int]:
        with self.lock:
            return list(self.tasks.values()), list(self.sessions.values()), self.version

    def refresh(self) -> None:
        """Reads what changed since the last call (a store file that was written); a live source
        refreshes itself."""

    def close(self) -> None:
        """Stops whatever follows the source."""


# ------------------------------------------------------------------------------------- the store


def _session_row(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "session_id": row["session_id"],
        "task_id": row["task_id"],
        "index": row["idx"],
        "state": state_name(row["state"]),
        "outcome": outcome_name(row["outcome"]) if row["state"] == rollout_pb2.SESSION_STATE_DONE else "",
        "reward": row["reward"],
        "attempts": row["attempts"],
        "calls": row["call_count"],
        "error": row["error"],
        "harness": row["preset"],
        "timings": {
            "queued": row["queued_s"],
            "init": row["init_s"],
            "ready": row["ready_s"],
            "running": row["running_s"],
            "postrun": row["postrun_s"],
        },
        "node": row["node_id"],
    }


class StoreCatalog(Catalog):
    """A rollout store file, read-only; read again whenever the file changes."""

    def __init__(self, path: Path) -> None:
        super().__init__(source=f"rollout store {path}")
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self.refresh()

    def _stat(self) -> tuple[float, int] | None:
        stamps = []
        for suffix in ("", "-wal"):
            try:
                st = Path(str(self.path) + suffix).stat()
            except FileNotFoundError:
                continue
            stamps.append((st.st_mtime, st.st_size))
        return max(stamps) if stamps else None

    def refresh(self) -> None:
        stamp = self._stat()
        if stamp is None:
            with self.lock:
                self.problem = f"no rollout store at {self.path}: nothing was rolled out in this folder yet"
            return
        if stamp == self._stamp:
            return
        try:
            tasks, sessions, blobs = self._read()
        except sqlite3.Error as exc:
            locked = "locked" in str(exc)
            with self.lock:
                self.problem = (
                    f"the rollout store {self.path} is in use by a running rollout server: view the live run with"
                    " --rollout HOST:PORT"
                    if locked
                    else f"cannot read the rollout store {self.path}: {exc}"
                )
            return
        with self.lock:
            self._stamp = stamp
            self.problem = ""
            self.tasks, self.sessions, self._blobs = tasks, sessions, blobs
            self.version += 1

    def _read(self) -> tuple[dict, dict, dict]:
        db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=0)
        db.row_factory = sqlite3.Row
        try:
            tasks: dict[str, dict] = {}
            presets: dict[int, str] = {}
            for row in db.execute(
                "SELECT seq, task_id, group_size, task, released_seq, submitted_at FROM tasks ORDER BY seq"
            ):
                task = rollout_pb2.Task.FromString(row["task"])
                presets[row["seq"]] = task.harness.preset
                tasks[row["task_id"]] = {
                    "task_id": row["task_id"],
                    "group_size": row["group_size"],
                    "released": row["released_seq"] is not None,
                    "harness": task.harness.preset,
                    "instruction": task.instruction[:300],
                    "submitted_at": row["submitted_at"],
                }
            sessions: dict[str, dict] = {}
            blobs: dict[str, bytes] = {}
            query = (
                "SELECT s.*, t.task_id, t.seq AS task_seq FROM sessions s JOIN tasks t ON t.seq = s.task_seq"
                " ORDER BY t.seq, s.idx"
            )
            for row in db.execute(query):
                summary = _session_row_with_preset(row, presets)
                sessions[row["session_id"]] = summary
                if row["trajectory"] is not None:
                    blobs[row["session_id"]] = bytes(row["trajectory"])
            _summarise_tasks(tasks, sessions)
            return tasks, sessions, blobs
        finally:
            db.close()


def _session_row_with_preset(row: sqlite3.Row, presets: dict[int, str]) -> dict[str, Any]:
    values = dict(zip(row.keys(), tuple(row)))
    values["preset"] = presets.get(row["task_seq"], "")
    return _session_row(values)  # type: ignore[arg-type]


def _summarise_tasks(tasks: dict[str, dict], sessions: dict[str, dict]) -> None:
    """Each task's sessions per state, its mean reward (cancelled sessions aside, as the server's
    TaskStatus), and its status in one word: released, running, pending or failed."""
    for task in tasks.values():
        task["states"] = {}
        task["rewards"] = []
    for s in sessions.values():
        task = tasks.get(s["task_id"])
        if task is None:
            continue
        task["states"][s["state"]] = task["states"].get(s["state"], 0) + 1
        if s["state"] == "done" and s["outcome"] != "cancelled":
            task["rewards"].append(s["reward"])
    for task in tasks.values():
        rewards = task.pop("rewards")
        task["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
        task["status"] = _task_status(task)


def _task_status(task: dict) -> str:
    if task["released"]:
        return "released"
    states = task["states"]
    if states and set(states) == {"pending"}:
        return "pending"
    return "running"


# ---------------------------------------------------------------------------- a rollout server


class RolloutCatalog(Catalog):
    """A running rollout server: its released groups from the results stream (followed from the
    start), every task's status polled, as the operator."""

    def __init__(self, address: str) -> None:
        super().__init__(source=f"rollout server {address}")
        self.address = address
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._threads = [
            threading.Thread(target=self._follow_results, name="view-results", daemon=True),
            threading.Thread(target=self._poll_status, name="view-status", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._ready.wait(FIRST_STATUS_WAIT_S)

    def close(self) -> None:
        self._stop.set()

    def _fail(self, message: str) -> None:
        with self.lock:
            if self.problem != message:
                self.problem = message
                self.version += 1

    def _follow_results(self) -> None:
        from polar.rollout.client import RolloutClient, RolloutError

        while not self._stop.is_set():
            try:
                with RolloutClient(self.address) as client:
                    stream = client.results(self.cursor)
                    for batch in stream:
                        self._add_batch(batch)
                        if self._stop.is_set():
                            stream.cancel()
                            return
            except RolloutError as exc:
                self._fail(f"the results stream: {exc}")
            except codec.CodecError as exc:
                self._fail(f"a results batch of {self.address} is unreadable: {exc}")
            self._stop.wait(RECONNECT_S)

    def _add_batch(self, batch: rollout_pb2.WatchResultsResponse) -> None:
        trajectories = codec.read_trajectory_batch(batch.zstd_trajectories)
        with self.lock:
            for trajectory in trajectories:
                index = int(trajectory.session_id.rsplit(".", 1)[-1]) if "." in trajectory.session_id else 0
                dialects = {DIALECT_HARNESS.get(c.dialect, "") for c in trajectory.calls} - {""}
                task = self.tasks.get(trajectory.task_id, {})
                self.sessions[trajectory.session_id] = {
                    "session_id": trajectory.session_id,
                    "task_id": trajectory.task_id,
                    "index": index,
                    "state": "done",
                    "outcome": outcome_name(trajectory.outcome),
                    "reward": trajectory.reward,
                    "attempts": trajectory.attempt,
                    "calls": len(trajectory.calls),
                    "error": trajectory.error,
                    "harness": task.get("harness") or ", ".join(sorted(dialects)),
                    "timings": _timings(trajectory.stage_timings),
                    "node": "",
                }
                self._blobs[trajectory.session_id] = codec.compress(trajectory.SerializeToString())
                if trajectory.task_id in self.tasks:
                    self.tasks[trajectory.task_id]["released"] = True
            self.cursor = batch.cursor
            self.problem = ""
            self._restate()
            self.version += 1

    def _poll_status(self) -> None:
        from polar.rollout.client import RolloutClient, RolloutError

        while not self._stop.is_set():
            try:
                with RolloutClient(self.address) as client:
                    while not self._stop.is_set():
                        response = client.call("GetTaskStatus", rollout_pb2.GetTaskStatusRequest())
                        self._set_statuses(response.tasks)
                        self._ready.set()
                        self._stop.wait(STATUS_POLL_S)
            except RolloutError as exc:
                self._fail(str(exc))
                self._ready.set()
            self._stop.wait(RECONNECT_S)

    def _set_statuses(self, statuses) -> None:
        with self.lock:
            before = {k: (v["states"], v["released"], v["harness"]) for k, v in self.tasks.items()}
            for status in statuses:
                row = self.tasks.setdefault(status.task_id, {"task_id": status.task_id, "instruction": ""})
                row["harness"] = status.harness
                row["group_size"] = status.group_size
                row["states"] = {name.lower(): count for name, count in status.sessions_by_state.items()}
                row["released"] = status.released or row.get("released", False)
                for index in range(status.group_size):
                    session_id = f"{status.task_id}.{index}"
                    if session_id not in self.sessions:
                        self.sessions[session_id] = _unfinished(session_id, status.task_id, index, status.harness)
            self._restate()
            after = {k: (v["states"], v["released"], v["harness"]) for k, v in self.tasks.items()}
            if after != before:
                self.version += 1

    def _restate(self) -> None:
        """Within the lock: the tasks' status words and mean rewards from the sessions known."""
        for task in self.tasks.values():
            task.setdefault("states", {})
            task.setdefault("group_size", 0)
        counts = {task_id: dict(task["states"]) for task_id, task in self.tasks.items()}
        _summarise_tasks(self.tasks, self.sessions)
        for task_id, task in self.tasks.items():
            if counts[task_id]:
                task["states"] = counts[task_id]  # the server's counts know the unreleased sessions' states
            task["status"] = _task_status(task)

    def session_status(self, session_id: str) -> dict[str, Any] | None:
        """The server's status of a session not yet in a released group (its state, calls so far)."""
        from polar.rollout.client import RolloutClient, RolloutError

        try:
            with RolloutClient(self.address) as client:
                request = rollout_pb2.GetSessionStatusRequest(session_id=session_id)
                status = client.call("GetSessionStatus", request).status
        except RolloutError:
            return None
        return {
            "session_id": status.session_id,
            "task_id": status.task_id,
            "state": state_name(status.state),
            "outcome": outcome_name(status.outcome) if status.state == rollout_pb2.SESSION_STATE_DONE else "",
            "reward": status.reward,
            "attempts": status.attempts,
            "calls": status.call_count,
            "error": status.error,
            "timings": _timings(status.stage_timings),
            "node": status.node_id,
        }


def _unfinished(session_id: str, task_id: str, index: int, harness: str) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "task_id": task_id,
        "index": index,
        "state": "unreleased",
        "outcome": "",
        "reward": 0.0,
        "attempts": 0,
        "calls": 0,
        "error": "",
        "harness": harness,
        "timings": {},
        "node": "",
    }


class EmptyCatalog(Catalog):
    """Nothing to read: the page says why."""

    def __init__(self, problem: str) -> None:
        super().__init__(source="nothing", problem=problem)
