"""The docker flavor of a SWE-style task: a real SWE-bench image pulled, its gold patch graded 1 and
no change 0 by `polar tasks oracle`, which runs the same evaluator a node runs.

It needs a Docker engine and one SWE-bench instance (one line of the dataset's JSON Lines, named by
$POLAR_SWEBENCH_INSTANCE; no dataset ships with the project); it skips, saying which is missing,
where either is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from polar.rollout.runtimes import docker_engine_answers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from polar_cli import run  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_swebench_image_grades_its_gold_patch_1(tmp_path: Path) -> None:
    if not docker_engine_answers():
        pytest.skip("no Docker engine answers on this machine (docker version failed)")
    instance = os.environ.get("POLAR_SWEBENCH_INSTANCE", "")
    if not instance or not Path(instance).is_file():
        pytest.skip("set POLAR_SWEBENCH_INSTANCE to a file holding one SWE-bench instance (JSON Lines)")
    tasks = tmp_path / "tasks.jsonl"
    imported = run("tasks", "import", "swe", instance, "--flavor", "swebench", "--out", str(tasks))
    assert imported.returncode == 0, imported.stderr
    checked = run("tasks", "oracle", str(tasks), timeout=3600)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1 of 1 tasks sound" in checked.stdout
