"""Docker runtimes against a real Docker engine (skipped where none answers): commands run in the
container on the bind-mounted session folder, share the host network, leave nothing running, and
the container goes at close. POLAR_TEST_DOCKER_IMAGE picks the image (any with a POSIX sh)."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from polar.rollout.evaluators import evaluate
from polar.rollout.runtimes import DockerProvider, RuntimeFailure, docker_engine_answers
from polar.v1 import rollout_pb2

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.slow,
    pytest.mark.skipif(not docker_engine_answers(), reason="no Docker engine answers"),
]

IMAGE = os.environ.get("POLAR_TEST_DOCKER_IMAGE", "alpine:3.20")


@pytest.fixture
def work_root(tmp_path):
    return tmp_path / "sessions"


@pytest.fixture
def provider(work_root):
    return DockerProvider(work_root, step_timeout_s=300)


def spec(**fields) -> rollout_pb2.RuntimeSpec:
    return rollout_pb2.RuntimeSpec(kind="docker", image=IMAGE, **fields)


def container_exists(name: str) -> bool:
    inspect = subprocess.run(["docker", "container", "inspect", name], capture_output=True)
    return inspect.returncode == 0


async def test_prepare_and_commands_run_in_the_container_on_the_shared_folder(provider, tmp_path):
    template = tmp_path / "template"
    template.mkdir()
    (template / "input").write_text("from the host\n")
    prepare = ["test -f /.dockerenv && cp input copied"]
    runtime = await provider.create(spec(template=str(template), prepare=prepare), name="s")
    try:
        assert runtime.kind == "docker"
        assert (runtime.workspace / "copied").read_text() == "from the host\n"
        env = {"GREETING": "two words\nand a line"}
        result = await runtime.run(["sh", "-c", 'pwd; printf "%s" "$GREETING" > out'], env=env, timeout_s=60)
        assert result.exit_code == 0, result.output
        assert result.output.strip() == str(runtime.workspace)
        assert (runtime.workspace / "out").read_text() == "two words\nand a line"
    finally:
        await runtime.close()


async def test_the_container_shares_the_host_network(provider):
    async def answer(reader, writer):
        await reader.readline()
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    runtime = await provider.create(spec(), name="s")
    try:
        result = await runtime.run(["wget", "-q", "-O", "-", f"http://127.0.0.1:{port}/"], env={}, timeout_s=60)
        assert result.output == "hello", result.output
    finally:
        await runtime.close()
        server.close()


async def test_a_timed_out_command_leaves_nothing_running_in_the_container(provider):
    runtime = await provider.create(spec(), name="s")
    try:
        result = await runtime.run(["sh", "-c", "sleep 300 & echo $! > ../bg; sleep 300"], env={}, timeout_s=1)
        assert result.timed_out
        background = (runtime.root / "bg").read_text().strip()
        check = await runtime.run(["sh", "-c", f"kill -0 {background}"], env={}, timeout_s=60)
        assert check.exit_code != 0
    finally:
        await runtime.close()


async def test_background_children_do_not_outlive_their_command(provider):
    runtime = await provider.create(spec(), name="s")
    try:
        result = await runtime.run(["sh", "-c", "sleep 300 & echo $! > ../bg"], env={}, timeout_s=60)
        assert result.exit_code == 0 and result.seconds < 30
        background = (runtime.root / "bg").read_text().strip()
        check = await runtime.run(["sh", "-c", f"kill -0 {background}"], env={}, timeout_s=60)
        assert check.exit_code != 0
    finally:
        await runtime.close()


async def test_close_removes_the_container_and_the_folder(provider):
    runtime = await provider.create(spec(), name="s")
    await runtime.run(["sh", "-c", "mkdir -p deep/er && touch deep/er/file"], env={}, timeout_s=60)
    assert container_exists(runtime.container)
    await runtime.close()
    await runtime.close()
    assert not container_exists(runtime.container)
    assert not runtime.root.exists()


async def test_a_failing_prepare_step_removes_the_container_and_the_folder(provider, work_root):
    with pytest.raises(RuntimeFailure, match=r"prepare\[0\] .*exited with code 4; output ends:\nno luck"):
        await provider.create(spec(prepare=["echo no luck; exit 4"]), name="s")
    assert list(work_root.iterdir()) == []
    # Each container is labelled with its session folder.
    label = "polar.rollout.session"
    listing = ["docker", "ps", "--all", "--filter", f"label={label}", "--format", f'{{{{.Label "{label}"}}}}']
    folders = subprocess.run(listing, capture_output=True, text=True).stdout.split()
    assert not [folder for folder in folders if folder.startswith(str(work_root))]


async def test_a_command_evaluator_in_the_container_writes_the_reward_file(provider):
    runtime = await provider.create(spec(), name="s")
    try:
        evaluator = rollout_pb2.EvaluatorSpec(kind="command", command='echo 0.25 > "$POLAR_REWARD_FILE"; echo 0.9')
        task = rollout_pb2.Task(task_id="t", instruction="do it")
        evaluation = await evaluate(evaluator, runtime=runtime, task=task, session_id="t.0")
        assert (evaluation.reward, evaluation.error) == (0.25, "")
    finally:
        await runtime.close()
