"""`polar train` with LoRA on the tiny model through the whole real stack (tests/integration/test_train.py's
run): each step pushes the adapter alone to the inference server, and `polar eval` scores the run's
checkpoint, base model plus adapter.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.polar_command import POLAR
from tests.helpers.train_runs import REPO, start_train, write_run
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_a_lora_run_pushes_its_adapter_alone_and_its_checkpoint_is_evaluated(tmp_path: Path) -> None:
    from polar import lora

    heldout = tmp_path / "heldout.jsonl"
    config = write_run(tmp_path, steps=2, lora_rank=8, lr=5e-2, heldout=heldout, eval_samples=2)
    heldout.write_text((tmp_path / "tasks.jsonl").read_text().splitlines(True)[0])
    run_dir = tmp_path / "run"
    process, lines = start_train(config, run_dir)
    try:
        lines.wait_for(r"train: done: 2 steps", timeout=600)
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["policy_version"] for row in rows] == [1, 2]
    # Rank 8 on every projection of the tiny model's 2 layers (hidden 64, KV 32, MLP 192), in fp32.
    adapter_bytes = (
        4 * 8 * 2 * sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 192), (64, 192), (192, 64)])
    )
    assert all(row["weight_sync_bytes"] == adapter_bytes for row in rows)
    step = run_dir / "checkpoints" / "step-000002"
    saved = lora.read_adapter(step / "tiny")
    assert saved.settings.rank == 8 and any(float(t.abs().max()) > 0 for t in saved.tensors.values())
    result = subprocess.run(
        [*POLAR, "eval", str(config), "--checkpoint", str(step), "--out", str(tmp_path / "eval.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["model"] == str(step / "tiny") and report["tasks"] == 1
