"""`polar train` on sessions that fork: a harness that compacts its history on its own, and one that
compacts after the gateway refused a prompt longer than the model's context ("prompt is too long");
beside them, a harness whose very first call is too long, which fails and is warned about.

The whole real stack on the tiny model (its context cut to 4,096 tokens so that a prompt past it is
cheap to send), a harness on the official Anthropic SDK (tests/fixtures/train_tiny/compacting_agent.py),
one real GRPO step with the torch backend. Each session shows its compacted conversation as a trace of
its own beside the first, the refused call is recorded with nothing to train, and the step counts both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar import codec
from polar.inference.models import resolve_model
from polar.rollout.store import RolloutStore
from polar.v1 import common_pb2
from tests.helpers.polar_command import POLAR
from tests.helpers.stack_config import write_stack_config
from trainer.metrics import read_metrics
from trainer.screening import SCREEN_KEYS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "tests" / "fixtures" / "train_tiny" / "compacting_agent.py"
SCORE = REPO / "tests" / "fixtures" / "train_tiny" / "score.py"
CONTEXT = 4096


def short_context_tiny(folder: Path) -> Path:
    """The tiny model with a 4,096-token context: the same weights, served and trained alike."""
    shutil.copytree(resolve_model("tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_config(tmp_path: Path, model: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    lines = [
        {
            "taskId": mode,
            "instruction": "Write some words.",
            "groupSize": 2,
            "harness": {"preset": "command", "command": [sys.executable, str(AGENT), mode]},
            "runtime": {"kind": "local"},
            "evaluator": {"kind": "command", "command": f"{sys.executable} {SCORE}"},
            "sampling": {"temperature": 1.0},
            "timeoutSeconds": 120,
        }
        for mode in ("compact", "overflow", "first")
    ]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return write_stack_config(
        tmp_path / "train.toml",
        node={"running_slots": 4},
        trainer={
            "model": model,
            "device": "cpu",
            "dataset": tasks,
            "steps": 1,
            "groups_per_step": 3,
            "groups_ahead": 0,
            "lr": 1e-3,
        },
    )


def released(run_dir: Path) -> list[common_pb2.Trajectory]:
    store = RolloutStore(run_dir / "rollout.db")
    try:
        groups = store.released_groups(0, max_groups=100, max_bytes=1 << 30)
    finally:
        store.close()
    return [
        common_pb2.Trajectory.FromString(codec.decompress(blob, max_bytes=1 << 30))
        for group in groups
        for blob in group.trajectories
    ]


def test_compacted_and_refused_sessions_train_and_fork_into_separate_traces(tmp_path: Path) -> None:
    model = short_context_tiny(tmp_path / "tiny-4k")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*POLAR, "train", str(write_config(tmp_path, model)), "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    # Warned once, before the step, though both sessions of the task failed so.
    warnings = [line for line in result.stdout.splitlines() if "first call does not fit" in line]
    assert len(warnings) == 1 and "warning: task train-" in warnings[0], result.stdout[-3000:]
    assert "prompt is 6" in warnings[0] and f"the model's context holds {CONTEXT}" in warnings[0]

    [row] = read_metrics(run_dir / "metrics.jsonl")
    assert all(key in row for key in SCREEN_KEYS)
    assert row["groups"] == 3 and row["trainable_tokens"] > 0 and row["policy_version"] == 1
    assert row["forks_compaction"] == 4  # every session of the two groups that could compact did once
    assert row["calls_prompt_too_long"] == 4 and row["sessions_first_call_too_long"] == 2
    assert row["traces_too_long"] == 0 and row["groups_too_long_dropped"] == 0

    trajectories = released(run_dir)
    assert len(trajectories) == 6
    for trajectory in trajectories:
        if trajectory.metadata["dataset_task"] == "first":
            assert trajectory.outcome == common_pb2.SESSION_OUTCOME_FAILED and trajectory.attempt == 1
            assert trajectory.error.startswith("the harness's first call does not fit the model's context")
            [call] = trajectory.calls
            assert call.prompt_too_long and not trajectory.traces
            continue
        assert trajectory.outcome == common_pb2.SESSION_OUTCOME_COMPLETED, trajectory.error
        first, compacted = trajectory.traces
        assert (first.fork_reason, compacted.fork_reason) == ("", "compaction")
        # Separate traces: the compacted conversation does not start with the history it replaced.
        assert list(compacted.token_ids[: len(first.token_ids)]) != list(first.token_ids)
        assert len(compacted.token_ids) < len(first.token_ids)
        refused = [call for call in trajectory.calls if call.prompt_too_long]
        if trajectory.metadata["dataset_task"] == "overflow":
            [call] = refused
            assert call.finish_reason == common_pb2.FINISH_REASON_ERROR and not call.sampled_token_ids
            assert len(call.prompt_token_ids) >= CONTEXT and call.usage.prompt_tokens == len(call.prompt_token_ids)
            assert b"prompt is too long" in call.response_body
            assert trajectory.stats.calls == 4 and trajectory.stats.chains == 2
        else:
            assert not refused and trajectory.stats.calls == 5 and trajectory.stats.chains == 2
