"""SWE-style tasks end to end: examples/swe-mini instances imported with the real `polar tasks
import swe --local`, run by the real Pi CLI through `polar up --submit`, graded by the swe evaluator.

A model that answers each task's issue with a call of Pi's bash tool applying that task's gold patch
(then a final answer once the tool result is in its prompt) scores 1 on every session; the tiny model
(random weights, the torch engine) changes nothing and scores 0. The gold replies are the tiny model's
forced replies (`[inference] forced_replies`, an edge fixture): its own tokens are recorded with its
own logprobs, only their choice is scripted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import swe_mini
from tests.helpers.polar_command import run
from tests.helpers.stack_config import write_stack_config
from tests.helpers.swe_sessions import FINAL, describe, gold_patch_script, run_and_export

pytestmark = [pytest.mark.slow, pytest.mark.node]

NAMES = ["clamp", "roman"]
RUN_TIMEOUT_S = 300


def stack_config(tmp_path: Path, inference: dict, harness_bin: Path, repos: Path) -> Path:
    return write_stack_config(
        tmp_path / "stack.toml",
        rollout={"store": tmp_path / "rollout.db", "heartbeat_interval_s": 0.2},
        inference={"engine": "torch", "model": "tiny", **inference},
        envoy={"workers": 1},
        node={
            "init_workers": 2,
            "ready_slots": 0,
            "running_slots": 2,
            "postrun_workers": 2,
            "harness_path": harness_bin,
            "template_roots": repos,
        },
    )


def import_tasks(tmp_path: Path, repos: Path, instance_file: Path, *extra: str) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    imported = run(
        "tasks",
        "import",
        "swe",
        str(instance_file),
        "--flavor",
        "swebench",
        "--local",
        str(repos),
        "--preset",
        "pi",
        "--timeout",
        "240",
        "--out",
        str(tasks),
        *extra,
    )
    assert imported.returncode == 0, imported.stderr
    return tasks


@pytest.fixture(scope="module")
def swe_setup(harness_bin, tmp_path_factory) -> tuple[Path, Path, Path]:
    return (harness_bin, *swe_mini.prepare(tmp_path_factory.mktemp("swe-mini"), NAMES))


def test_pi_applying_the_gold_patch_scores_1(swe_setup, tmp_path: Path) -> None:
    harness_bin, repos, instance_file = swe_setup
    script = tmp_path / "gold.json"
    script.write_text(json.dumps(gold_patch_script(swe_mini.instances(NAMES))))
    config = stack_config(tmp_path, {"forced_replies": script}, harness_bin, repos)
    # Sampled without truncation, so each forced token keeps a finite logprob.
    tasks = import_tasks(tmp_path, repos, instance_file, "--sampling", '{"topP": 1.0}')
    trajectories = run_and_export(config, tasks, tmp_path)
    assert len(trajectories) == len(NAMES)
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
        assert trajectory["reward"] == 1.0, describe(trajectory)
        metadata = trajectory["metadata"]
        assert metadata["swe_fail_to_pass"].split("/")[0] == metadata["swe_fail_to_pass"].split("/")[1], describe(
            trajectory
        )
        assert len(trajectory["calls"]) >= 2 and FINAL in trajectory["harnessOutput"], describe(trajectory)


def test_pi_on_the_tiny_model_scores_0(swe_setup, tmp_path: Path) -> None:
    harness_bin, repos, instance_file = swe_setup
    config = stack_config(tmp_path, {}, harness_bin, repos)
    tasks = import_tasks(tmp_path, repos, instance_file, "--sampling", '{"maxTokensPerCall": 24}')
    trajectories = run_and_export(config, tasks, tmp_path)
    assert len(trajectories) == len(NAMES)
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
        assert trajectory.get("reward", 0.0) == 0.0, describe(trajectory)
        assert trajectory["calls"], describe(trajectory)
        assert trajectory["metadata"]["swe_instance"].startswith("polar-mini__"), describe(trajectory)
