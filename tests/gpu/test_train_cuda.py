"""`polar train` on one GPU: the torch inference server and the torch trainer share the card.

Runs on the device machine only (`python -m pytest -m gpu tests/gpu`); skipped without CUDA. Two
steps of the tiny run of tests/integration/test_train.py, with the engine's CUDA graphs and the
trainer's weight pushes on the GPU: each step becomes the next policy version, and every trace the
run released is token-faithful to the calls it was built from.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from polar import codec
from polar.rollout.store import RolloutStore
from polar.trajectory import BuiltTrace, verify, views_from_protos
from polar.v1 import common_pb2
from tests.helpers.polar_command import POLAR
from tests.helpers.train_runs import REPO, write_run
from trainer.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_two_steps_of_polar_train_on_one_gpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_run(tmp_path, steps=2, device="cuda")
    config.write_text(config.read_text().replace("[inference]\n", '[inference]\ndevice = "cuda"\n', 1))
    result = subprocess.run(
        [*POLAR, "train", str(config), "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "train: done: 2 steps" in result.stdout, result.stdout[-3000:]

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["policy_version"] for row in rows] == [1, 2]
    assert all(row["tokens"] > 0 for row in rows)

    store = RolloutStore(run_dir / "rollout.db")
    try:
        groups = store.released_groups(0, max_groups=100, max_bytes=1 << 30)
    finally:
        store.close()
    trajectories = [
        common_pb2.Trajectory.FromString(codec.decompress(blob, max_bytes=1 << 30))
        for group in groups
        for blob in group.trajectories
    ]
    assert len(trajectories) >= 2 * 2 * 8  # two steps of two groups of eight sessions
    for trajectory in trajectories:
        assert trajectory.traces, trajectory.error
        report = verify(views_from_protos(trajectory.calls), [BuiltTrace.from_proto(t) for t in trajectory.traces])
        assert report.ok, report.render()
