"""Harbor task directories refused before any image is built, saying what is wrong; the verifier's
reward files read as Harbor reads them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from polar.app.harbor.evaluator import parse_reward
from polar.app.harbor.tasks import HarborTaskError, ImportOptions, content_hash, import_tasks, task_id_for

HARBOR_MINI = Path(__file__).resolve().parents[2] / "examples" / "harbor-mini"


@pytest.mark.parametrize(
    ("file_name", "text", "reward"),
    [
        ("reward.txt", "1\n", 1.0),
        ("reward.txt", " 0.25 ", 0.25),
        ("reward.txt", "passed", None),
        ("reward.txt", "", None),
        ("reward.txt", "nan", None),
        ("reward.json", '{"reward": 0.5, "accuracy": 0.9}', 0.5),
        ("reward.json", '{"reward": true}', None),
        ("reward.json", '{"accuracy": 1}', None),
        ("reward.json", "[1]", None),
        ("reward.json", "{", None),
    ],
)
def test_reward_files(file_name: str, text: str, reward: float | None) -> None:
    assert parse_reward(file_name, text) == reward


def broken_copy(tmp_path: Path, remove: str = "", toml: str = "") -> Path:
    task = tmp_path / "task"
    shutil.copytree(HARBOR_MINI / "word-count", task)
    if remove:
        target = task / remove
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    if toml:
        (task / "task.toml").write_text(toml)
    return task


@pytest.mark.parametrize(
    ("remove", "toml", "message"),
    [
        ("instruction.md", "", "no instruction.md"),
        ("tests/test.sh", "", "no tests/test.sh"),
        ("environment/Dockerfile", "", "no environment/Dockerfile"),
        ("", "[agent\n", "task.toml: not TOML"),
        ("", "agent = 3\n", "[agent] must be a table"),
        ("", "[agent]\ntimeout_sec = -1\n", "timeout_sec must be a number >= 0"),
        ("", '[environment]\nmemory = "lots"\n', "memory 'lots' is not a size"),
        ("", "[verifier]\nenv = 1\n", "env must be a table"),
    ],
)
def test_a_broken_task_directory_is_refused_saying_why(tmp_path: Path, remove: str, toml: str, message: str) -> None:
    task = broken_copy(tmp_path, remove, toml)
    with pytest.raises(HarborTaskError) as raised:
        import_tasks([task], ImportOptions(docker="no-docker-here"))
    assert message in str(raised.value) and str(task) in str(raised.value)


def test_a_folder_of_neither_tasks_nor_a_task_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HarborTaskError, match="neither a task directory"):
        import_tasks([tmp_path], ImportOptions())
    with pytest.raises(HarborTaskError, match="no such folder"):
        import_tasks([tmp_path / "missing"], ImportOptions())


def test_names_become_task_ids_and_contents_their_hash(tmp_path: Path) -> None:
    assert task_id_for("org/my task") == "org_my_task"
    assert task_id_for("_hidden") == "t_hidden"
    folder = tmp_path / "env"
    shutil.copytree(HARBOR_MINI / "word-count" / "environment", folder)
    before = content_hash(folder)
    assert content_hash(folder) == before
    (folder / "poem.txt").chmod(0o755)
    assert content_hash(folder) != before
