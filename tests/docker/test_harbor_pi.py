"""A Harbor task (examples/harbor-mini's word-count) run by the real Pi CLI inside its container,
through `polar up --submit` on the tiny model, and graded by the task's own tests/test.sh in a fresh
container of the verifier's image:

- the tiny model, sampled as it is, writes no count: the session completes with reward 0, and the
  verifier's log says what it expected;
- forced to run the solution's command with Pi's bash tool, the session scores 1.
(`polar tasks oracle` giving the solution 1 and nothing 0 is in test_harbor.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar.rollout.harness import PRESETS
from tests.helpers.agent_clis import installed_clis
from tests.helpers.polar_command import run
from tests.helpers.stack_config import write_stack_config
from tests.helpers.swe_sessions import describe, run_and_export

pytestmark = pytest.mark.node

WORD_COUNT = Path(__file__).resolve().parents[2] / "examples" / "harbor-mini" / "word-count"
SOLUTION = "wc -w < poem.txt | tr -d ' ' > count.txt"
FINAL = "count.txt is written."


def run_word_count(tmp_path: Path, inference: dict) -> dict:
    """Word-count imported for Pi, one session through `polar up --submit`; its trajectory."""
    tasks = tmp_path / "tasks.jsonl"
    imported = run("tasks", "import", "harbor", str(WORD_COUNT), "--preset", "pi", "--out", str(tasks), timeout=600)
    assert imported.returncode == 0, imported.stderr
    config = write_stack_config(
        tmp_path / "stack.toml",
        rollout={"store": tmp_path / "rollout.db", "heartbeat_interval_s": 0.2},
        inference={"engine": "torch", "model": "tiny", **inference},
        envoy={"workers": 1},
        node={"ready_slots": 0, "running_slots": 1, "harness_path": installed_clis()},
    )
    [trajectory] = run_and_export(config, tasks, tmp_path)
    assert trajectory["metadata"]["harbor_task"] == "polar/word-count", describe(trajectory)
    return trajectory


def test_pi_on_the_tiny_model_completes_and_scores_0(tmp_path: Path) -> None:
    trajectory = run_word_count(tmp_path, {})
    assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
    assert trajectory.get("reward", 0.0) == 0.0, describe(trajectory)
    assert len(trajectory["calls"]) >= 1, describe(trajectory)
    assert "count.txt: expected" in trajectory["metadata"]["harbor_test_log"], describe(trajectory)


def test_pi_running_the_solution_with_its_bash_tool_scores_1(tmp_path: Path) -> None:
    call = PRESETS["pi"].shell_tool.call(SOLUTION)
    script = {
        "replies": [
            {"last_message_regex": "<tool_response>", "text": FINAL},
            {"prompt_regex": "Count the words", "text": "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"},
        ],
        "fallback": "I cannot tell which task this is.",
    }
    (tmp_path / "solve.json").write_text(json.dumps(script))
    trajectory = run_word_count(tmp_path, {"forced_replies": tmp_path / "solve.json"})
    assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
    assert trajectory["reward"] == 1.0, describe(trajectory)
    assert len(trajectory["calls"]) >= 2 and FINAL in trajectory["harnessOutput"], describe(trajectory)
