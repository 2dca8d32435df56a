"""`polar train --backend megatron --gpus N` (tests/integration/test_train.py's run on the tiny model): the
trainer as a torchrun job of N ranks, full weights or a LoRA adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polar import credentials
from polar.v1 import trainer_pb2, trainer_pb2_grpc
from tests.helpers.train_runs import processes_of, start_train, write_run
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "device,lora_rank",
    [
        ("cpu", 0),
        ("cpu", 8),
        pytest.param(
            "cuda",
            0,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_polar_train_runs_the_megatron_backend_as_a_torchrun_job(tmp_path: Path, device: str, lora_rank: int) -> None:
    """`--backend megatron --gpus N`: N ranks (tensor parallel over gloo on a CPU, NCCL on GPUs), rank
    0 serving the trainer; each step's weights (with LoRA: the adapter's alone) reach the inference
    server as the next policy version, and every rank is gone when the run is done."""
    run_dir = tmp_path / "run"
    # The megatron backend's vocabulary is split across ranks: it trains on untruncated sampling only,
    # which write_run's tasks use.
    lora_options = {"lora_rank": lora_rank, "lr": 5e-2} if lora_rank else {}
    config = write_run(tmp_path, steps=2, device=device, **lora_options)
    ranks = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    process, lines = start_train(config, run_dir, "--backend", "megatron", "--gpus", str(ranks))
    try:
        trainer = lines.wait_for(r"^  trainer +(\S+:\d+) ", timeout=300).group(1)
        lines.wait_for(r"train: .*step 1/2", timeout=600)
        with credentials.channel(trainer, credentials.OPERATOR, credentials.for_commands()) as channel:
            status = trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(trainer_pb2.GetStatusRequest(), timeout=30)
        assert status.status.backend == "megatron"
        lines.wait_for(r"train: done: 2 steps", timeout=600)
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["policy_version"] for row in rows] == [1, 2]
    assert all(row["tokens"] > 0 for row in rows)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert processes_of(run_dir) == []
    if lora_rank:
        from polar import lora

        # The same adapter bytes as the torch backend's LoRA run (both sync fp32 on a CPU).
        adapter_bytes = (
            4 * 8 * 2 * sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 192), (64, 192), (192, 64)])
        )
        assert all(row["weight_sync_bytes"] == adapter_bytes for row in rows)
        saved = lora.read_adapter(run_dir / "checkpoints" / "step-000002" / "tiny")
        assert saved.settings.rank == 8 and any(float(t.abs().max()) > 0 for t in saved.tensors.values())
