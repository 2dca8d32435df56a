"""Real harnesses end to end through `polar submit`: task file in, verified GRPO group out.

For each agent CLI preset (codex, claude-code, qwen-code, gemini-cli, pi; the versions pinned in
harness_install/) and each SDK harness program (sdk_harnesses/, preset "command"), a task file is
submitted with the real `polar submit` to a real rollout server with one gateway node
(polar/testing/rollout.py). The node runs the harness in a fresh workspace; the scripted model first
calls the harness's own shell (CLIs) or write_file (SDK programs) tool, then answers once the tool
result is in its prompt. The task's command evaluator looks for the tool's effect in the workspace.
The released group is read from the results stream and exported with the real `polar results`; both
must hold the same trajectories, each completed with reward 1.0 and the model's answer in the
harness's output, its calls in the harness's dialect, the second call extending the first token for
token, and traces that verify against the calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from polar.config import NodeConfig
from polar.rollout.harness import PRESETS
from polar.testing.rollout import TEST_NODE, running_rollout
from polar.trajectory import verify, views_from_protos
from polar.trajectory.records import BuiltTrace
from polar.v1 import common_pb2

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SDK_HARNESSES = Path(__file__).resolve().parent / "sdk_harnesses"
MODEL = "polar-scripted"
FINAL = "Done: hello.txt holds hello."
HARNESS_TIMEOUT_S = 240  # the task's timeout: a CLI that hangs is killed and reported, not waited on
CLI_INSTRUCTION = "Create a file named hello.txt containing the word hello, using the shell."
SDK_INSTRUCTION = "Write hello into out/hello.txt."
CLI_DIALECTS = {
    "codex": common_pb2.DIALECT_OPENAI_RESPONSES,
    "claude-code": common_pb2.DIALECT_ANTHROPIC_MESSAGES,
    "qwen-code": common_pb2.DIALECT_OPENAI_CHAT,
    "gemini-cli": common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT,
    "pi": common_pb2.DIALECT_OPENAI_CHAT,
}
SDK_DIALECTS = {
    "openai_chat": common_pb2.DIALECT_OPENAI_CHAT,
    "openai_responses": common_pb2.DIALECT_OPENAI_RESPONSES,
    "anthropic_messages": common_pb2.DIALECT_ANTHROPIC_MESSAGES,
    "google_genai": common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT,
}
# One CLI and one SDK program run a whole GRPO group of two sessions at once; the rest one session.
GROUP_SIZES = {"codex": 2, "openai_chat": 2}
OUTCOME = common_pb2.SessionOutcome


def scripted_model(tool_call: dict) -> dict:
    """A model that calls `tool_call` until a tool result is in its prompt, then answers FINAL."""
    return {
        "name": MODEL,
        "cycle": True,
        "rules": [{"prompt_regex": "<tool_response>", "text": FINAL}],
        "outputs": [{"text": "<tool_call>\n" + json.dumps(tool_call) + "\n</tool_call>"}],
    }


def test_every_cli_preset_is_covered() -> None:
    assert set(CLI_DIALECTS) == {name for name, preset in PRESETS.items() if preset.shell_tool is not None}


def found_hello(path: str) -> str:
    """An evaluator command: exit 0 when `path` holds hello, else exit 1 saying what it holds (a line
    that is never a number, so the exit code decides the reward)."""
    return f'test "$(cat {path})" = hello || {{ echo "{path}: $(cat {path} 2>&1)"; exit 1; }}'


@pytest.mark.node
@pytest.mark.parametrize("preset", list(CLI_DIALECTS))
async def test_cli_harness_solves_a_submitted_task(preset: str, harness_bin: Path, tmp_path: Path) -> None:
    group_size = GROUP_SIZES.get(preset, 1)
    task = {
        "instruction": CLI_INSTRUCTION,
        "groupSize": group_size,
        "harness": {"preset": preset},
        "evaluator": {"kind": "command", "command": found_hello("hello.txt")},
        "timeoutSeconds": HARNESS_TIMEOUT_S,
    }
    script = scripted_model(PRESETS[preset].shell_tool.call("echo hello > hello.txt"))
    node = dataclasses.replace(TEST_NODE, harness_path=str(harness_bin))
    task_id, group = await _submit_and_export(task, script, node, tmp_path)
    _assert_solved(group, task_id, group_size, CLI_DIALECTS[preset])


@pytest.mark.parametrize("program", list(SDK_DIALECTS))
async def test_sdk_harness_solves_a_submitted_task(program: str, tmp_path: Path) -> None:
    group_size = GROUP_SIZES.get(program, 1)
    task = {
        "instruction": SDK_INSTRUCTION,
        "groupSize": group_size,
        "harness": {"preset": "command", "command": [sys.executable, str(SDK_HARNESSES / f"{program}.py")]},
        "evaluator": {"kind": "command", "command": found_hello("out/hello.txt")},
        "timeoutSeconds": HARNESS_TIMEOUT_S,
    }
    script = scripted_model({"name": "write_file", "arguments": {"path": "out/hello.txt", "content": "hello\n"}})
    task_id, group = await _submit_and_export(task, script, TEST_NODE, tmp_path)
    _assert_solved(group, task_id, group_size, SDK_DIALECTS[program])


async def _submit_and_export(
    task: dict, script: dict, node: NodeConfig, tmp_path: Path
) -> tuple[str, list[common_pb2.Trajectory]]:
    """Submit `task` with `polar submit`, wait for its group on the results stream, export it with
    `polar results`; the exported group must equal the streamed one. Returns (task id, group)."""
    tasks_file, export_file = tmp_path / "tasks.jsonl", tmp_path / "results.jsonl"
    tasks_file.write_text(json.dumps(task) + "\n")
    async with running_rollout(script, node=node) as rollout:
        [task_id] = (await _polar("submit", str(tasks_file), "--rollout", rollout.address)).split()
        [streamed] = await rollout.groups(1, timeout_s=HARNESS_TIMEOUT_S + 60)
        await _polar("results", "--export", str(export_file), "--rollout", rollout.address)
    exported = [json_format.Parse(line, common_pb2.Trajectory()) for line in export_file.read_text().splitlines()]
    assert exported == streamed, "the export differs from the results stream"
    return task_id, exported


async def _polar(*args: str) -> str:
    """Run the `polar` command (in a subprocess, so the services in this loop keep serving); its stdout."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "polar",
        *args,
        cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, f"polar {' '.join(args)} exited {process.returncode}: {stderr.decode()}"
    return stdout.decode()


def _assert_solved(group: list[common_pb2.Trajectory], task_id: str, group_size: int, dialect: int) -> None:
    assert [t.session_id for t in group] == [f"{task_id}.{i}" for i in range(group_size)]
    for trajectory in group:
        why = _describe(trajectory)
        assert trajectory.group_id == task_id, why
        assert OUTCOME.Name(trajectory.outcome) == "SESSION_OUTCOME_COMPLETED", why
        assert (trajectory.harness_exit_code, trajectory.reward) == (0, 1.0), why
        assert FINAL in trajectory.harness_output, why  # the model's answer reached the harness
        calls = trajectory.calls
        assert len(calls) >= 2, why
        assert [c.dialect for c in calls] == [dialect] * len(calls), why
        assert [c.error for c in calls if c.error] == [], why
        report = verify(views_from_protos(calls), [BuiltTrace.from_proto(trace) for trace in trajectory.traces])
        assert report.ok, report.render() + "\n" + why
        # One merged chain: the answer's prompt is the tool call's prompt and sample, then the tool result.
        first, second = calls[0], calls[1]
        assert second.extends_call_id == first.call_id, why
        sampled = [*first.prompt_token_ids, *first.sampled_token_ids]
        assert list(second.prompt_token_ids[: len(sampled)]) == sampled, why


def _describe(trajectory: common_pb2.Trajectory) -> str:
    """What a reader needs when an assertion fails: how the session ended and what the harness and
    evaluator printed."""
    dialects = [common_pb2.Dialect.Name(c.dialect) for c in trajectory.calls]
    return (
        f"\nsession {trajectory.session_id}: {OUTCOME.Name(trajectory.outcome)}, reward {trajectory.reward}, "
        f"{len(trajectory.calls)} calls {dialects}\n"
        f"error: {trajectory.error or '-'}\n"
        f"harness exit code: {trajectory.harness_exit_code} (0 also when it never started)\n"
        f"--- harness output ---\n{trajectory.harness_output[-6000:]}\n"
        f"--- evaluator output ---\n{trajectory.evaluator_output}"
    )
