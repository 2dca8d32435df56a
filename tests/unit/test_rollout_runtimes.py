"""Local runtimes on real folders: a fresh folder per session, templates copied or cloned with git,
prepare commands and their failures, closing; fingerprints and the providers a machine offers."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from polar.app.node.runtimes import (
    DockerProvider,
    LocalProvider,
    RuntimeFailure,
    available_providers,
    docker_engine_answers,
    spec_key,
)
from polar.v1 import rollout_pb2

pytestmark = pytest.mark.anyio

ENV = {"PATH": os.environ.get("PATH", os.defpath)}


@pytest.fixture
def work_root(tmp_path):
    return tmp_path / "sessions"


@pytest.fixture
def provider(work_root):
    return LocalProvider(work_root, step_timeout_s=30)


def spec(**fields) -> rollout_pb2.RuntimeSpec:
    return rollout_pb2.RuntimeSpec(kind="local", **fields)


def git(*arguments: str, cwd: Path) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *arguments],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def repository(tmp_path) -> Path:
    """A git repository with one committed file, one uncommitted change and one untracked file."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / "solution.py").write_text("answer = 1\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_it.py").write_text("assert True\n")
    git("add", ".", cwd=repo)
    git("commit", "-q", "-m", "start", cwd=repo)
    (repo / "solution.py").write_text("answer = 2  # not committed\n")
    (repo / "scratch.txt").write_text("untracked\n")
    return repo


def files(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): path.read_text()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(folder).parts
    }


# ------------------------------------------------------------------------------------- folders


async def test_each_session_gets_a_fresh_folder_with_an_empty_workspace_and_home(provider, work_root):
    first = await provider.create(spec(), name="task-1.0")
    second = await provider.create(spec(), name="task-1.0")
    try:
        assert first.root != second.root
        for runtime in (first, second):
            assert runtime.kind == "local"
            assert runtime.root.parent == work_root
            assert runtime.root.name.startswith("task-1.0-")
            assert runtime.workspace == runtime.root / "work" and runtime.home == runtime.root / "home"
            assert list(runtime.workspace.iterdir()) == [] and list(runtime.home.iterdir()) == []
    finally:
        await first.close()
        await second.close()


async def test_a_session_name_cannot_escape_the_work_root(provider, work_root):
    runtime = await provider.create(spec(), name="../../etc/x y")
    try:
        assert runtime.root.parent == work_root
        assert "/" not in runtime.root.name and " " not in runtime.root.name
    finally:
        await runtime.close()


async def test_commands_run_in_the_workspace(provider):
    runtime = await provider.create(spec(), name="s")
    try:
        result = await runtime.run(["sh", "-c", "pwd; echo made > file"], env=ENV, timeout_s=10)
        assert result.exit_code == 0
        assert result.output.strip() == str(runtime.workspace)
        assert (runtime.workspace / "file").read_text() == "made\n"
    finally:
        await runtime.close()


async def test_close_removes_everything_including_read_only_folders_and_is_idempotent(provider):
    runtime = await provider.create(spec(), name="s")
    cache = runtime.workspace / "cache" / "module"
    cache.mkdir(parents=True)
    (cache / "file").write_text("x")
    cache.chmod(0o500)
    cache.parent.chmod(0o500)
    await runtime.close()
    assert not runtime.root.exists()
    await runtime.close()
    assert not runtime.root.exists()


# ----------------------------------------------------------------------------------- templates


async def test_a_template_folder_is_copied_and_left_untouched(provider, tmp_path):
    template = tmp_path / "template"
    (template / "src").mkdir(parents=True)
    (template / "src" / "main.py").write_text("print('hi')\n")
    (template / "README").write_text("read me\n")
    (template / "link").symlink_to("README")
    runtime = await provider.create(spec(template=str(template)), name="s")
    try:
        assert files(runtime.workspace) == {"README": "read me\n", "link": "read me\n", "src/main.py": "print('hi')\n"}
        assert (runtime.workspace / "link").is_symlink()
        (runtime.workspace / "README").write_text("changed by the agent\n")
        assert (template / "README").read_text() == "read me\n"
    finally:
        await runtime.close()


async def test_a_git_repository_folder_is_cloned_with_only_its_committed_files(provider, repository):
    runtime = await provider.create(spec(template=str(repository)), name="s")
    try:
        assert files(runtime.workspace) == {"solution.py": "answer = 1\n", "tests/test_it.py": "assert True\n"}
    finally:
        await runtime.close()


async def test_a_git_url_is_cloned(provider, repository):
    runtime = await provider.create(spec(template=repository.as_uri()), name="s")
    try:
        assert files(runtime.workspace) == {"solution.py": "answer = 1\n", "tests/test_it.py": "assert True\n"}
        # --depth 1: one commit of history, whatever the repository has.
        log = subprocess.run(["git", "log", "--oneline"], cwd=runtime.workspace, capture_output=True, text=True)
        assert len(log.stdout.splitlines()) == 1
    finally:
        await runtime.close()


async def test_a_template_that_is_neither_folder_nor_repository_fails_and_leaves_nothing(provider, tmp_path, work_root):
    missing = tmp_path / "no-such-template"
    with pytest.raises(RuntimeFailure) as failure:
        await provider.create(spec(template=str(missing)), name="s")
    message = str(failure.value)
    assert f"template {str(missing)!r}: git clone: exited with code 128" in message
    assert "does not exist" in message  # git's own words, from the output tail
    assert list(work_root.iterdir()) == []


# ------------------------------------------------------------------------------------- prepare


async def test_prepare_commands_run_in_order_in_the_workspace_with_the_session_home(provider, tmp_path):
    template = tmp_path / "template"
    template.mkdir()
    (template / "input").write_text("3\n")
    prepare = ["echo one > order", 'echo two >> order; echo "$HOME" > home_was; pwd > cwd_was']
    runtime = await provider.create(spec(template=str(template), prepare=prepare), name="s")
    try:
        assert (runtime.workspace / "order").read_text() == "one\ntwo\n"
        assert (runtime.workspace / "home_was").read_text().strip() == str(runtime.home)
        assert (runtime.workspace / "cwd_was").read_text().strip() == str(runtime.workspace)
    finally:
        await runtime.close()


async def test_a_failing_prepare_step_is_named_with_its_exit_code_and_output_and_leaves_nothing(provider, work_root):
    prepare = ["true", "echo installing deps; echo 'error: no such package' >&2; exit 3", "echo never > ran"]
    with pytest.raises(RuntimeFailure) as failure:
        await provider.create(spec(prepare=prepare), name="s")
    message = str(failure.value)
    assert message.startswith("prepare[1] ")
    assert "exited with code 3" in message
    assert message.endswith("installing deps\nerror: no such package")
    assert list(work_root.iterdir()) == []


async def test_a_prepare_step_killed_by_a_signal_says_which(provider, work_root):
    with pytest.raises(RuntimeFailure, match=r"prepare\[0\] .*killed by signal SIGKILL; no output"):
        await provider.create(spec(prepare=["kill -KILL $$"]), name="s")
    assert list(work_root.iterdir()) == []


async def test_a_prepare_step_past_the_timeout_is_stopped_and_fails(work_root):
    provider = LocalProvider(work_root, step_timeout_s=0.3)
    with pytest.raises(RuntimeFailure, match=r"prepare\[0\] 'echo compiling; sleep 60': timed out after 0.3 s"):
        await provider.create(spec(prepare=["echo compiling; sleep 60"]), name="s")
    assert list(work_root.iterdir()) == []


async def test_a_creation_cancelled_midway_leaves_nothing(provider, work_root):
    creating = asyncio.create_task(provider.create(spec(prepare=["touch started; sleep 60"]), name="s"))
    while not list(work_root.glob("*/work/started")):
        await asyncio.sleep(0.02)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    await asyncio.sleep(0.2)  # the folder is removed in a shielded task
    assert list(work_root.iterdir()) == []


# ------------------------------------------------------------------------ fingerprints, providers


def test_spec_key_is_equal_for_equal_specs_and_tells_apart_every_field():
    base = rollout_pb2.RuntimeSpec(kind="docker", template="t", prepare=["a", "b"], image="i")
    same = rollout_pb2.RuntimeSpec(kind="docker", template="t", prepare=["a", "b"], image="i")
    assert spec_key(base) == spec_key(same)
    variants = [
        rollout_pb2.RuntimeSpec(kind="local", template="t", prepare=["a", "b"], image="i"),
        rollout_pb2.RuntimeSpec(kind="docker", template="u", prepare=["a", "b"], image="i"),
        rollout_pb2.RuntimeSpec(kind="docker", template="t", prepare=["b", "a"], image="i"),
        rollout_pb2.RuntimeSpec(kind="docker", template="t", prepare=["a b"], image="i"),
        rollout_pb2.RuntimeSpec(kind="docker", template="t", prepare=["a", "b"], image="j"),
    ]
    keys = {spec_key(variant) for variant in variants}
    assert len(keys) == len(variants) and spec_key(base) not in keys


def test_local_is_always_offered_and_docker_only_when_an_engine_answers(work_root, tmp_path, monkeypatch):
    # No daemon behind the client (one may be starting on this machine meanwhile): docker is not offered.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-daemon.sock'}")
    providers = available_providers(work_root)
    assert isinstance(providers["local"], LocalProvider)
    assert "docker" not in providers and not docker_engine_answers()
    assert all(kind == provider.kind for kind, provider in providers.items())


def test_no_docker_client_means_no_engine():
    assert not docker_engine_answers("no-such-docker-client")


async def test_a_docker_spec_without_an_image_fails_and_leaves_nothing(work_root):
    with pytest.raises(RuntimeFailure, match="needs an image"):
        await DockerProvider(work_root).create(rollout_pb2.RuntimeSpec(kind="docker"), name="s")
    assert list(work_root.iterdir()) == []


@pytest.mark.skipif(shutil.which("docker") is None, reason="needs a docker client")
async def test_a_docker_runtime_without_an_engine_fails_with_the_clients_words(work_root, tmp_path, monkeypatch):
    # The client is pointed at a socket no daemon listens on: on a machine whose daemon runs (or is
    # being started by another tier's setup meanwhile) it must still find no engine.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-daemon.sock'}")
    with pytest.raises(RuntimeFailure) as failure:
        await DockerProvider(work_root).create(rollout_pb2.RuntimeSpec(kind="docker", image="alpine:3"), name="s")
    message = str(failure.value)
    step = "image 'alpine:3': docker image inspect (build or pull the image on this machine first)"
    assert message.startswith(f"{step}: exited with code")
    assert "docker daemon" in message.lower()
    assert list(work_root.iterdir()) == []
