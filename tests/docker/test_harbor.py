"""Harbor task directories (examples/harbor-mini) in their images:

- `polar tasks import harbor` makes one docker task per directory: the prompt, task.toml's limits,
  the images built once and tagged by their content, the sessions' image without the tests or the
  solution;
- `polar tasks oracle`: each solution/solve.sh scores 1 and doing nothing 0, and a task whose
  solution does not solve it is reported broken.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.helpers.polar_command import assert_one_line_error, run

HARBOR_MINI = Path(__file__).resolve().parents[2] / "examples" / "harbor-mini"
TASK_IDS = ["polar_csv-total", "fix-fizzbuzz", "polar_word-count"]


def import_tasks(tmp_path: Path, *paths: Path) -> list[dict]:
    out = tmp_path / "tasks.jsonl"
    imported = run("tasks", "import", "harbor", *map(str, paths), "--out", str(out), timeout=600)
    assert imported.returncode == 0, imported.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def in_image(image: str, script: str) -> subprocess.CompletedProcess[str]:
    argv = ["docker", "run", "--rm", "--network=none", "--entrypoint=sh", image, "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def created(image: str) -> str:
    inspect = ["docker", "image", "inspect", "--format", "{{.Id}} {{.Created}}", image]
    return subprocess.run(inspect, capture_output=True, text=True, check=True).stdout


def test_import_makes_one_docker_task_per_directory_with_its_limits_and_images(tmp_path: Path) -> None:
    tasks = {task["taskId"]: task for task in import_tasks(tmp_path, HARBOR_MINI)}
    assert sorted(tasks) == sorted(TASK_IDS)

    words = tasks["polar_word-count"]
    assert words["instruction"] == (HARBOR_MINI / "word-count" / "instruction.md").read_text()
    assert words["timeoutSeconds"] == 300.0
    assert words["runtime"] == {
        "kind": "docker",
        "image": words["runtime"]["image"],
        "workdir": "/app",
        "cpus": 1.0,
        "memoryBytes": str(1024 << 20),
    }
    assert words["runtime"]["image"].startswith("polar-harbor/polar-word-count:")
    assert words["evaluator"]["kind"] == "harbor" and words["evaluator"]["timeoutSeconds"] == 60.0
    harbor = words["evaluator"]["harbor"]
    assert harbor["name"] == "polar/word-count"
    assert harbor["image"].startswith("polar-harbor/polar-word-count-tests:")
    assert harbor["solutionImage"].startswith("polar-harbor/polar-word-count-solution:")
    assert words["metadata"] == {
        "harbor_task": "polar/word-count",
        "harbor_difficulty": "easy",
        "harbor_category": "file-operations",
    }

    # Harbor's older task.toml: the folder names the task, `memory` is a size.
    fizz = tasks["fix-fizzbuzz"]
    assert fizz["runtime"]["memoryBytes"] == str(1 << 30) and fizz["evaluator"]["timeoutSeconds"] == 120.0
    assert json.loads(fizz["metadata"]["harbor_tags"]) == ["python", "bugfix"]
    assert tasks["polar_csv-total"]["evaluator"]["harbor"]["env"] == {"TOLERANCE": "0.005"}

    # The sessions' image holds the environment only; the tests and the solution are in images of their own.
    listing = "ls /app; test -e /tests && echo TESTS; test -e /solution && echo SOLUTION; exit 0"
    assert in_image(words["runtime"]["image"], listing).stdout.split() == ["poem.txt"]
    assert "test.sh" in in_image(harbor["image"], "ls /tests").stdout
    assert "solve.sh" in in_image(harbor["solutionImage"], "ls /solution").stdout


def test_images_are_built_once_and_a_changed_environment_gets_a_new_one(tmp_path: Path) -> None:
    task = tmp_path / "word-count"
    shutil.copytree(HARBOR_MINI / "word-count", task)
    first = import_tasks(tmp_path, task)[0]
    built = {image: created(image) for image in (first["runtime"]["image"], first["evaluator"]["harbor"]["image"])}
    again = import_tasks(tmp_path, task)[0]
    assert {image: created(image) for image in built} == built
    assert again == first

    (task / "environment" / "poem.txt").write_text("a shorter poem\n")
    changed = import_tasks(tmp_path, task)[0]
    assert changed["runtime"]["image"] != first["runtime"]["image"]
    assert changed["evaluator"]["harbor"]["image"] != first["evaluator"]["harbor"]["image"]


def test_the_oracle_scores_each_solution_1_and_doing_nothing_0(tmp_path: Path) -> None:
    import_tasks(tmp_path, HARBOR_MINI)
    checked = run("tasks", "oracle", str(tmp_path / "tasks.jsonl"), "--jobs", "2", timeout=600)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "3 of 3 tasks sound" in checked.stdout
    for task_id in TASK_IDS:
        row = next(line for line in checked.stdout.splitlines() if line.startswith(task_id))
        assert row.split()[1:3] == ["1", "0"] and row.endswith("ok"), checked.stdout


def test_the_oracle_reports_a_solution_that_does_not_solve_its_task(tmp_path: Path) -> None:
    task = tmp_path / "word-count"
    shutil.copytree(HARBOR_MINI / "word-count", task)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho 41 > count.txt\n")
    import_tasks(tmp_path, task)
    checked = run("tasks", "oracle", str(tmp_path / "tasks.jsonl"), timeout=600)
    assert checked.returncode == 1
    assert "BROKEN" in checked.stdout and "solution: reward 0, not 1" in checked.stdout, checked.stdout


def test_a_task_without_a_workdir_is_refused_saying_why(tmp_path: Path) -> None:
    task = tmp_path / "no-workdir"
    shutil.copytree(HARBOR_MINI / "word-count", task)
    (task / "environment" / "Dockerfile").write_text("FROM polar-base:bookworm\nCOPY poem.txt /poem.txt\n")
    refused = run("tasks", "import", "harbor", str(task), timeout=600)
    assert_one_line_error(refused, "sets no WORKDIR other than /")
