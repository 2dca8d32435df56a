"""The real agent CLIs, launched by their presets, run a tool loop through Envoy and the gateway.

The CLIs are the versions pinned in tests/e2e/harness_install/ (installed there with `npm ci` on first
use). For each preset the scripted model first calls the CLI's own shell tool, then answers once a
tool result is in its prompt: the command must have run in the workspace, every call must be recorded
without error, and the traces built from them must verify. Then each CLI answers one question from
the model `polar up` serves by default, the random tiny one, which ends its replies itself whatever
max tokens the CLI asks for (scripts/try_clis.py times the same against a running stack). Only
127.0.0.1 is contacted (the presets point every base URL at the gateway and turn telemetry and update
checks off).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from polar.inference.engines import EngineOptions, create_engine
from polar.rollout.harness import PRESETS, HarnessContext, prepare_launch
from polar.testing.gateway import running_gateway
from polar.trajectory import build, verify, views_from_protos
from polar.v1 import common_pb2, rollout_pb2

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.node]

CLI_PRESETS = [name for name, preset in PRESETS.items() if preset.shell_tool is not None]
MODEL = "polar-scripted"
SHELL_COMMAND = "echo hello > hello.txt"
FINAL = "Done: hello.txt now contains the word hello."
TIMEOUT_S = 240


async def run_cli(
    preset: str, gw, model: str, instruction: str, harness_bin: Path, tmp_path: Path, context_length: int = 0
) -> tuple[int, str]:
    """Run the preset's CLI on the gateway's session, in tmp_path/work: its exit code and the end of
    its output."""
    home, workspace = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workspace.mkdir()
    context = HarnessContext(
        instruction=instruction,
        base_url=gw.base_url,
        key=gw.key,
        model=model,
        home=home,
        workspace=workspace,
        session_id=gw.key,
        task_id=preset,
        context_length=context_length,
    )
    launch = prepare_launch(rollout_pb2.HarnessSpec(preset=preset), context, search_path=str(harness_bin))
    process = await asyncio.create_subprocess_exec(
        *launch.argv,
        cwd=workspace,
        env=launch.env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)  # the CLI and whatever it started
        await process.wait()
        pytest.fail(f"{preset} ran past {TIMEOUT_S}s")
    return process.returncode, output.decode(errors="replace")[-4000:]


@pytest.mark.parametrize("preset", CLI_PRESETS)
async def test_cli_runs_its_shell_tool_through_the_gateway(preset, harness_bin, tmp_path):
    tool_call = "<tool_call>\n" + json.dumps(PRESETS[preset].shell_tool.call(SHELL_COMMAND)) + "\n</tool_call>"
    script = {
        "name": MODEL,
        "cycle": True,
        "rules": [{"prompt_regex": "<tool_response>", "text": FINAL}],
        "outputs": [{"text": tool_call}],
    }
    workspace = tmp_path / "work"
    async with running_gateway(script) as gw:
        instruction = "Create a file named hello.txt containing the word hello, using the shell."
        returncode, shown = await run_cli(preset, gw, MODEL, instruction, harness_bin, tmp_path)
        records = gw.records()
    assert returncode == 0, shown
    assert FINAL in shown
    assert (workspace / "hello.txt").read_text() == "hello\n", shown
    assert len(records) >= 2
    assert [r.error for r in records if r.error] == []
    calls = views_from_protos(records)
    report = verify(calls, build("prefix_merging", calls).traces)
    assert report.ok, report.render()


@pytest.mark.parametrize("preset", CLI_PRESETS)
async def test_cli_answers_a_question_from_the_default_model(preset, harness_bin, tmp_path):
    # Claude Code asks for 32,000 tokens, Codex for none (the whole context): a model that never
    # ended its replies kept them busy for minutes.
    engine = create_engine("torch", EngineOptions(model="tiny"))
    async with running_gateway(engine=engine) as gw:
        context_length = engine.description.context_length
        question = "In one sentence, what is a hash table?"
        returncode, shown = await run_cli(preset, gw, "tiny", question, harness_bin, tmp_path, context_length)
        records = gw.records()
    assert returncode == 0, shown
    assert records and [r.error for r in records if r.error] == []
    finished = [common_pb2.FinishReason.Name(r.finish_reason) for r in records]
    assert set(finished) == {"FINISH_REASON_STOP"}, finished  # every reply ended by the model itself
