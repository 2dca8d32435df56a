"""`polar train` runs as the training tests start them: the tiny model's task set (write anything;
the reward is the share of the reply's words that are ASCII lowercase letters) and the stack config
around it, the command started with its output read line by line, and the processes a run left
behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.polar_command import POLAR, Lines
from tests.helpers.stack_config import write_stack_config

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "examples" / "train" / "agent.py"
SCORE = REPO / "tests" / "fixtures" / "train_tiny" / "score.py"


def write_run(tmp_path: Path, steps: int, device: str = "cpu", groups_per_step: int = 2, **trainer) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    lines = [
        {
            "taskId": f"words{i}",
            "instruction": f"Write some words ({i}).",
            "groupSize": 8,
            "harness": {"preset": "command", "command": [sys.executable, str(AGENT)]},
            "runtime": {"kind": "local"},
            "evaluator": {"kind": "command", "command": f"{sys.executable} {SCORE}"},
            # Untruncated: the megatron backend trains on nothing else.
            "sampling": {"temperature": 1.0, "topP": 1.0, "maxTokensPerCall": 12},
            "timeoutSeconds": 120,
        }
        for i in range(4)
    ]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return write_stack_config(
        tmp_path / "train.toml",
        inference={"max_batch_size": 16},
        node={"init_workers": 2, "ready_slots": 4, "running_slots": 8, "postrun_workers": 2},
        trainer={
            "model": "tiny",
            "device": device,
            "dataset": tasks,
            "steps": steps,
            "groups_per_step": groups_per_step,
            "groups_ahead": 2,
            "lr": 2e-2,
            "seed": 0,
            "checkpoint_every": 2,
            **trainer,
        },
    )


def start_train(config: Path, run_dir: Path, *options: str) -> tuple[subprocess.Popen, Lines]:
    process = subprocess.Popen(
        [*POLAR, "train", str(config), "--run-dir", str(run_dir), *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, Lines(process.stdout)


def processes_of(run_dir: Path) -> list[int]:
    """Processes whose command line names the run folder (the trainer, the rollout server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(run_dir).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
