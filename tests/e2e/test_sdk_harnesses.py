"""The SDK harness programs (tests/e2e/sdk_harnesses/) run their tool loop through the gateway.

Each program is launched by the "command" preset, exactly as a node launches a task's command, so it
finds the gateway only through the preset's environment. The scripted model asks for write_file, then
(once a tool result is in its prompt) answers; the file must appear in the workspace, both calls must
arrive in that SDK's dialect, the second must extend the first token for token, and the traces built
from them must verify.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from polar.rollout.harness import HarnessContext, prepare_launch
from polar.testing.gateway import GatewayHandle
from polar.trajectory import build, verify, views_from_protos
from polar.v1 import common_pb2, rollout_pb2
from tests.helpers.gateway_options import GatewayOptions

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

HARNESSES = Path(__file__).resolve().parent / "sdk_harnesses"
MODEL = "polar-scripted"
FINAL = "Done: hello.txt holds hello."
WRITE_CALL = {"name": "write_file", "arguments": {"path": "out/hello.txt", "content": "hello\n"}}
SCRIPT = {
    "name": MODEL,
    "cycle": True,
    "rules": [{"prompt_regex": "<tool_response>", "text": FINAL}],
    "outputs": [{"text": "<tool_call>\n" + json.dumps(WRITE_CALL) + "\n</tool_call>"}],
}
PROGRAMS = {
    "openai_chat": common_pb2.DIALECT_OPENAI_CHAT,
    "openai_responses": common_pb2.DIALECT_OPENAI_RESPONSES,
    "anthropic_messages": common_pb2.DIALECT_ANTHROPIC_MESSAGES,
    "google_genai": common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT,
}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    return GatewayOptions(SCRIPT)


@pytest.mark.parametrize("program", PROGRAMS)
async def test_sdk_harness_runs_its_tool_loop_through_the_gateway(program, gateway: GatewayHandle, tmp_path):
    key = gateway.open_session(task_id=program)
    home, workspace = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workspace.mkdir()
    context = HarnessContext(
        instruction="Write hello into out/hello.txt.",
        base_url=gateway.base_url,
        key=key,
        model=MODEL,
        home=home,
        workspace=workspace,
        session_id=key,
        task_id=program,
    )
    spec = rollout_pb2.HarnessSpec(preset="command", command=[sys.executable, str(HARNESSES / f"{program}.py")])
    launch = prepare_launch(spec, context)
    process = await asyncio.create_subprocess_exec(
        *launch.argv,
        cwd=workspace,
        env=launch.env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    assert process.returncode == 0, stderr.decode()
    assert stdout.decode().strip() == FINAL
    assert (workspace / "out" / "hello.txt").read_text() == "hello\n"

    records = gateway.records(key)
    assert [r.dialect for r in records] == [PROGRAMS[program]] * 2
    assert [r.error for r in records] == ["", ""]
    assert records[1].extends_call_id == records[0].call_id
    calls = views_from_protos(records)
    result = build("prefix_merging", calls)
    assert len(result.traces) == 1
    report = verify(calls, result.traces)
    assert report.ok, report.render()
