"""SWE-style tasks in their images: examples/swe-mini's instances imported with their own images
(`polar-swe-mini/<name>`, built here FROM the base image) and graded as SWE-bench grades them, the
change applied in a fresh container of the same image and each FAIL_TO_PASS / PASS_TO_PASS test
read from the log.

- `polar tasks oracle`: the gold patch scores 1 and no change 0, in containers;
- the real Pi CLI, run inside the session's container by `polar up --submit`: the tiny model forced
  to apply the gold patch with Pi's bash tool scores 1 on every session; forced to reply with text
  alone (no change), 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import swe_mini
from tests.helpers.agent_clis import installed_clis
from tests.helpers.polar_command import run
from tests.helpers.swe_sessions import FINAL, describe, gold_patch_script, run_and_export

ORACLE_NAMES = ["binsearch", "clamp", "roman", "slugify", "lrucache", "versions"]
PI_NAMES = ["clamp", "roman"]
IMAGE_TEMPLATE = "polar-swe-mini/{repo_name}"


def import_tasks(tmp_path: Path, names: list[str], *extra: str) -> Path:
    instance_file = tmp_path / "instances.jsonl"
    instance_file.write_text("".join(json.dumps(record) + "\n" for record in swe_mini.instances(names)))
    tasks = tmp_path / "tasks.jsonl"
    imported = run(
        "tasks",
        "import",
        "swe",
        str(instance_file),
        "--flavor",
        "swebench",
        "--image-template",
        IMAGE_TEMPLATE,
        "--preset",
        "pi",
        "--timeout",
        "240",
        "--out",
        str(tasks),
        *extra,
    )
    assert imported.returncode == 0, imported.stderr
    assert all(json.loads(line)["runtime"]["kind"] == "docker" for line in tasks.read_text().splitlines())
    return tasks


def test_the_oracle_grades_gold_1_and_no_change_0_in_the_images(swe_mini_images, tmp_path: Path) -> None:
    tasks = import_tasks(tmp_path, ORACLE_NAMES)
    checked = run("tasks", "oracle", str(tasks), "--jobs", "2", timeout=900)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(ORACLE_NAMES)} of {len(ORACLE_NAMES)} tasks sound" in checked.stdout


def stack_config(tmp_path: Path, inference: str, harness_bin: Path) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(
        f'[rollout]\nport = 0\nstore = "{tmp_path / "rollout.db"}"\nheartbeat_interval_s = 0.2\n'
        f"[inference]\n{inference}port = 0\n"
        "[gateway]\nport = 0\ngrpc_port = 0\n"
        "[envoy]\nharness_port = 0\ninference_port = 0\nadmin_port = 0\nworkers = 1\n"
        "[node]\ninit_workers = 2\nready_slots = 0\nrunning_slots = 2\npostrun_workers = 2\n"
        f'harness_path = "{harness_bin}"\n'
    )
    return path


@pytest.mark.node
def test_pi_in_a_container_applying_the_gold_patch_scores_1(swe_mini_images, tmp_path: Path) -> None:
    script = tmp_path / "gold.json"
    script.write_text(json.dumps(gold_patch_script(swe_mini.instances(PI_NAMES))))
    inference = f'engine = "torch"\nmodel = "tiny"\nforced_replies = "{script}"\n'
    config = stack_config(tmp_path, inference, installed_clis())
    tasks = import_tasks(tmp_path, PI_NAMES, "--sampling", '{"topP": 1.0}')
    trajectories = run_and_export(config, tasks, tmp_path)
    assert len(trajectories) == len(PI_NAMES)
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
        assert trajectory["reward"] == 1.0, describe(trajectory)
        assert len(trajectory["calls"]) >= 2 and FINAL in trajectory["harnessOutput"], describe(trajectory)


@pytest.mark.node
def test_pi_in_a_container_replying_with_nothing_scores_0(swe_mini_images, tmp_path: Path) -> None:
    script = tmp_path / "empty.json"
    script.write_text(json.dumps({"replies": [], "fallback": "I will leave the repository as it is."}))
    inference = f'engine = "torch"\nmodel = "tiny"\nforced_replies = "{script}"\n'
    config = stack_config(tmp_path, inference, installed_clis())
    tasks = import_tasks(tmp_path, PI_NAMES, "--sampling", '{"topP": 1.0}')
    trajectories = run_and_export(config, tasks, tmp_path)
    assert len(trajectories) == len(PI_NAMES)
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
        assert trajectory.get("reward", 0.0) == 0.0, describe(trajectory)
        assert trajectory["metadata"]["swe_reason"].startswith("empty change"), describe(trajectory)
