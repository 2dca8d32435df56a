"""`polar generate`: rejection sampling over rollouts, and `polar export` of released groups.

    polar generate TASKS.jsonl --attempts N --accept R [--max-per-task K] --out DIR
                   [--config stack.toml | --rollout HOST:PORT] [--seed S] [--concurrency C] [--format F]

Every attempt is one rollout session: a task of the file submitted alone (group size 1) under the id
`gen-RUN-TTTTTT-AAAA` (RUN: the output folder's run id, T: the task's line index, A: the attempt
number). Without `--rollout`, the stack `polar up` would start on `--config` runs for the duration,
its rollout store in DIR (so a rerun finds attempts it had submitted); with it, the attempts go to
that running stack. At most `--concurrency` attempts run at once (plan.py decides which is next).

DIR holds
    attempts.jsonl   one line per finished attempt: task, attempt, outcome, reward, accepted and why not
    accepted.jsonl   the SFT rows (export.py) of every accepted attempt
    manifest.json    the run: its settings, stack config, model, tokenizer, harnesses, counts, rate, time
and, with --format parquet or datasets, accepted.parquet or the accepted/ dataset folder, written from
accepted.jsonl at the end.

Resuming: attempts.jsonl is the record of what is done; a rerun with the same DIR skips those
attempts, waits for (rather than submits again) any the rollout server already holds, and starts the
rest. An attempt's rows go to accepted.jsonl before its line goes to attempts.jsonl, and rows of an
attempt without a line (a run killed in between) are dropped at the next start, so no attempt is
counted or exported twice.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from polar import credentials
from polar.config import StackConfig
from polar.generate import export
from polar.generate.plan import Attempt, Tally, accepted, attempt_order, next_attempt
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2, rollout_pb2_grpc

ATTEMPTS_FILE = "attempts.jsonl"
ACCEPTED_FILE = "accepted.jsonl"
MANIFEST_FILE = "manifest.json"
ROLLOUT_STORE = "rollout.db"
POLL_S = 0.5
_TASK_ID = re.compile(r"^gen-(?P<run>[0-9a-f]+)-(?P<task>\d{6})-(?P<attempt>\d{4})$")


class GenerateError(ValueError):
    """A run that cannot start or go on; the message says why."""


@dataclass(frozen=True)
class GenerateOptions:
    tasks_file: str
    out: Path
    attempts: int  # attempts per task
    accept: float  # least reward of an accepted attempt
    max_per_task: int = 0  # most accepted attempts per task; 0 = no cap
    seed: int = 0
    concurrency: int = 0  # attempts running at once; 0 = [node] running_slots
    fmt: str = "jsonl"
    rollout: str = ""  # a running stack's rollout server; "" = start the stack
    config_path: str = ""


def task_id(run_id: str, attempt: Attempt) -> str:
    return f"gen-{run_id}-{attempt[0]:06d}-{attempt[1]:04d}"


def parse_task_id(value: str, run_id: str) -> Attempt | None:
    """The attempt a rollout task id names, if it is one of this run's."""
    match = _TASK_ID.match(value)
    if match is None or match["run"] != run_id:
        return None
    return int(match["task"]), int(match["attempt"])


# ------------------------------------------------------------------------------------- the folder


class RunFolder:
    """DIR: what was done (attempts.jsonl), what was kept (accepted.jsonl), the manifest."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.attempts_path = out / ATTEMPTS_FILE
        self.accepted_path = out / ACCEPTED_FILE
        self.manifest_path = out / MANIFEST_FILE
        self.manifest: dict[str, Any] = json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}

    def run_id(self) -> str:
        """The run's id, in its rollout task ids; made and written down on first use, so a rerun
        knows the attempts it had submitted."""
        if "run_id" not in self.manifest:
            self.manifest["run_id"] = secrets.token_hex(4)
            self.write_manifest()
        return self.manifest["run_id"]

    def done(self) -> list[dict[str, Any]]:
        """The attempts recorded so far; rows of attempts not recorded are dropped from accepted.jsonl."""
        records = list(export.read_jsonl(self.attempts_path)) if self.attempts_path.exists() else []
        recorded = {(r["task_index"], r["attempt"]) for r in records}
        if self.accepted_path.exists():
            rows = list(export.read_jsonl(self.accepted_path))
            kept = [row for row in rows if (row["task_index"], row["attempt"]) in recorded]
            if len(kept) != len(rows):
                export.write_jsonl(kept, self.accepted_path)
        else:
            self.accepted_path.touch()
        return records

    def record(self, line: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        if rows:
            export.write_jsonl(rows, self.accepted_path, append=True)
        export.write_jsonl([line], self.attempts_path, append=True)

    def write_manifest(self) -> None:
        scratch = self.manifest_path.with_suffix(".json.tmp")
        scratch.write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")
        os.replace(scratch, self.manifest_path)


# ---------------------------------------------------------------------------------------- the run


class _Link:
    """The rollout server, called as the operator (the `polar` commands' credentials)."""

    def __init__(self, address: str) -> None:
        from polar.rollout import client

        self.address = address
        self.channel = client.channel(address)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self._client = client

    def call(self, method: str, request):
        import grpc

        try:
            return getattr(self.stub, method)(request, timeout=60, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise self._client.rpc_error(method, self.address, exc) from None

    def close(self) -> None:
        self.channel.close()


class Progress:
    """attempts / accepted / rate: one redrawn bar on a terminal, else a line per finished attempt."""

    WIDTH = 30

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()

    def show(self, tally: Tally, running: int) -> None:
        done = min(tally.attempts, self.total)
        filled = self.WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = (
            f"generate [{bar}] {tally.attempts}/{self.total} attempts, {tally.accepted} accepted"
            f" ({100 * tally.rate:.1f}%), {running} running"
        )
        self.out.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.out.flush()

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def run_attempts(
    options: GenerateOptions, tasks: list[rollout_pb2.Task], folder: RunFolder, address: str, stop: threading.Event, out: TextIO
) -> Tally:
    """Every attempt not done yet, through the rollout server at `address`, recorded in `folder`."""
    from trainer.rollout_link import GroupStream

    run_id = folder.run_id()
    order = list(attempt_order(len(tasks), options.attempts, options.seed))
    records = folder.done()
    tally = _tally(records)
    started: set[Attempt] = {(r["task_index"], r["attempt"]) for r in records}
    link = _Link(address)
    running: dict[str, Attempt] = {}
    try:
        held = link.call("GetTaskStatus", rollout_pb2.GetTaskStatusRequest()).tasks
        for status in held:
            attempt = parse_task_id(status.task_id, run_id)
            if attempt is not None and attempt not in started:
                running[status.task_id] = attempt  # submitted by an earlier run: awaited, not sent again
                started.add(attempt)
        progress = Progress(len(order), out)
        stream = GroupStream(link, "")
        try:
            progress.show(tally, len(running))
            while True:
                _fill(options, tasks, link, run_id, order, started, tally, running)
                if not running:
                    break
                if stop.is_set():
                    raise KeyboardInterrupt
                group = stream.next(POLL_S)
                if group is None:
                    continue
                for trajectory in group.trajectories:
                    attempt = running.pop(trajectory.task_id, None)
                    if attempt is None:
                        continue  # another run's, or one recorded before
                    line, rows = _judge(trajectory, attempt, tasks, options.accept)
                    folder.record(line, rows)
                    tally.add(attempt[0], line["outcome"], line["accepted"])
                    progress.show(tally, len(running))
        finally:
            stream.close()
            progress.end()
    finally:
        link.close()
    return tally


def _fill(options, tasks, link: _Link, run_id: str, order, started: set[Attempt], tally: Tally, running: dict[str, Attempt]) -> None:
    per_task: dict[int, int] = {}
    for attempt in running.values():
        per_task[attempt[0]] = per_task.get(attempt[0], 0) + 1
    batch = []
    while len(running) + len(batch) < options.concurrency:
        attempt = next_attempt(order, started, tally, per_task, options.max_per_task)
        if attempt is None:
            break
        task = rollout_pb2.Task()
        task.CopyFrom(tasks[attempt[0]])
        task.metadata["generate_task"] = tasks[attempt[0]].task_id or str(attempt[0])
        task.metadata["generate_attempt"] = str(attempt[1])
        task.task_id = task_id(run_id, attempt)
        task.group_size = 1
        batch.append((task, attempt))
        started.add(attempt)
        per_task[attempt[0]] = per_task.get(attempt[0], 0) + 1
    if batch:
        link.call("SubmitTasks", rollout_pb2.SubmitTasksRequest(tasks=[task for task, _ in batch]))
        running.update((task.task_id, attempt) for task, attempt in batch)


def _judge(trajectory: common_pb2.Trajectory, attempt: Attempt, tasks, threshold: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An attempt's line in attempts.jsonl, and its rows if it is accepted."""
    outcome = common_pb2.SessionOutcome.Name(trajectory.outcome).removeprefix("SESSION_OUTCOME_").lower()
    problems = export.failed_calls(trajectory)
    kept = accepted(outcome=outcome, reward=trajectory.reward, threshold=threshold, failed_calls=len(problems))
    name = tasks[attempt[0]].task_id or str(attempt[0])
    rows: list[dict[str, Any]] = []
    why = ""
    if kept:
        try:
            rows = [{"task_index": attempt[0], **row} for row in export.trajectory_rows(trajectory, task_id=name, attempt=attempt[1])]
        except export.ExportError as exc:
            kept, why = False, f"cannot be exported: {exc}"
    elif outcome != "completed":
        why = f"{outcome}: {trajectory.error}" if trajectory.error else outcome
    elif problems:
        why = "; ".join(problems)
    else:
        why = f"reward {trajectory.reward:g} < {threshold:g}"
    timings = trajectory.stage_timings
    line = {
        "task_index": attempt[0],
        "task_id": name,
        "attempt": attempt[1],
        "session_id": trajectory.session_id,
        "outcome": outcome,
        "reward": trajectory.reward,
        "accepted": kept,
        "why_not": why,
        "calls": len(trajectory.calls),
        "rows": len(rows),
        "running_seconds": round(timings.running_seconds, 3),
    }
    return line, rows


# ------------------------------------------------------------------------------------ entry points


def generate(config: StackConfig, options: GenerateOptions, out: TextIO = sys.stdout) -> int:
    """`polar generate`: the attempts on a running stack (`options.rollout`) or on the stack the
    config describes, started for the run; the manifest; the extra format. 0 when every attempt is
    done, 130 when stopped first (run again to resume)."""
    from polar.rollout.client import read_tasks

    if options.attempts < 1:
        raise GenerateError(f"--attempts must be at least 1, not {options.attempts}")
    if options.max_per_task < 0:
        raise GenerateError(f"--max-per-task must be >= 0, not {options.max_per_task}")
    export.check_format(options.fmt)
    tasks = read_tasks(options.tasks_file)
    if options.concurrency == 0:
        options = dataclasses.replace(options, concurrency=config.node.running_slots)
    folder = RunFolder(options.out)
    _check_same_run(folder.manifest, options, len(tasks))
    started = time.monotonic()
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def work(addresses: dict[str, str], on_end: Callable[[], None]) -> None:
        try:
            folder.manifest["model"] = _model_info(addresses.get("inference", ""))
            outcome["tally"] = run_attempts(options, tasks, folder, addresses["rollout"], stop, out)
        except KeyboardInterrupt:
            pass
        except Exception as exc:  # noqa: BLE001 - reported by the main thread, in one line
            outcome["error"] = exc
        finally:
            on_end()

    if not _work_left(folder, options, len(tasks)):
        outcome["tally"] = _tally(folder.done())  # every attempt is recorded: no stack to start
    elif options.rollout:
        try:
            work({"rollout": options.rollout}, lambda: None)
        except KeyboardInterrupt:
            stop.set()
    else:
        _run_on_stack(config, options, work, stop)
    elapsed = time.monotonic() - started
    _finish_manifest(folder, options, config, tasks, elapsed)
    if "error" in outcome:
        error = outcome["error"]
        raise error if isinstance(error, (OSError, ValueError, LookupError)) else RuntimeError(str(error))
    tally = outcome.get("tally")
    if tally is None:
        print(f"polar generate: stopped; run again with --out {options.out} to resume", file=out)
        return 130
    written = export.convert(folder.accepted_path, options.fmt, export.output_path(folder.accepted_path, options.fmt))
    print(
        f"polar generate: {tally.attempts} attempts, {tally.accepted} accepted ({100 * tally.rate:.1f}%);"
        f" {written} and {folder.manifest_path}",
        file=out,
    )
    return 0


def _run_on_stack(config: StackConfig, options: GenerateOptions, work, stop: threading.Event) -> None:
    """The stack of `config` with its rollout store in the output folder, `work` run once it serves;
    the stack stops when `work` ends."""
    from polar.stack import run_stack

    ending = threading.Lock()
    finished = threading.Event()

    def on_end() -> None:
        with ending:
            if not finished.is_set():
                os.kill(os.getpid(), signal.SIGTERM)  # ends the supervision: the stack stops

    stack = dataclasses.replace(
        config,
        rollout=dataclasses.replace(config.rollout, store=str(options.out / ROLLOUT_STORE)),
        envoy=config.envoy if config.envoy.access_log != "-" else dataclasses.replace(config.envoy, access_log=str(options.out / "envoy-access.log")),
    )
    threads: list[threading.Thread] = []

    def start(addresses: dict[str, str]) -> None:
        threads.append(threading.Thread(target=work, args=(addresses, on_end), daemon=True))
        threads[0].start()

    try:
        run_stack(stack, on_ready=start)
    finally:
        with ending:
            finished.set()
            stop.set()
        for thread in threads:
            thread.join(timeout=30)  # the attempt in hand is recorded whole before the manifest is written


def _work_left(folder: RunFolder, options: GenerateOptions, task_count: int) -> bool:
    """Whether some attempt is neither recorded nor ruled out by its task's cap."""
    records = folder.done()
    tally = _tally(records)
    done = {(r["task_index"], r["attempt"]) for r in records}
    order = list(attempt_order(task_count, options.attempts, options.seed))
    return next_attempt(order, done, tally, {}, options.max_per_task) is not None


def _tally(records: list[dict[str, Any]]) -> Tally:
    tally = Tally()
    for record in records:
        tally.add(record["task_index"], record["outcome"], record["accepted"])
    return tally


def _check_same_run(manifest: dict[str, Any], options: GenerateOptions, task_count: int) -> None:
    """A folder resumed with other settings would mix two runs: refuse, naming the difference."""
    before = manifest.get("settings")
    if not before:
        return
    now = _settings(options, task_count)
    changed = [f"{key} {before.get(key)!r} -> {now[key]!r}" for key in ("tasks_file", "tasks", "seed", "accept") if before.get(key) != now[key]]
    if changed:
        raise GenerateError(f"{options.out} holds a run with other settings ({', '.join(changed)}): use another --out")


def _settings(options: GenerateOptions, task_count: int) -> dict[str, Any]:
    return {
        "tasks_file": str(Path(options.tasks_file).resolve()),
        "tasks": task_count,
        "attempts_per_task": options.attempts,
        "accept": options.accept,
        "max_per_task": options.max_per_task,
        "seed": options.seed,
        "concurrency": options.concurrency,
        "format": options.fmt,
        "rollout": options.rollout or "started by polar generate",
        "config": options.config_path,
    }


def _finish_manifest(folder: RunFolder, options: GenerateOptions, config: StackConfig, tasks, elapsed: float) -> None:
    records = folder.done()
    tally = _tally(records)
    m = folder.manifest
    m["settings"] = _settings(options, len(tasks))
    m["stack_config"] = dataclasses.asdict(config) if not options.rollout else None
    m.setdefault("model", {})
    m["harnesses"] = _harnesses(tasks)
    m["counts"] = {"attempts": tally.attempts, "accepted": tally.accepted, "rows": _count_lines(folder.accepted_path), "outcomes": tally.outcomes}
    m["acceptance_rate"] = round(tally.rate, 6)
    m["seconds"] = round(m.get("seconds", 0.0) + elapsed, 3)
    m["seconds_per_attempt"] = round(m["seconds"] / tally.attempts, 3) if tally.attempts else None
    running = [r.get("running_seconds", 0.0) for r in records]
    m["harness_seconds_per_attempt"] = round(sum(running) / len(running), 3) if running else None
    m["updated"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    folder.write_manifest()


def _count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _model_info(inference: str) -> dict[str, Any]:
    """What the stack's inference server serves (GetModelInfo), for the manifest; {} without one."""
    if not inference:
        return {}
    import grpc

    with credentials.channel(inference, credentials.OPERATOR, credentials.for_commands()) as channel:
        try:
            info = inference_pb2_grpc.InferenceServiceStub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30).model_info
        except grpc.RpcError:
            return {}
    return {
        "name": info.name,
        "engine": info.engine,
        "device": info.device,
        "tokenizer": info.tokenizer_path,
        "vocab_size": info.vocab_size,
        "context_length": info.context_length,
        "policy_version": info.policy_version,
    }


def _harnesses(tasks: list[rollout_pb2.Task]) -> list[dict[str, Any]]:
    """Each distinct harness of the task file, with the version of its CLI where one answers `--version`."""
    from polar.rollout.harness import PRESETS

    seen: dict[tuple, dict[str, Any]] = {}
    for task in tasks:
        key = (task.harness.preset, tuple(task.harness.command))
        if key in seen:
            continue
        preset = PRESETS.get(task.harness.preset)
        package = preset.package if preset is not None else ""
        seen[key] = {"preset": task.harness.preset, "command": list(task.harness.command), "package": package, "version": _cli_version(task)}
    return list(seen.values())


_CLI_BINARIES = {"codex": "codex", "claude-code": "claude", "qwen-code": "qwen", "gemini-cli": "gemini", "pi": "pi"}


def _cli_version(task: rollout_pb2.Task) -> str:
    binary = _CLI_BINARIES.get(task.harness.preset)
    path = shutil.which(binary) if binary else None
    if path is None:
        return ""
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""


# --------------------------------------------------------------------------------------- polar export


def export_released(address: str, out: Path, *, min_reward: float, fmt: str, cursor: str = "") -> tuple[int, int, str]:
    """`polar export`: the rows of every released trajectory that completed with at least
    `min_reward` and no failed call, from `cursor` on; (trajectories read, rows written, last cursor)."""
    from polar import codec

    export.check_format(fmt)
    link = _Link(address)
    read = written = 0
    with tempfile.TemporaryDirectory(prefix="polar-export-") as scratch:
        jsonl = out if fmt == "jsonl" else Path(scratch) / "rows.jsonl"
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        jsonl.write_text("")
        try:
            request = rollout_pb2.WatchResultsRequest(cursor=cursor, until_caught_up=True)
            for batch in _watch(link, request):
                trajectories = codec.read_trajectory_batch(batch.zstd_trajectories)
                read += len(trajectories)
                written += export.write_jsonl(export.rows_of(trajectories, min_reward), jsonl, append=True)
                cursor = batch.cursor
        finally:
            link.close()
        export.convert(jsonl, fmt, out)
    return read, written, cursor


def _watch(link: _Link, request):
    import grpc

    try:
        yield from link.stub.WatchResults(request)
    except grpc.RpcError as exc:
        raise link._client.rpc_error("WatchResults", link.address, exc) from None
