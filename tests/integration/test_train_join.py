"""`polar train --join`: LoRA runs that share one running stack. `polar up` holds the stack (the tiny
model with room for two adapters); runs of one config in two run folders join it at once, each
training its own adapter under a name of its own, and leave nothing on the server when they end. A
run that cannot join (no stack there, no room, its adapter's name taken, not a LoRA run) is refused
in one line before its trainer starts.
"""

from __future__ import annotations

import functools
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from polar import codec, credentials, lora
from polar.inference.models import resolve_model
from polar.rollout.client import RolloutClient
from polar.v1 import inference_pb2, inference_pb2_grpc
from tests.helpers.polar_command import assert_one_line_error, run, spawned
from tests.helpers.stack_config import write_stack_config
from tests.helpers.train_runs import processes_of, start_train, write_run
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.checkpoints import TrainerState, save_checkpoint
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow

# Three steps, each group submitted once the step before pushed (groups_ahead = 0): the groups of
# steps 2 and 3 are sampled from each run's adapter after its pushes, where the adapters differ.
STEPS = 3
RANK = 8
RUNS = ("run-a", "run-b")


def stack_config(tmp_path: Path, **inference: object) -> Path:
    return write_stack_config(
        tmp_path / "stack.toml",
        rollout={"store": tmp_path / "rollout.db", "heartbeat_interval_s": 0.2},
        inference={"max_batch_size": 16, **inference},
        envoy={"workers": 1},
        node={"init_workers": 2, "ready_slots": 4, "running_slots": 8, "postrun_workers": 2},
    )


def start_stack(spawn: Callable, config: Path) -> dict[str, str]:
    """`polar up` on config in the background; each service's endpoint from its table."""
    _, lines = spawn("up", "--config", str(config))
    lines.wait_for(r"^polar up: 4 services running")
    return {
        name: lines.wait_for(rf"^\s+{name}\s+(\S+)\s").group(1) for name in ("rollout", "inference", "envoy", "node")
    }


def inference_call(address: str, method: str, request):
    with credentials.channel(address, credentials.OPERATOR, credentials.for_commands()) as channel:
        return getattr(inference_pb2_grpc.InferenceServiceStub(channel), method)(request, timeout=30)


def adapters(address: str) -> list[tuple[str, int]]:
    info = inference_call(address, "GetModelInfo", inference_pb2.GetModelInfoRequest()).model_info
    return [(adapter.name, adapter.policy_version) for adapter in info.adapters]


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One `polar up` with room for two adapters of rank 8, which the module's tests share."""
    folder = tmp_path_factory.mktemp("lora-stack")
    with spawned() as spawn:
        yield start_stack(spawn, stack_config(folder, lora_rank=RANK, max_adapters=2))


def lora_config(folder: Path, **trainer: object) -> Path:
    """A LoRA run's config in `folder`: the tiny model's lowercase-words task (tests.integration.test_train)."""
    folder.mkdir(exist_ok=True)
    options = {"groups_ahead": 0, "group_size": 4, "lora_rank": RANK, "lr": 5e-2, **trainer}
    options.update(checkpoint_every=1, keep_checkpoints=STEPS)
    return write_run(folder, STEPS, groups_per_step=1, **options)


def test_two_runs_join_one_stack_each_training_its_own_adapter(tmp_path: Path, lora_stack: dict[str, str]) -> None:
    config = lora_config(tmp_path / "config")
    inference = lora_stack["inference"]
    seen: list[set[str]] = []  # the named adapters the server held, poll by poll
    both_ended = threading.Event()

    def watch_adapters() -> None:
        while not both_ended.wait(0.2):
            seen.append({name for name, _ in adapters(inference) if name})

    watcher = threading.Thread(target=watch_adapters, daemon=True)
    watcher.start()
    started = {name: start_train(config, tmp_path / name, "--join", lora_stack["rollout"]) for name in RUNS}
    try:
        for process, lines in started.values():
            lines.wait_for(rf"train: done: {STEPS} steps", timeout=300)
            assert process.wait(timeout=120) == 0
    finally:
        both_ended.set()
        for process, _ in started.values():
            process.kill()
    watcher.join()
    # Each run named its adapter and tasks after its folder (the same config: names of their own).
    states = {
        name: json.loads((tmp_path / name / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_text())
        for name in RUNS
    }
    names = {name: state["lora_adapter_name"] for name, state in states.items()}
    assert all(names[name].startswith(f"{name}-") and states[name]["task_prefix"] == names[name] for name in RUNS)
    # Both adapters were on the server together, and neither is left now that the runs are over.
    assert any(set(names.values()) <= held for held in seen)
    assert adapters(inference) == [("", 0)]
    for name in RUNS:
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        # Versions count per adapter: each run's pushes moved its own, from 1.
        assert [row["policy_version"] for row in rows] == list(range(1, STEPS + 1))
        assert all(task.startswith(f"{names[name]}-") for row in rows for task in row["task_ids"])
        assert processes_of(tmp_path / name) == []
    # Every session of a run's tasks sampled from that run's adapter: the logprobs its calls recorded
    # are those of the base model with that run's adapter, as its checkpoint of that version holds it.
    with RolloutClient(lora_stack["rollout"]) as rollout:
        batches = list(rollout.results(until_caught_up=True))
    trajectories = [t for batch in batches for t in codec.read_trajectory_batch(batch.zstd_trajectories)]
    checked = {name: 0 for name in RUNS}
    for name in RUNS:
        other = next(run for run in RUNS if run != name)
        trained = {task for row in read_metrics(tmp_path / name / "metrics.jsonl") for task in row["task_ids"]}
        calls = [
            call
            for trajectory in trajectories
            if trajectory.task_id in trained
            for call in trajectory.calls
            if call.policy_version == call.last_policy_version >= 1 and call.sampled_token_ids
        ]
        assert calls, f"{name}: no call sampled after its first push"
        for call in calls:
            own = adapter_logprobs(tmp_path / name, call.policy_version, call)
            np.testing.assert_allclose(call.sampled_logprobs, own, atol=1e-3, err_msg=name)
            checked[name] += np.abs(adapter_logprobs(tmp_path / other, call.policy_version, call) - own).max() > 1e-2
    # The other run's adapter of the same version would have given other logprobs: the check tells them apart.
    assert all(checked.values()), checked


@functools.cache
def tiny_with_adapter(run_dir: Path, version: int) -> torch.nn.Module:
    """The tiny model with the adapter a run served as `version` merged in (its step-N checkpoint)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    adapter = lora.read_adapter(run_dir / "checkpoints" / f"step-{version:06d}" / "tiny")
    lora.attach(model, adapter.settings)
    lora.load_adapter_tensors(model, adapter.tensors)
    lora.merge_into(model)
    return model


def adapter_logprobs(run_dir: Path, version: int, call) -> np.ndarray:
    """The logprobs of a call's sampled tokens under a run's adapter of `version` (temperature 1)."""
    tokens = list(call.prompt_token_ids) + list(call.sampled_token_ids)
    with torch.no_grad():
        logits = tiny_with_adapter(run_dir, version)(torch.tensor([tokens])).logits[
            0, len(call.prompt_token_ids) - 1 : -1
        ]
    sampled = torch.tensor(list(call.sampled_token_ids))[:, None]
    return torch.log_softmax(logits.float(), -1).gather(-1, sampled)[:, 0].numpy()


def test_a_joined_run_stopped_with_ctrl_c_takes_its_names_back_when_resumed(
    tmp_path: Path, lora_stack: dict[str, str]
) -> None:
    config, run_dir = lora_config(tmp_path / "config"), tmp_path / "run"
    process, lines = start_train(config, run_dir, "--join", lora_stack["rollout"])
    try:
        name = lines.wait_for(r"^polar train: joining the stack at \S+ as adapter '([^']+)'").group(1)
        lines.wait_for(r"train: .*step 1/3", timeout=300)
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=300) == 130
    finally:
        process.kill()
    assert any("stopped after step" in line for line in lines.rest())
    assert adapters(lora_stack["inference"]) == [("", 0)] and processes_of(run_dir) == []
    stopped = len(read_metrics(run_dir / "metrics.jsonl"))
    # Its results cursor is the shared stack's: a stack of its own would not resume it.
    alone = run("train", str(config), "--run-dir", str(run_dir))
    assert_one_line_error(
        alone, f"holds a run that trained as adapter '{name}' on a shared stack: resume it with --join"
    )

    process, lines = start_train(config, run_dir, "--join", lora_stack["rollout"])
    try:
        lines.wait_for(rf"^polar train: joining the stack at \S+ as adapter '{name}', tasks {name}-NNNNNN")
        lines.wait_for(rf"train: resuming after step {stopped}", timeout=300)
        lines.wait_for(rf"train: done: {STEPS} steps", timeout=300)
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    taken = [task for row in rows for task in row["task_ids"] + row["task_ids_dropped"]]
    assert taken == [f"{name}-{n:06d}" for n in range(len(taken))]
    assert adapters(lora_stack["inference"]) == [("", 0)]


def test_a_run_that_cannot_join_is_refused_in_one_line(tmp_path: Path, lora_stack: dict[str, str]) -> None:
    rollout, inference = lora_stack["rollout"], lora_stack["inference"]

    def refused(config: Path, address: str, *needles: str) -> None:
        started = time.monotonic()
        result = run("train", str(config), "--run-dir", str(tmp_path / "refused"), "--join", address)
        assert_one_line_error(result, *needles)
        assert time.monotonic() - started < 60 and not (tmp_path / "refused").exists()

    config = lora_config(tmp_path / "lora")
    refused(
        lora_config(tmp_path / "full-weights", lora_rank=0),
        rollout,
        "--join trains a LoRA adapter",
        "a full-weight run would overwrite the base model",
    )
    refused(config, "127.0.0.1:1", "cannot join the stack at 127.0.0.1:1", "UNAVAILABLE")
    refused(lora_config(tmp_path / "wide", lora_rank=16), rollout, "lora_rank 16 is above", "lora_rank 8")
    refused(
        lora_config(tmp_path / "other-model", model="smollm2-135m"),
        rollout,
        "serves 'tiny', the run's [trainer] model is 'smollm2-135m'",
    )
    # A run folder of a run that trained on a stack of its own: its cursor is that stack's.
    own = tmp_path / "own"
    backend = TorchBackend(TorchBackendOptions(model="tiny", device="cpu", lora_rank=RANK))
    save_checkpoint(own / "checkpoints", backend, TrainerState(step=1, base_model="tiny"), "tiny")
    result = run("train", str(config), "--run-dir", str(own), "--join", rollout)
    assert_one_line_error(result, f"{own} holds a run that trained on a stack of its own (step 1)")
    # Another run's adapter holds the name: the server would answer ALREADY_EXISTS.
    inference_call(inference, "LoadAdapter", inference_pb2.LoadAdapterRequest(name="held", rank=RANK, alpha=32.0))
    try:
        refused(
            lora_config(tmp_path / "named", lora_adapter_name="held"),
            rollout,
            f"the inference server {inference} of the stack at {rollout} holds an adapter named 'held' already",
        )
        inference_call(inference, "LoadAdapter", inference_pb2.LoadAdapterRequest(name="held-2", rank=RANK, alpha=32.0))
        refused(config, rollout, "holds 2 adapters, its max_adapters: no room for another run until one ends")
    finally:
        for name in ("held", "held-2"):
            inference_call(inference, "UnloadAdapter", inference_pb2.UnloadAdapterRequest(name=name))
    assert adapters(inference) == [("", 0)]


def test_a_stack_without_room_for_adapters_is_refused(tmp_path: Path, spawn: Callable) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"cycle": True, "outputs": [{"token_ids": [41462, 30, 2], "logprobs": [-0.5] * 3}]}))
    stack = start_stack(spawn, stack_config(tmp_path, engine="scripted", script=script))
    result = run(
        "train", str(lora_config(tmp_path / "lora")), "--run-dir", str(tmp_path / "run"), "--join", stack["rollout"]
    )
    assert_one_line_error(result, f"the inference server {stack['inference']}", "has no room for adapters")
