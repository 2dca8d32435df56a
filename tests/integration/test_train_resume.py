"""`polar train` stopped with Ctrl-C and run again in the same run folder (tests/integration/test_train.py's
run on the tiny model): the rerun resumes from the last checkpoint, trains no step twice and takes every
group the run submitted once, in order; nothing of the stopped run is left running.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.helpers.train_runs import processes_of, start_train, write_run
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_an_interrupted_run_resumes_without_retraining_or_skipping_a_group(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_run(tmp_path, steps=5)
    process, lines = start_train(config, run_dir)
    try:
        lines.wait_for(r"train: .*step 2/5", timeout=300)
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=300) == 130
    finally:
        process.kill()
    assert any("stopped after step" in line for line in lines.rest())
    assert processes_of(run_dir) == []
    trained = read_metrics(run_dir / "metrics.jsonl")
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    # The checkpoint holds the last completed step, whichever it was when Ctrl-C arrived.
    assert latest == f"step-{len(trained):06d}" and len(trained) >= 2

    process, lines = start_train(config, run_dir)
    try:
        lines.wait_for(rf"train: resuming after step {len(trained)}", timeout=300)
        lines.wait_for(r"train: done: 5 steps", timeout=600)
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[: len(trained)] == trained  # the steps before the stop were not trained again
    taken = [task for row in rows for task in row["task_ids"] + row["task_ids_dropped"]]
    # Every group the run submitted was taken once, in order: none repeated, none skipped.
    assert sorted(taken) == taken == [f"train-{n:06d}" for n in range(len(taken))]
    assert [row["policy_version"] for row in rows] == [1, 2, 3, 4, 5]
