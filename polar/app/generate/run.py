"""`polar generate`: rejection sampling over rollouts, and `polar export` of released groups.

    polar generate TASKS.jsonl --attempts N --accept R [--max-per-task K] --out DIR
                   [--config stack.toml | --rollout HOST:PORT] [--seed S] [--concurrency C] [--format F]

Every attempt is one rollout session: a task of the file submitted alone (group size 1) under the id
`gen-RUN-TTTTTT-AAAA` (RUN: the output folder's run id, T: the task's line index, A: the attempt
number). Without `--rollout`, the stack `polar up` would start on `--config` runs for the duration,
its rollout store in DIR (so a rerun finds attempts it had submitted); with it, the attempts go to
that running stack. At most `--concurrency` attempts run at once (plan.py decides which is next).

What DIR holds, and how each finished attempt is judged and recorded: folder.py. A rerun with the
same DIR skips the attempts recorded there, waits for (rather than submits again) any the rollout
server already holds, and starts the rest.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from polar.app.generate import export
from polar.app.generate.folder import (
    ROLLOUT_STORE,
    GenerateError,
    GenerateOptions,
    RunFolder,
    check_same_run,
    finish_manifest,
    judge,
    model_info,
    parse_task_id,
    tally_of,
    task_id,
    work_left,
)
from polar.app.generate.plan import Attempt, Tally, attempt_order, next_attempt
from polar.config import StackConfig
from polar.rollout.client import RolloutClient, read_tasks
from polar.v1 import rollout_pb2

POLL_S = 0.5


# ---------------------------------------------------------------------------------------- the run


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
    options: GenerateOptions,
    tasks: list[rollout_pb2.Task],
    folder: RunFolder,
    address: str,
    stop: threading.Event,
    out: TextIO,
) -> Tally:
    """Every attempt not done yet, through the rollout server at `address`, recorded in `folder`."""
    run_id = folder.run_id()
    order = list(attempt_order(len(tasks), options.attempts, options.seed))
    records = folder.done()
    tally = tally_of(records)
    started: set[Attempt] = {(r["task_index"], r["attempt"]) for r in records}
    running: dict[str, Attempt] = {}
    # A long run rides out a rollout server that is not up yet or restarting, as the trainer does.
    with RolloutClient(address, waits=True) as rollout:
        for held in rollout.existing_task_ids():
            attempt = parse_task_id(held, run_id)
            if attempt is not None and attempt not in started:
                running[held] = attempt  # submitted by an earlier run: awaited, not sent again
                started.add(attempt)
        progress = Progress(len(order), out)
        stream = rollout.groups("")
        try:
            progress.show(tally, len(running))
            while True:
                _fill(options, tasks, rollout, run_id, order, started, tally, running)
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
                    line, rows = judge(trajectory, attempt, tasks, options.accept)
                    folder.record(line, rows)
                    tally.add(attempt[0], line["outcome"], line["accepted"])
                    progress.show(tally, len(running))
        finally:
            stream.close()
            progress.end()
    return tally


def _fill(
    options,
    tasks,
    rollout: RolloutClient,
    run_id: str,
    order,
    started: set[Attempt],
    tally: Tally,
    running: dict[str, Attempt],
) -> None:
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
        rollout.submit([task for task, _ in batch])
        running.update((task.task_id, attempt) for task, attempt in batch)


# ------------------------------------------------------------------------------------ entry points


def generate(config: StackConfig, options: GenerateOptions, out: TextIO = sys.stdout) -> int:
    """`polar generate`: the attempts on a running stack (`options.rollout`) or on the stack the
    config describes, started for the run; the manifest; the extra format. 0 when every attempt is
    done, 130 when stopped first (run again to resume)."""
    if options.attempts < 1:
        raise GenerateError(f"--attempts must be at least 1, not {options.attempts}")
    if options.max_per_task < 0:
        raise GenerateError(f"--max-per-task must be >= 0, not {options.max_per_task}")
    export.check_format(options.fmt)
    tasks = read_tasks(options.tasks_file)
    if options.concurrency == 0:
        options = dataclasses.replace(options, concurrency=config.node.running_slots)
    folder = RunFolder(options.out)
    check_same_run(folder.manifest, options, len(tasks))
    started = time.monotonic()
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def work(addresses: dict[str, str], on_end: Callable[[], None]) -> None:
        try:
            folder.manifest["model"] = model_info(addresses.get("inference", ""))
            outcome["tally"] = run_attempts(options, tasks, folder, addresses["rollout"], stop, out)
        except KeyboardInterrupt:
            pass
        except Exception as exc:
            outcome["error"] = exc
        finally:
            on_end()

    if not work_left(folder, options, len(tasks)):
        outcome["tally"] = tally_of(folder.done())  # every attempt is recorded: no stack to start
    elif options.rollout:
        try:
            work({"rollout": options.rollout}, lambda: None)
        except KeyboardInterrupt:
            stop.set()
    else:
        _run_on_stack(config, options, work, stop)
    elapsed = time.monotonic() - started
    finish_manifest(folder, options, config, tasks, elapsed)
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
    from polar.app.stack import request_stop, run_stack

    stack = dataclasses.replace(
        config,
        rollout=dataclasses.replace(config.rollout, store=str(options.out / ROLLOUT_STORE)),
        envoy=config.envoy
        if config.envoy.access_log != "-"
        else dataclasses.replace(config.envoy, access_log=str(options.out / "envoy-access.log")),
    )
    threads: list[threading.Thread] = []

    def start(addresses: dict[str, str]) -> None:
        threads.append(threading.Thread(target=work, args=(addresses, request_stop), daemon=True))
        threads[0].start()

    try:
        run_stack(stack, on_ready=start)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)  # the attempt in hand is recorded whole before the manifest is written


# --------------------------------------------------------------------------------------- polar export


def export_released(address: str, out: Path, *, min_reward: float, fmt: str, cursor: str = "") -> tuple[int, int, str]:
    """`polar export`: the rows of every released trajectory that completed with at least
    `min_reward` and no failed call, from `cursor` on; (trajectories read, rows written, last cursor)."""
    from polar import codec

    export.check_format(fmt)
    read = written = 0
    with tempfile.TemporaryDirectory(prefix="polar-export-") as scratch:
        jsonl = out if fmt == "jsonl" else Path(scratch) / "rows.jsonl"
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        jsonl.write_text("")
        with RolloutClient(address) as rollout:
            for batch in rollout.results(cursor, until_caught_up=True):
                trajectories = codec.read_trajectory_batch(batch.zstd_trajectories)
                read += len(trajectories)
                written += export.write_jsonl(export.rows_of(trajectories, min_reward), jsonl, append=True)
                cursor = batch.cursor
        export.convert(jsonl, fmt, out)
    return read, written, cursor
