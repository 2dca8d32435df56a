"""The docker runtime against a real engine: commands in the container on the session folder, the
workspace filled from the image where the task says, the limits applied, nothing left running
after a command, the container gone at close, at most `start_limit` containers starting at once
(measured through a docker client that logs each `docker run`), and a crashed node's containers
removed by the next one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar.app.node.evaluators import evaluate
from polar.app.node.runtimes import DockerProvider, Limits, RuntimeFailure, available_providers, remove_orphans
from polar.app.node.runtimes.docker import LABEL
from polar.v1 import rollout_pb2
from tests.helpers.docker_engine import logging_docker, most_at_once

pytestmark = pytest.mark.anyio

IMAGE = "polar-base:bookworm"


@pytest.fixture
def work_root(tmp_path):
    return tmp_path / "sessions"


@pytest.fixture
def provider(work_root):
    return DockerProvider(work_root, step_timeout_s=300)


def spec(**fields) -> rollout_pb2.RuntimeSpec:
    return rollout_pb2.RuntimeSpec(kind="docker", image=IMAGE, **fields)


def container_exists(name: str) -> bool:
    return subprocess.run(["docker", "container", "inspect", name], capture_output=True).returncode == 0


def test_a_node_is_offered_docker_where_an_engine_answers(work_root):
    providers = available_providers(work_root)
    assert isinstance(providers["docker"], DockerProvider) and "local" in providers


async def test_prepare_and_commands_run_in_the_container_on_the_session_folder(provider, tmp_path):
    template = tmp_path / "template"
    template.mkdir()
    (template / "input").write_text("from the host\n")
    prepare = ["test -f /.dockerenv && cp input copied"]
    runtime = await provider.create(spec(template=str(template), prepare=prepare), name="s")
    try:
        assert runtime.kind == "docker"
        assert (runtime.workspace / "copied").read_text() == "from the host\n"
        env = runtime.command_env({"GREETING": "two words\nand a line", "OUT": str(runtime.root / "out")})
        script = 'pwd; echo "$HOME"; printf "%s" "$GREETING" > "$OUT"'
        result = await runtime.run(["sh", "-c", script], env=env, timeout_s=60)
        assert result.exit_code == 0, result.output
        # Every session sees the same paths: its folder at /polar/session.
        assert result.output.split() == ["/polar/session/work", "/polar/session/home"]
        assert (runtime.root / "out").read_text() == "two words\nand a line"
    finally:
        await runtime.close()


async def test_the_workspace_is_the_images_folder_where_the_task_says(provider, tmp_path):
    build = tmp_path / "image"
    build.mkdir()
    (build / "Dockerfile").write_text(f"FROM {IMAGE}\nRUN mkdir /testbed && echo base > /testbed/code.py\n")
    image = "polar-test-workdir:latest"
    subprocess.run(["docker", "build", "--quiet", "--tag", image, str(build)], check=True, capture_output=True)
    runtime = await provider.create(rollout_pb2.RuntimeSpec(kind="docker", image=image, workdir="/testbed"), name="s")
    try:
        assert (runtime.workspace / "code.py").read_text() == "base\n"
        result = await runtime.run(["sh", "-c", "pwd; echo changed > code.py"], env={}, timeout_s=60)
        assert result.output.strip() == "/testbed"
        # The node reads what the harness wrote at /testbed in the session folder.
        assert (runtime.workspace / "code.py").read_text() == "changed\n"
    finally:
        await runtime.close()


async def test_limits_come_from_the_task_else_the_nodes_defaults(work_root):
    provider = DockerProvider(work_root, limits=Limits(cpus=1.5, memory_bytes=256 << 20, max_processes=200))
    defaults = await provider.create(spec(), name="defaults")
    own = await provider.create(spec(cpus=0.5, memory_bytes=128 << 20, max_processes=50), name="own")
    try:
        for runtime, (cpus, memory, processes) in [(defaults, (1.5, 256 << 20, 200)), (own, (0.5, 128 << 20, 50))]:
            shown_format = "{{.HostConfig.NanoCpus}} {{.HostConfig.Memory}} {{.HostConfig.PidsLimit}}"
            inspect = ["docker", "inspect", "--format", shown_format, runtime.container]
            shown = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.split()
            assert shown == [str(int(cpus * 1e9)), str(memory), str(processes)]
        # The process limit holds inside: a fork bomb of the task's own is stopped at it.
        result = await own.run(["sh", "-c", "for i in $(seq 80); do sleep 30 & done; wait"], env={}, timeout_s=60)
        assert "fork" in result.output.lower() or "resource" in result.output.lower(), result.output
    finally:
        await asyncio.gather(defaults.close(), own.close())


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


async def test_a_missing_image_is_a_clear_failure(provider, work_root):
    with pytest.raises(RuntimeFailure, match=r"image 'polar-no-such-image:1'.*build or pull the image"):
        await provider.create(rollout_pb2.RuntimeSpec(kind="docker", image="polar-no-such-image:1"), name="s")
    assert list(work_root.iterdir()) == []


async def test_a_command_evaluator_in_the_container_writes_the_reward_file(provider):
    runtime = await provider.create(spec(), name="s")
    try:
        evaluator = rollout_pb2.EvaluatorSpec(kind="command", command='echo 0.25 > "$POLAR_REWARD_FILE"; echo 0.9')
        task = rollout_pb2.Task(task_id="t", instruction="do it")
        evaluation = await evaluate(evaluator, runtime=runtime, task=task, session_id="t.0")
        assert (evaluation.reward, evaluation.error) == (0.25, "")
    finally:
        await runtime.close()


async def test_at_most_start_limit_containers_start_at_once(work_root, tmp_path):
    client, log = logging_docker(tmp_path)
    provider = DockerProvider(work_root, docker=str(client), start_limit=2)
    runtimes = await asyncio.gather(*(provider.create(spec(), name=f"s{index}") for index in range(6)))
    try:
        assert len(log.read_text().splitlines()) == 12
        assert most_at_once(log) == 2
    finally:
        await asyncio.gather(*(runtime.close() for runtime in runtimes))


CRASHING_NODE = """
import asyncio, os, sys, time
from pathlib import Path
from polar.app.node.runtimes import DockerProvider
from polar.v1 import rollout_pb2

async def main():
    provider = DockerProvider(Path(sys.argv[1]))
    runtime = await provider.create(rollout_pb2.RuntimeSpec(kind="docker", image=sys.argv[2]), name="crash")
    print(runtime.container, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_a_crashed_nodes_containers_are_removed_by_the_next_one(provider, work_root):
    # One container of a live owner (this test), one of an owner killed with SIGKILL.
    live = await provider.create(spec(), name="live")
    crashing = subprocess.Popen(
        [sys.executable, "-c", CRASHING_NODE, str(work_root), IMAGE], stdout=subprocess.PIPE, text=True
    )
    try:
        orphan = crashing.stdout.readline().strip()
        assert orphan.startswith("polar-crash-")
        os.kill(crashing.pid, signal.SIGKILL)
        crashing.wait(timeout=30)
        folder = subprocess.run(
            ["docker", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL}"}}}}', orphan],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert container_exists(orphan) and Path(folder).is_dir()
        started = time.monotonic()
        assert remove_orphans() == [orphan]
        assert time.monotonic() - started < 60
        assert not container_exists(orphan) and not Path(folder).exists()
        assert container_exists(live.container)
    finally:
        crashing.kill()
        await live.close()
