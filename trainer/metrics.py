"""What a training run shows and leaves behind: metrics.jsonl, TensorBoard events, reward.png, and
the progress line.

    RUN_DIR/metrics.jsonl   one JSON object per step (STEP_KEYS at least), appended as steps end
    RUN_DIR/tensorboard/    the same numbers as TensorBoard scalars (tensorboardX event files)
    RUN_DIR/reward.png      reward and pass rate per step, drawn when the run ends
    RUN_DIR/eval.png        held-out pass rates before and after training (`polar eval --run-dir`)

A rerun that resumes from a checkpoint first drops the lines of steps after that checkpoint, so the
file holds each step once, as the run that kept it computed it.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

# Every step's line has at least these keys.
STEP_KEYS = (
    "step",
    "reward_mean",
    "pass_rate",
    "loss",
    "clip_fraction",
    "kl",
    "policy_version",
    "tokens",
    "seconds_rollout_wait",
    "seconds_train",
    "seconds_weight_sync",
    "elapsed_s",
)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward.png"
BAR_WIDTH = 24


def sharing_metrics(micro_batches) -> dict[str, float]:
    """What shared-prefix packing saved in a step's micro-batches (a list per update): tokens the
    model computed, tokens the traces hold (a shared prompt counted once per trace), and the share of
    those not computed."""
    computed = sum(batch.tokens for batches in micro_batches for batch in batches)
    represented = sum(batch.represented_tokens for batches in micro_batches for batch in batches)
    return {
        "tokens_computed": computed,
        "tokens_represented": represented,
        "prefix_saving": 1 - computed / represented if represented else 0.0,
    }


class MetricsLog:
    """Appends step metrics to metrics.jsonl and TensorBoard."""

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        self.path = run_dir / METRICS_FILE
        self.rows = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
        # Rewrite without the steps the checkpoint does not hold (they will be trained again).
        self.path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        from tensorboardX import SummaryWriter

        self._board = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def append(self, row: Mapping[str, float]) -> None:
        missing = [key for key in STEP_KEYS if key not in row]
        if missing:
            raise ValueError(f"step metrics lack {', '.join(missing)}")
        row = dict(row)
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
        step = int(row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._board.add_scalar(key, value, step)
        self._board.flush()

    def close(self) -> None:
        self._board.close()


def read_metrics(path: Path) -> list[dict]:
    """The step rows of a metrics.jsonl ([] when there is none); a torn last line is dropped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def plot_rewards(rows: list[dict], out: Path) -> None:
    """reward_mean and pass_rate per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(steps, [row["reward_mean"] for row in rows], marker="o", label="mean reward")
    axes.plot(steps, [row["pass_rate"] for row in rows], marker="s", label="pass rate")
    axes.set_xlabel("step")
    axes.set_ylim(-0.05, 1.05 if all(0 <= row["reward_mean"] <= 1 for row in rows) else None)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    axes.set_title("polar train")
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def plot_evaluations(reports: list[tuple[str, dict]], out: Path) -> None:
    """Greedy pass@1, sampled pass@1 and pass@k of each evaluation (label, report), as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.evaluation import MEASURES

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    width = 0.8 / max(1, len(reports))
    for index, (label, report) in enumerate(reports):
        positions = [m + (index - (len(reports) - 1) / 2) * width for m in range(len(MEASURES))]
        values = [report[key] for _, key in MEASURES]
        bars = axes.bar(positions, values, width, label=label)
        axes.bar_label(bars, fmt="%.2f", fontsize=8)
    k = reports[-1][1]["k"] if reports else 0
    axes.set_xticks(range(len(MEASURES)), [name if key != "pass_at_k" else f"pass@{k}" for name, key in MEASURES])
    axes.set_ylim(0, 1.1)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(loc="upper left")
    axes.set_title("polar eval: held-out tasks")
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


class Progress:
    """One line per step into a log; on a terminal, a bar redrawn in place."""

    def __init__(self, total_steps: int, out: TextIO = sys.stdout) -> None:
        self.total = total_steps
        self.out = out
        self.tty = out.isatty()

    def step(self, row: Mapping[str, float]) -> None:
        step = int(row["step"])
        done = min(step, self.total) if self.total else 0
        filled = BAR_WIDTH * done // self.total if self.total else 0
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        text = (
            f"[{bar}] step {step}/{self.total or '∞'}  reward {row['reward_mean']:.3f}  "
            f"pass {100 * row['pass_rate']:.0f}%  loss {row['loss']:+.4f}  "
            f"v{int(row['policy_version'])}  {row['elapsed_s']:.0f} s"
        )
        if self.tty:
            width = shutil.get_terminal_size().columns
            self.out.write("\r\x1b[K" + text[: width - 1])
            if self.total and step >= self.total:
                self.out.write("\n")
        else:
            self.out.write("train: " + text + "\n")
        self.out.flush()

    def note(self, message: str) -> None:
        self.out.write(("\r\x1b[K" if self.tty else "") + "train: " + message + "\n")
        self.out.flush()
