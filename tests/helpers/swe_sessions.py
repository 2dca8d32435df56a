"""SWE-mini sessions run through `polar up --submit`, for the e2e and container tiers: forced replies
that apply each instance's gold patch with Pi's bash tool, the run and its exported trajectories."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from polar.rollout.harness import PRESETS
from tests.helpers.polar_command import run, spawned

RUN_TIMEOUT_S = 300
FINAL = "The patch is applied."


def gold_patch_script(instances: list[dict]) -> dict:
    """Forced replies that apply each instance's gold patch with Pi's bash tool, told apart by the
    issue's first line in the prompt; a call after a tool result gets the final answer."""
    replies = [{"last_message_regex": "<tool_response>", "text": FINAL}]
    for instance in instances:
        command = f"git apply <<'POLAR_GOLD_PATCH'\n{instance['patch']}POLAR_GOLD_PATCH"
        call = PRESETS["pi"].shell_tool.call(command)
        first_line = instance["problem_statement"].splitlines()[0]
        replies.append(
            {"prompt_regex": re.escape(first_line), "text": "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"}
        )
    return {"replies": replies, "fallback": "I cannot tell which task this is."}


def run_and_export(config: Path, tasks: Path, tmp_path: Path) -> list[dict]:
    """`polar up --submit`, until every group is released; the exported trajectories."""
    with spawned() as start:
        up, lines = start("up", "--config", str(config), "--submit", str(tasks))
        released = r"^polar up: every group released; export them with .* --rollout (\S+)`"
        rollout = lines.wait_for(released, timeout=RUN_TIMEOUT_S).group(1)
        exported = run("results", "--export", "-", "--rollout", rollout)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    assert exported.returncode == 0, exported.stderr
    return [json.loads(line) for line in exported.stdout.splitlines() if line.startswith("{")]


def describe(trajectory: dict) -> str:
    return (
        f"{trajectory['sessionId']}: {trajectory['outcome']} reward {trajectory.get('reward')} error {trajectory.get('error')}\n"
        f"metadata: { {k: v for k, v in trajectory.get('metadata', {}).items() if k != 'swe_test_log'} }\n"
        f"harness: {trajectory.get('harnessOutput', '')[-3000:]}\nevaluator: {trajectory.get('evaluatorOutput', '')[-3000:]}"
    )
