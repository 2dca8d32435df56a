"""`polar eval`: greedy pass@1 and sampled pass@k on the held-out tasks, through the same stack.

Each held-out task runs twice: once greedily (one session, temperature 0) and once as a group of
k = eval_samples sessions at the task's own sampling. A session passes when its reward reaches
pass_threshold. pass@k is the unbiased estimator 1 - C(n - c, k) / C(n, k) over the n sessions of
which c passed (with n = k it is "any of the k passed").

A run's evaluations (`polar eval --run-dir RUN`) live in its folder, one report per model:

    RUN/eval/base.json      the base model, before training
    RUN/eval/step-N.json    the checkpoint of step N
    RUN/eval.png            greedy pass@1, sampled pass@1 and pass@k of each, beside reward.png
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from polar import credentials
from polar.config import TrainerConfig
from polar.rollout.client import RolloutClient
from trainer.dataset import Dataset

POLL_S = 0.5


class EvaluationStopped(Exception):
    """The evaluation was asked to stop before every group was released."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k sessions drawn from n (c of which passed) passes."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 0 < k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class TaskScore:
    task: str  # the held-out task (its id in the file, or its line index)
    greedy_reward: float
    greedy_pass: bool
    sampled_rewards: list[float]
    sampled_passes: int


@dataclass(frozen=True)
class EvalReport:
    model: str
    tasks: int
    k: int
    greedy_pass_at_1: float
    sampled_pass_at_1: float
    pass_at_k: float
    reward_mean_greedy: float
    reward_mean_sampled: float
    seconds: float
    per_task: list[TaskScore]

    def table(self) -> str:
        rows = [
            ("model", self.model),
            ("held-out tasks", str(self.tasks)),
            ("greedy pass@1", f"{self.greedy_pass_at_1:.3f}"),
            ("sampled pass@1", f"{self.sampled_pass_at_1:.3f}"),
            (f"pass@{self.k}", f"{self.pass_at_k:.3f}"),
            ("mean reward (greedy / sampled)", f"{self.reward_mean_greedy:.3f} / {self.reward_mean_sampled:.3f}"),
            ("seconds", f"{self.seconds:.0f}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)


def evaluate(config: TrainerConfig, rollout_address: str, model: str, stop: threading.Event, out: TextIO) -> EvalReport:
    """Submit the held-out tasks (greedy and sampled), wait for every group, score them."""
    started = time.monotonic()
    k = config.eval_samples
    if k < 1:
        raise ValueError(f"[trainer] eval_samples must be >= 1, not {k}")
    greedy = Dataset(config.heldout, seed=config.seed, prefix="eval-greedy", group_size=1)
    sampled = Dataset(config.heldout, seed=config.seed, prefix="eval-sampled", group_size=k)
    tasks = []
    for n in range(len(greedy)):
        task = greedy.task(n)
        task.sampling.temperature = 0.0
        tasks.append(task)
        tasks.append(sampled.task(n))
    rollout = RolloutClient(rollout_address, credentials.TRAINER)
    results: dict[str, list[float]] = {}
    names: dict[str, str] = {}
    stream = rollout.groups("")
    try:
        rollout.submit(tasks)
        out.write(f"eval: {len(greedy)} held-out tasks, greedy and {k} samples each\n")
        out.flush()
        while len(results) < len(tasks):
            if stop.is_set():
                raise EvaluationStopped
            group = stream.next(POLL_S)
            if group is None:
                continue
            first = group.trajectories[0]
            results[first.task_id] = [t.reward for t in group.trajectories]
            names[first.task_id] = first.metadata.get("dataset_task", first.task_id)
            out.write(f"eval: {len(results)}/{len(tasks)} groups released\n")
            out.flush()
    finally:
        stream.close()
        rollout.close()
    scores = []
    for n in range(len(greedy)):
        g = results[greedy.task_id(n)]
        s = results[sampled.task_id(n)]
        scores.append(
            TaskScore(
                task=names[greedy.task_id(n)],
                greedy_reward=g[0],
                greedy_pass=g[0] >= config.pass_threshold,
                sampled_rewards=s,
                sampled_passes=sum(r >= config.pass_threshold for r in s),
            )
        )
    count = len(scores)
    return EvalReport(
        model=model,
        tasks=count,
        k=k,
        greedy_pass_at_1=sum(s.greedy_pass for s in scores) / count,
        sampled_pass_at_1=sum(s.sampled_passes / len(s.sampled_rewards) for s in scores) / count,
        pass_at_k=sum(pass_at_k(len(s.sampled_rewards), s.sampled_passes, k) for s in scores) / count,
        reward_mean_greedy=sum(s.greedy_reward for s in scores) / count,
        reward_mean_sampled=sum(sum(s.sampled_rewards) / len(s.sampled_rewards) for s in scores) / count,
        seconds=time.monotonic() - started,
        per_task=scores,
    )


def write_report(report: EvalReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=2) + "\n")


EVAL_FOLDER = "eval"
EVAL_PLOT = "eval.png"
BASE_LABEL = "base"
# What a comparison shows of each report: (row name, report key).
MEASURES = (("greedy pass@1", "greedy_pass_at_1"), ("sampled pass@1", "sampled_pass_at_1"), ("pass@k", "pass_at_k"))


def label_step(label: str) -> int:
    """The training step a report's label names: 0 for the base model, N for "step-N"."""
    if label == BASE_LABEL:
        return 0
    prefix, _, number = label.partition("-")
    if prefix != "step" or not number.isdigit():
        raise ValueError(f"an evaluation is labelled {BASE_LABEL!r} or 'step-N', not {label!r}")
    return int(number)


def read_reports(folder: Path) -> list[tuple[str, dict]]:
    """The reports of a run's eval folder as (label, report), base first, then by step."""
    reports = []
    for path in folder.glob("*.json"):
        try:
            step = label_step(path.stem)
        except ValueError:
            continue  # not one of the run's reports
        reports.append((step, path.stem, json.loads(path.read_text())))
    return [(label, report) for _, label, report in sorted(reports)]


def comparison_table(reports: list[tuple[str, dict]]) -> str:
    """One row per measure, one column per report (before training, then after each checkpoint)."""
    k = {report["k"] for _, report in reports}
    rows = [("", *(label for label, _ in reports))]
    for name, key in MEASURES:
        shown = name if key != "pass_at_k" else f"pass@{'/'.join(map(str, sorted(k)))}"
        rows.append((shown, *(f"{report[key]:.3f}" for _, report in reports)))
    rows.append(("held-out tasks", *(str(report["tasks"]) for _, report in reports)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:  # names to the left, numbers to the right
        cells = [cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  " + "  ".join(cells))
    return "\n".join(lines)
