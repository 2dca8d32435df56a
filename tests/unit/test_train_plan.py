"""What `polar train` starts: an inference server that gives its memory back to a trainer on its GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.app.train import shares_a_gpu, train_plan
from polar.config import InferenceConfig, StackConfig, TrainerConfig


@pytest.mark.parametrize(
    ("trainer", "server", "shared"),
    [
        (TrainerConfig(), InferenceConfig(), True),  # both "auto": the first GPU
        (TrainerConfig(device="cuda"), InferenceConfig(device="cuda:0"), True),
        (TrainerConfig(device="cuda:1"), InferenceConfig(device="cuda:0"), False),
        (TrainerConfig(device="cuda:1"), InferenceConfig(device="cuda:1"), True),
        (TrainerConfig(device="cpu"), InferenceConfig(device="cuda"), False),
        (TrainerConfig(device="cpu"), InferenceConfig(device="cpu"), False),
        (TrainerConfig(backend="megatron", gpus=4), InferenceConfig(device="cuda:3"), True),
        (TrainerConfig(backend="megatron", gpus=4), InferenceConfig(device="cuda:4"), False),
    ],
)
def test_a_trainer_shares_the_servers_gpu_when_their_devices_meet(trainer, server, shared) -> None:
    assert shares_a_gpu(trainer, server) is shared


def test_the_run_s_server_gives_its_memory_back_only_beside_its_trainer(tmp_path: Path) -> None:
    apart = StackConfig(trainer=TrainerConfig(device="cuda:1"), inference=InferenceConfig(device="cuda:0"))
    assert train_plan(apart, tmp_path / "apart")[0].inference.release_idle_memory is False
    together = StackConfig(trainer=TrainerConfig(device="cuda:0"), inference=InferenceConfig(device="cuda:0"))
    assert train_plan(together, tmp_path / "together")[0].inference.release_idle_memory is True
    asked = StackConfig(
        trainer=TrainerConfig(device="cuda:1"), inference=InferenceConfig(device="cuda:0", release_idle_memory=True)
    )
    assert train_plan(asked, tmp_path / "asked")[0].inference.release_idle_memory is True
