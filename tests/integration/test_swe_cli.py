"""`polar tasks import swe` and `polar tasks oracle` as a user runs them, on examples/swe-mini."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import swe_mini
from tests.helpers.polar_command import assert_one_line_error, run

pytestmark = pytest.mark.slow


def imported(instance_file: Path, repos: Path, out: Path) -> list[dict]:
    result = run(
        "tasks", "import", "swe", str(instance_file), "--flavor", "swebench", "--local", str(repos), "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_swe_mini_gold_patch_scores_1_and_no_change_0(tmp_path: Path) -> None:
    # The repositories built from their files hold exactly the recorded base commits (the import
    # checks each one), and the oracle passes every task.
    repos, _ = swe_mini.prepare(tmp_path)
    tasks = imported(swe_mini.INSTANCES, repos, tmp_path / "tasks.jsonl")
    assert len(tasks) == len(swe_mini.instances()) >= 20
    checked = run("tasks", "oracle", str(tmp_path / "tasks.jsonl"), timeout=600)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rows = [line.split() for line in checked.stdout.splitlines()[1 : len(tasks) + 1]]
    assert [(row[1], row[2], row[4]) for row in rows] == [("1", "0", "ok")] * len(tasks), checked.stdout
    assert f"{len(tasks)} of {len(tasks)} tasks sound, 0 broken" in checked.stdout


def test_the_oracle_names_broken_tasks(tmp_path: Path) -> None:
    repos, instance_file = swe_mini.prepare(tmp_path, ["clamp", "fizzbuzz"])
    clamp, fizzbuzz = imported(instance_file, repos, tmp_path / "tasks.jsonl")
    # A gold patch that fixes nothing, and a FAIL_TO_PASS test that passes before any fix.
    clamp["evaluator"]["swe"]["goldPatch"] = fizzbuzz["evaluator"]["swe"]["goldPatch"].replace("fizzbuzz", "clamp")
    fizzbuzz["evaluator"]["swe"]["failToPass"] = ["tests/test_fizzbuzz.py::test_numbers"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(clamp) + "\n" + json.dumps(fizzbuzz) + "\n")
    checked = run("tasks", "oracle", str(broken))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "0 of 2 tasks sound, 2 broken" in checked.stdout
    assert "gold: the gold patch does not apply" in checked.stdout
    assert "empty: reward 1, not 0" in checked.stdout


def test_import_without_the_checkouts_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "repos").mkdir()
    result = run(
        "tasks", "import", "swe", str(swe_mini.INSTANCES), "--flavor", "swebench", "--local", str(tmp_path / "repos")
    )
    assert_one_line_error(result, "repositories are not ready", "polar-mini__binsearch-1: no git checkout at")


def test_import_of_a_bad_file_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance_id": "a__b-1", "repo": "a/b"}\n')
    assert_one_line_error(
        run("tasks", "import", "swe", str(bad), "--flavor", "swegym"), "bad.jsonl:1: base_commit: required"
    )
    assert_one_line_error(run("tasks", "oracle", str(bad)), "bad.jsonl:1")
