"""Sessions of a real node in containers: the example agent (examples/agent/agent.py, copied into
each workspace by the task's template) runs inside the task's image, calls the model through the
harness URL and writes its file; the command evaluator checks it in the container.

- eight sessions at once complete, and no more `docker run`s than the node's docker_start_limit are
  in flight at any time (measured: the node's docker client logs each one);
- a node SIGKILLed while its session's harness runs in a container leaves that container; the next
  node started on the machine removes it, the rollout server reports the session failed once the
  dead node's timeout passes (max_attempts 1), and the call the dead node delivered is kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
from pathlib import Path

import pytest

from polar.testing.rollout import TEST_NODE, command_task, running_rollout
from polar.v1 import common_pb2
from tests.helpers.docker_engine import logging_docker, most_at_once, polar_containers

pytestmark = pytest.mark.anyio

IMAGE = "polar-base:bookworm"
AGENT = Path(__file__).resolve().parents[2] / "examples" / "agent" / "agent.py"
TOOL_CALL = '<tool_call>\n{"name": "write_file", "arguments": {"path": "out.txt", "content": "hello"}}\n</tool_call>'
SCRIPT = {
    "name": "polar-scripted",
    "cycle": True,
    "rules": [{"prompt_regex": "<tool_response>", "text": "Done: out.txt says hello."}],
    "outputs": [{"text": TOOL_CALL}],
}
FOUND_HELLO = 'test "$(cat out.txt)" = hello'
OUTCOME = common_pb2.SessionOutcome


def container_task(template: Path, *, group_size: int = 1, then: str = ""):
    task = command_task(
        ["sh", "-c", f"python3 agent.py{then}"], group_size=group_size, evaluator=FOUND_HELLO, timeout_s=120
    )
    task.runtime.kind = "docker"
    task.runtime.image = IMAGE
    task.runtime.template = str(template)
    return task


@pytest.fixture
def template(tmp_path: Path) -> Path:
    folder = tmp_path / "template"
    folder.mkdir()
    shutil.copy(AGENT, folder / "agent.py")
    return folder


async def test_eight_container_sessions_complete_within_the_start_cap(tmp_path, template, monkeypatch):
    client, log = logging_docker(tmp_path)
    monkeypatch.setenv("PATH", f"{client.parent}{os.pathsep}{os.environ['PATH']}")
    config = dataclasses.replace(
        TEST_NODE,
        init_workers=8,
        ready_slots=0,
        running_slots=8,
        postrun_workers=4,
        docker_start_limit=2,
        template_roots=str(tmp_path),
        work_root=str(tmp_path / "sessions"),
    )
    async with running_rollout(SCRIPT, node=config) as rollout:
        await rollout.submit(container_task(template, group_size=8))
        [group] = await rollout.groups(1)
    assert len(group) == 8
    for trajectory in group:
        assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, trajectory.error
        assert trajectory.reward == 1.0 and len(trajectory.calls) == 2
    assert len(log.read_text().splitlines()) == 16
    assert most_at_once(log) == 2


async def test_a_killed_nodes_container_goes_with_the_next_node_and_its_session_fails(tmp_path, template):
    from polar.app.stack import node_spec, running
    from polar.config import GatewayConfig, InferenceConfig

    async with running_rollout(
        SCRIPT, node=None, heartbeat_interval_s=0.2, node_timeout_s=2.0, max_attempts=1
    ) as rollout:
        config = dataclasses.replace(TEST_NODE, rollout_address=rollout.address, template_roots=str(tmp_path))
        gateway = GatewayConfig(port=rollout.http_port, grpc_port=0, inference_address=rollout.inference_address)
        spec = node_spec(config, gateway, InferenceConfig(), base_url=rollout.base_url)
        starting = running(spec, 120, 10, http_socket=rollout.http_socket)
        doomed = await asyncio.to_thread(starting.__enter__)
        try:
            # The harness holds its session open after its calls, until the node is gone.
            [task_id] = await rollout.submit(container_task(template, then=" && sleep 300"))
            session_id = f"{task_id}.0"
            async with asyncio.timeout(120):
                while (status := await rollout.session_status(session_id)).call_count < 2:
                    await asyncio.sleep(0.05)
            os.kill(doomed.process.pid, signal.SIGKILL)
            await asyncio.to_thread(doomed.process.wait)
        finally:
            await asyncio.to_thread(starting.__exit__, None, None, None)
        # The session's container, and any the dead node had prewarmed for the same spec.
        left = polar_containers()
        assert left
        await rollout.start_node(dataclasses.replace(TEST_NODE, template_roots=str(tmp_path)))
        assert polar_containers() == [], left
        [[trajectory]] = await rollout.groups(1)
        status = await rollout.session_status(session_id)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_FAILED and status.attempts == 1, trajectory
    # Both calls the dead node delivered in its heartbeats are in the report.
    assert len(trajectory.calls) + len(trajectory.abandoned_calls) == 2, trajectory
