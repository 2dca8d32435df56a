"""SWE-style tasks end to end: examples/swe-mini instances imported with the real `polar tasks
import swe --local`, run by the real Pi CLI through `polar up --submit`, graded by the swe evaluator.

A model that answers each task's issue with a call of Pi's bash tool applying that task's gold patch
(then a final answer once the tool result is in its prompt) scores 1 on every session; the tiny model
(random weights, the torch engine) changes nothing and scores 0. The gold replies are the tiny model's
forced replies (`[inference] forced_replies`, an edge fixture): its own tokens are recorded with its
own logprobs, only their choice is scripted.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest
from agent_clis import installed_clis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import swe_mini  # noqa: E402
from polar_cli import run, spawned  # noqa: E402

from polar.rollout.harness import PRESETS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.node]

NAMES = ["clamp", "roman"]
FINAL = "The patch is applied."
RUN_TIMEOUT_S = 300


def gold_patch_script(instances: list[dict]) -> dict:
    """Forced replies that apply each instance's gold patch with Pi's bash tool, told apart by the
    issue's first line in the prompt; a call after a tool result gets the final answer."""
    replies = [{"last_message_regex": "<tool_response>", "text": FINAL}]
    for instance in instances:
        command = f"git apply <<'POLAR_GOLD_PATCH'\n{instance['patch']}POLAR_GOLD_PATCH"
        call = PRESETS["pi"].shell_tool.call(command)
        first_line = instance["problem_statement"].splitlines()[0]
        replies.append({"prompt_regex": re.escape(first_line), "text": "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"})
    return {"replies": replies, "fallback": "I cannot tell which task this is."}


def stack_config(tmp_path: Path, inference: str, harness_bin: Path, repos: Path) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(
        f'[rollout]\nport = 0\nstore = "{tmp_path / "rollout.db"}"\nheartbeat_interval_s = 0.2\n'
        f"[inference]\n{inference}port = 0\n"
        "[gateway]\nport = 0\ngrpc_port = 0\n"
        "[envoy]\nharness_port = 0\ninference_port = 0\nadmin_port = 0\nworkers = 1\n"
        "[node]\ninit_workers = 2\nready_slots = 0\nrunning_slots = 2\npostrun_workers = 2\n"
        f'harness_path = "{harness_bin}"\ntemplate_roots = "{repos}"\n'
    )
    return path


def import_tasks(tmp_path: Path, repos: Path, instance_file: Path, *extra: str) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    imported = run(
        "tasks", "import", "swe", str(instance_file), "--flavor", "swebench", "--local", str(repos),
        "--preset", "pi", "--timeout", "240", "--out", str(tasks), *extra,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    return tasks


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


@pytest.fixture(scope="module")
def swe_setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    return (installed_clis(), *swe_mini.prepare(tmp_path_factory.mktemp("swe-mini"), NAMES))


def test_pi_applying_the_gold_patch_scores_1(swe_setup, tmp_path: Path) -> None:
    harness_bin, repos, instance_file = swe_setup
    script = tmp_path / "gold.json"
    script.write_text(json.dumps(gold_patch_script(swe_mini.instances(NAMES))))
    config = stack_config(tmp_path, f'engine = "torch"\nmodel = "tiny"\nforced_replies = "{script}"\n', harness_bin, repos)
    # Sampled without truncation, so each forced token keeps a finite logprob.
    tasks = import_tasks(tmp_path, repos, instance_file, "--sampling", '{"topP": 1.0}')
    trajectories = run_and_export(config, tasks, tmp_path)
    assert len(trajectories) == len(NAMES)
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
        assert trajectory["reward"] == 1.0, describe(trajectory)
        metadata = trajectory["metadata"]
        assert metadata["swe_fail_to_pass"].split("/")[0] == metadata["swe_fail_to_pass"].split("/")[1], describe(trajectory)
        assert len(trajectory["calls"]) >= 2 and FINAL in trajectory["harnessOutput"], describe(trajectory)


def test_pi_on_the_tiny_model_scores_0(swe_setup, tmp_path: Path) -> None:
    harness_bin, repos, instance_file = swe_setup
    config = stack_config(tmp_path, 'engine = "torch"\nmodel = "tiny"\n', harness_bin, repos)
    tasks = import_tasks(tmp_path, repos, instance_file, "--sampling", '{"maxTokensPerCall": 24}')
    trajectories = run_and_export(config, tasks, tmp_path)
    assert len(trajectories) == len(NAMES)
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", describe(trajectory)
        assert trajectory.get("reward", 0.0) == 0.0, describe(trajectory)
        assert trajectory["calls"], describe(trajectory)
        assert trajectory["metadata"]["swe_instance"].startswith("polar-mini__"), describe(trajectory)
