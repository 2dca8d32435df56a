"""The "swe" evaluator end to end on temporary git repositories (examples/swe-mini's, built for the
test) with the local runtime: a session's workspace as an agent leaves it, graded as a node grades
it (polar.app.node.evaluators.evaluate with the node's runtime provider)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from polar.app.node.evaluators import evaluate
from polar.app.node.runtimes import LocalProvider
from polar.app.node.runtimes.base import Runtime
from polar.app.swe.evaluator import apply_patch
from polar.app.swe.instances import ImportOptions, import_tasks
from polar.v1 import rollout_pb2
from tests.helpers import swe_mini

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

NAMES = ["roman", "stack"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, rollout_pb2.Task]:
    repos, instance_file = swe_mini.prepare(tmp_path_factory.mktemp("swe"), NAMES)
    imported = import_tasks(instance_file, ImportOptions("swebench", local=repos))
    return {task.task_id.split("__", 1)[1].rsplit("-", 1)[0]: task for task in imported}


@pytest.fixture
def provider(tmp_path: Path) -> LocalProvider:
    return LocalProvider(tmp_path / "work")


async def graded(task: rollout_pb2.Task, provider: LocalProvider, change) -> tuple[float, str, dict]:
    """Make the task's runtime, let `change(runtime)` act as the agent, then grade it."""
    runtime = await provider.create(task.runtime, name=task.task_id)
    try:
        await change(runtime)
        result = await evaluate(
            task.evaluator, runtime=runtime, task=task, session_id=f"{task.task_id}.0", provider=provider
        )
    finally:
        await runtime.close()
    assert result.error == "", result.error
    return result.reward, result.output, result.metadata


def gold(task: rollout_pb2.Task):
    async def apply(runtime: Runtime) -> None:
        assert await apply_patch(runtime, task.evaluator.swe.gold_patch.encode(), "gold.patch") == ""

    return apply


async def nothing(runtime: Runtime) -> None:
    return None


def edit(path: str, old: str, new: str):
    async def apply(runtime: Runtime) -> None:
        file = runtime.workspace / path
        file.write_text(file.read_text().replace(old, new))

    return apply


def both(*changes):
    async def apply(runtime: Runtime) -> None:
        for change in changes:
            await change(runtime)

    return apply


async def test_the_gold_patch_scores_1(tasks, provider) -> None:
    reward, log, metadata = await graded(tasks["roman"], provider, gold(tasks["roman"]))
    assert reward == 1.0, log
    assert metadata["swe_fail_to_pass"] == "3/3" and metadata["swe_pass_to_pass"] == "3/3"
    assert "roman/numerals.py" in metadata["swe_patch"]
    assert "PASSED tests/test_numerals.py::test_subtractive_pairs[1994-MCMXCIV]" in metadata["swe_test_log"]


async def test_no_change_scores_0_without_running_tests(tasks, provider) -> None:
    reward, log, metadata = await graded(tasks["roman"], provider, nothing)
    assert (reward, log) == (0.0, "")
    assert metadata["swe_reason"] == "empty change: nothing was graded"


async def test_a_change_breaking_a_pass_to_pass_test_scores_0(tasks, provider) -> None:
    breaks_range_check = edit("roman/numerals.py", "if not 0 < number < 4000:", "if False:")
    reward, log, metadata = await graded(tasks["roman"], provider, both(gold(tasks["roman"]), breaks_range_check))
    assert reward == 0.0
    assert metadata["swe_fail_to_pass"] == "3/3" and metadata["swe_pass_to_pass"] == "2/3"
    assert "tests/test_numerals.py::test_out_of_range (FAILED)" in metadata["swe_reason"]


async def test_edits_to_the_test_patch_files_are_dropped(tasks, provider) -> None:
    # The agent rewrites the test file to pass without fixing anything: its edit never reaches the grader.
    rigged = edit(
        "tests/test_stack.py", "def test_push_pop():", "def test_pop_empty():\n    pass\n\n\ndef test_push_pop():"
    )
    reward, _, metadata = await graded(tasks["stack"], provider, rigged)
    assert reward == 0.0
    assert "tests/test_stack.py (a test patch file" in metadata["swe_dropped"]


async def test_the_workspace_git_config_never_runs(tasks, provider, tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    async def poisoned(runtime: Runtime) -> None:
        await gold(tasks["stack"])(runtime)
        git_dir = runtime.workspace / ".git"
        with (git_dir / "config").open("a") as config:
            config.write(f'[core]\n\tfsmonitor = "touch {marker}"\n[diff]\n\texternal = "touch {marker}"\n')
        (git_dir / "hooks" / "post-checkout").write_text(f"#!/bin/sh\ntouch {marker}\n")
        os.chmod(git_dir / "hooks" / "post-checkout", 0o755)
        (git_dir / "HEAD").write_text("ref: refs/heads/elsewhere\n")  # a HEAD that no longer names the base

    reward, log, _ = await graded(tasks["stack"], provider, poisoned)
    assert reward == 1.0, log
    assert not marker.exists()


async def test_symlinks_and_harness_folders_are_left_out(tasks, provider) -> None:
    async def linked(runtime: Runtime) -> None:
        (runtime.workspace / "containers" / "link.py").symlink_to("/etc/passwd")
        (runtime.workspace / ".pi").mkdir()
        (runtime.workspace / ".pi" / "settings.json").write_text("{}")

    reward, _, metadata = await graded(tasks["stack"], provider, linked)
    assert reward == 0.0
    assert metadata["swe_reason"] == "empty change: nothing was graded"
    assert metadata["swe_dropped"] == "containers/link.py (a symbolic link or nested repository)"


async def test_a_huge_change_is_refused(tasks, provider) -> None:
    task = rollout_pb2.Task()
    task.CopyFrom(tasks["stack"])
    task.evaluator.swe.max_patch_bytes = 10_000

    async def huge(runtime: Runtime) -> None:
        await gold(task)(runtime)
        (runtime.workspace / "blob.bin").write_bytes(os.urandom(50_000))

    reward, _, metadata = await graded(task, provider, huge)
    assert reward == 0.0
    assert "larger than 10000 bytes" in metadata["swe_reason"]


async def test_binary_and_new_files_in_a_change_apply(tasks, provider) -> None:
    async def with_files(runtime: Runtime) -> None:
        await gold(tasks["stack"])(runtime)
        (runtime.workspace / "containers" / "data.bin").write_bytes(bytes(range(256)))
        (runtime.workspace / "containers" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))

    reward, log, metadata = await graded(tasks["stack"], provider, with_files)
    assert reward == 1.0, log
    assert "GIT binary patch" in metadata["swe_patch"]


async def test_the_workspace_has_no_later_history(tasks, provider) -> None:
    # The checkout moves on past the base commit (as a real repository's history holds the fix).
    task = tasks["roman"]
    later = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "--allow-empty", "-m", "the fix"]
    subprocess.run(later, cwd=task.runtime.template, check=True)
    runtime = await provider.create(task.runtime, name="history")
    try:
        log = subprocess.run(
            ["git", "log", "--all", "--format=%H"], cwd=runtime.workspace, capture_output=True, text=True, check=True
        )
        assert log.stdout.split() == [task.runtime.revision]
    finally:
        await runtime.close()


async def test_files_the_prepare_steps_make_are_not_the_agent_s_change(tasks, provider) -> None:
    # An editable install leaves untracked files in the repository; the fresh copy has them too.
    task = rollout_pb2.Task()
    task.CopyFrom(tasks["stack"])
    task.runtime.prepare.append("mkdir -p containers.egg-info && echo built > containers.egg-info/PKG-INFO")
    reward, log, metadata = await graded(task, provider, gold(task))
    assert reward == 1.0, log
    assert "egg-info" not in metadata["swe_patch"]
