"""The run folder of `polar generate` and what goes in it: the attempts' task ids, each finished
attempt judged into its line and its SFT rows, the manifest.

DIR holds
    attempts.jsonl   one line per finished attempt: task, attempt, outcome, reward, accepted and why not
    accepted.jsonl   the SFT rows (export.py) of every accepted attempt
    manifest.json    the run: its settings, stack config, model, tokenizer, harnesses, counts, rate, time
and, with --format parquet or datasets, accepted.parquet or the accepted/ dataset folder, written from
accepted.jsonl at the end.

Resuming: attempts.jsonl is the record of what is done. An attempt's rows go to accepted.jsonl before
its line goes to attempts.jsonl, and rows of an attempt without a line (a run killed in between) are
dropped at the next start, so no attempt is counted or exported twice.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar import credentials
from polar.app.generate import export
from polar.app.generate.plan import Attempt, Tally, accepted, attempt_order, next_attempt
from polar.config import StackConfig
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2

ATTEMPTS_FILE = "attempts.jsonl"
ACCEPTED_FILE = "accepted.jsonl"
MANIFEST_FILE = "manifest.json"
ROLLOUT_STORE = "rollout.db"
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
        self.manifest: dict[str, Any] = (
            json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}
        )

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


# ------------------------------------------------------------------------------------ an attempt


def judge(
    trajectory: common_pb2.Trajectory, attempt: Attempt, tasks, threshold: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An attempt's line in attempts.jsonl, and its rows if it is accepted."""
    outcome = common_pb2.SessionOutcome.Name(trajectory.outcome).removeprefix("SESSION_OUTCOME_").lower()
    problems = export.failed_calls(trajectory)
    kept = accepted(outcome=outcome, reward=trajectory.reward, threshold=threshold, failed_calls=len(problems))
    name = tasks[attempt[0]].task_id or str(attempt[0])
    rows: list[dict[str, Any]] = []
    why = ""
    if kept:
        try:
            rows = [
                {"task_index": attempt[0], **row}
                for row in export.trajectory_rows(trajectory, task_id=name, attempt=attempt[1])
            ]
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


# -------------------------------------------------------------------------------------- the manifest


def work_left(folder: RunFolder, options: GenerateOptions, task_count: int) -> bool:
    """Whether some attempt is neither recorded nor ruled out by its task's cap."""
    records = folder.done()
    tally = tally_of(records)
    done = {(r["task_index"], r["attempt"]) for r in records}
    order = list(attempt_order(task_count, options.attempts, options.seed))
    return next_attempt(order, done, tally, {}, options.max_per_task) is not None


def tally_of(records: list[dict[str, Any]]) -> Tally:
    tally = Tally()
    for record in records:
        tally.add(record["task_index"], record["outcome"], record["accepted"])
    return tally


def check_same_run(manifest: dict[str, Any], options: GenerateOptions, task_count: int) -> None:
    """A folder resumed with other settings would mix two runs: refuse, naming the difference."""
    before = manifest.get("settings")
    if not before:
        return
    now = _settings(options, task_count)
    changed = [
        f"{key} {before.get(key)!r} -> {now[key]!r}"
        for key in ("tasks_file", "tasks", "seed", "accept")
        if before.get(key) != now[key]
    ]
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


def finish_manifest(folder: RunFolder, options: GenerateOptions, config: StackConfig, tasks, elapsed: float) -> None:
    records = folder.done()
    tally = tally_of(records)
    m = folder.manifest
    m["settings"] = _settings(options, len(tasks))
    m["stack_config"] = dataclasses.asdict(config) if not options.rollout else None
    m.setdefault("model", {})
    m["harnesses"] = _harnesses(tasks)
    m["counts"] = {
        "attempts": tally.attempts,
        "accepted": tally.accepted,
        "rows": _count_lines(folder.accepted_path),
        "outcomes": tally.outcomes,
    }
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


def model_info(inference: str) -> dict[str, Any]:
    """What the stack's inference server serves (GetModelInfo), for the manifest; {} without one."""
    if not inference:
        return {}
    import grpc

    with credentials.channel(inference, credentials.OPERATOR, credentials.for_commands()) as channel:
        try:
            info = (
                inference_pb2_grpc.InferenceServiceStub(channel)
                .GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30)
                .model_info
            )
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
        seen[key] = {
            "preset": task.harness.preset,
            "command": list(task.harness.command),
            "package": package,
            "version": _cli_version(task),
        }
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
