"""The Pi example (examples/train-pi.toml): its config loads, its task files are what make_tasks.py
writes and `polar submit` accepts, and its evaluator scores hand-made workspaces from their files.

The 20-minute training run itself is not in CI; this checks what a new user's run starts from."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from polar.config import load_config
from polar.rollout.tasks import parse_task_lines
from tests.helpers.example_modules import EXAMPLES, example_module

REPO = EXAMPLES.parent
EXAMPLE = EXAMPLES / "train-pi"
make_tasks = example_module("train-pi/make_tasks.py")  # the example's own generator, not a package


def tasks(name: str) -> list:
    path = EXAMPLE / name
    return parse_task_lines(path.read_text(), str(path))


def test_the_config_loads_and_names_the_example_files() -> None:
    config = load_config(REPO / "examples" / "train-pi.toml")
    assert config.trainer.model == "smollm2-135m"
    for path in (config.trainer.dataset, config.trainer.heldout, config.node.harness_path):
        assert (REPO / path).parent.is_dir(), path
    assert (REPO / config.trainer.dataset).is_file() and (REPO / config.trainer.heldout).is_file()


def test_the_task_files_are_what_make_tasks_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(make_tasks, "FOLDER", tmp_path)
    make_tasks.main()
    for name in ("tasks-train.jsonl", "tasks-heldout.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / name).read_text(), f"run make_tasks.py: {name} is stale"


def test_every_task_runs_pi_in_the_workspace_and_the_held_out_words_are_unseen() -> None:
    train, heldout = tasks("tasks-train.jsonl"), tasks("tasks-heldout.jsonl")
    assert len(heldout) == make_tasks.HELD_OUT and len(train) > len(heldout)
    for task in train + heldout:
        assert task.harness.preset == "pi"
        assert (REPO / task.runtime.template / "check.py").is_file()
        assert (REPO / task.runtime.template / ".pi" / "SYSTEM.md").is_file()
    words = lambda ts: {t.metadata["word"] for t in ts}  # noqa: E731
    assert not words(train) & words(heldout)


def score(workspace: Path, word: str) -> float:
    result = subprocess.run(
        ["python3", "check.py", word], cwd=workspace, capture_output=True, text=True, timeout=60, check=True
    )
    return float(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("files", "reward"),
    [
        ({}, 0.0),  # Pi printed the answer and wrote nothing
        ({".pi/sessions/log.jsonl": "apple"}, 0.0),  # the harness's own folder is not the model's output
        ({"answer.txt": "Apple\n"}, 1.0),  # any letter case, a trailing line break
        ({"answer.txt": "the word is apple."}, 1.0),
        ({"answer.txt": "pineapple"}, 0.5),  # a file was written, but not the word
        ({"notes.txt": "apple"}, 0.5),  # the word, in the wrong file
    ],
)
def test_the_evaluator_scores_the_files_a_session_left(tmp_path: Path, files: dict[str, str], reward: float) -> None:
    workspace = tmp_path / "work"
    shutil.copytree(EXAMPLE / "workspace", workspace)
    for name, text in files.items():
        (workspace / name).parent.mkdir(parents=True, exist_ok=True)
        (workspace / name).write_text(text)
    assert score(workspace, "apple") == reward
