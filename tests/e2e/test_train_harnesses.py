"""`polar train` through every real agent CLI: GRPO steps on the multi-call, tool-using sessions they make.

A `polar train` run on the tiny model takes steps (STEPS: two for Pi, one for the long prompts) over a
task set with one task per CLI dialect: each step trains on a group of two sessions of every one of
them. Two runs: Pi in its four dialects (1.5k-token prompts), and Codex, Claude Code, Qwen Code and
Gemini CLI (9k to 21k tokens a prompt, which a CPU prefills and trains on far more slowly: attention is
quadratic in them). Starting the stack costs about a minute on two cores, so each run covers several
CLIs rather than one. The long-prompt run is test_train_long_prompts.py's, a module of its own so that
the test processes run the two side by side. The torch engine forces the replies
(polar/inference/engines/forced.py): the first call writes its workspace's path into note.txt with the
CLI's own shell tool, found by its name in the prompt's tools, the second reads it back, the third
answers; every forced token carries the model's own logprob, so the trainer's steps are real ones. The
evaluator reads note.txt from the workspace: 1 for the group's first session, 0.5 for the second when
the file names the session's own workspace, 0 without it, so each group has a learning signal (and a
session whose tool call never ran would show in the reward). Each session must have at least three calls
with a tool result in the chain, every released trace must pass `polar verify`, each step must push its
weights as the next policy version the inference server reports, and neither a harness nor the trainer
may fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import zstandard

from polar.rollout.harness import PRESETS
from polar.rollout.store import RolloutStore
from polar.v1 import common_pb2
from tests.helpers.polar_command import POLAR, Lines
from tests.helpers.stack_config import write_stack_config
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.node]

REPO = Path(__file__).resolve().parents[2]
# The Pi run takes two steps: its second trains on sessions sampled after the first weight update. The
# long-prompt run takes one: its calls prefill 9k-21k tokens each and its step trains on 110k-120k, so a
# second step (which the Pi run already covers) would cost minutes of CI on two cores.
STEPS = {"pi": 2, "long-prompts": 1}
GROUP_SIZE = 2
# Measured on 2 CPU cores shared with other work: the Pi run 64 s (5 minutes under a load of 30 to
# 68); the long-prompt run 26 minutes under that load, before the engine's prefix cache and the
# trainer's tree attention (its calls prefill 9k to 21k tokens each, its steps train on 110k-120k).
RUN_TIMEOUT_S = {"pi": 600, "long-prompts": 2400}
FINAL = "Done: note.txt holds this workspace's path."
# Every CLI dialect: each preset's own, and Pi's four.
D = common_pb2
HARNESSES = {
    "codex": ("codex", D.DIALECT_OPENAI_RESPONSES),
    "claude-code": ("claude-code", D.DIALECT_ANTHROPIC_MESSAGES),
    "qwen-code": ("qwen-code", D.DIALECT_OPENAI_CHAT),
    "gemini-cli": ("gemini-cli", D.DIALECT_GOOGLE_GENERATE_CONTENT),
    "pi-chat": ("pi", D.DIALECT_OPENAI_CHAT),
    "pi-responses": ("pi", D.DIALECT_OPENAI_RESPONSES),
    "pi-anthropic": ("pi", D.DIALECT_ANTHROPIC_MESSAGES),
    "pi-gemini": ("pi", D.DIALECT_GOOGLE_GENERATE_CONTENT),
}
# The reward, from the workspace: the file the first tool call wrote must name the session's own
# workspace (each session has its own); then 1 for the group's first session and 0.5 for the second.
EVALUATOR = (
    'if [ "$(cat note.txt 2>/dev/null)" = "$(pwd -P)" ]; then '
    'case "$POLAR_SESSION_ID" in *.0) echo 1 ;; *) echo 0.5 ;; esac; else echo 0; fi'
)


def test_every_cli_dialect_is_covered() -> None:
    covered = {(preset, dialect) for preset, dialect in HARNESSES.values()}
    assert covered == {(name, d) for name, p in PRESETS.items() for d in p.dialects}


def forced_script() -> dict:
    """Call 1 writes the workspace's path with the CLI's shell tool (the one its tools offer), call 2 reads
    it, call 3 answers; a call that offers no tools (a side call: a title, a next-speaker check) or
    comes later gets "Done."."""
    replies = []
    shells = {preset.shell_tool for preset in PRESETS.values() if preset.shell_tool is not None}
    for shell in sorted(shells, key=lambda tool: tool.name):
        offered = re.escape('{"type": "function", "function": {"name": ' + json.dumps(shell.name))  # in <tools>
        for turn, command in enumerate(("pwd -P > note.txt", "cat note.txt")):
            call = "<tool_call>\n" + json.dumps(shell.call(command)) + "\n</tool_call>"
            replies.append({"turn": turn, "prompt_regex": offered, "text": call})
    replies.append({"turn": 2, "prompt_regex": "<tools>", "text": FINAL})
    return {"replies": replies, "fallback": "Done."}


RUNS = {
    "pi": [name for name, (preset, _) in HARNESSES.items() if preset == "pi"],
    "long-prompts": [name for name, (preset, _) in HARNESSES.items() if preset != "pi"],
}


def write_run(tmp_path: Path, harnesses: list[str], harness_bin: Path, steps: int) -> Path:
    tasks = [
        {
            "taskId": name,
            "instruction": "Write the working directory's path into note.txt with the shell, then read it back.",
            "groupSize": GROUP_SIZE,
            "harness": {"preset": preset, "dialect": D.Dialect.Name(dialect)},
            "evaluator": {"kind": "command", "command": EVALUATOR},
            # Untruncated sampling: a forced token outside a top-k or nucleus set would have logprob -inf.
            "sampling": {"temperature": 1.0, "topP": 1.0, "topK": 0, "maxTokensPerCall": 96},
            # Claude Code's and Qwen Code's calls prefill 20k tokens each: minutes on a shared CPU.
            "timeoutSeconds": 1200,
            "metadata": {"harness": name},
        }
        for name, (preset, dialect) in HARNESSES.items()
        if name in harnesses
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks))
    (tmp_path / "forced.json").write_text(json.dumps(forced_script()))
    return write_stack_config(
        tmp_path / "train.toml",
        # A node is dead after 10 s without a heartbeat by default; under a load of 68 on two shared
        # cores a node missed them while its Gemini CLI session ran, and the session failed as abandoned.
        rollout={"node_timeout_s": 120},
        inference={"max_batch_size": 8, "forced_replies": tmp_path / "forced.json"},
        node={
            "init_workers": 2,
            "ready_slots": 4,
            "running_slots": 4,
            "postrun_workers": 2,
            "harness_path": harness_bin,
        },
        trainer={
            "model": "tiny",
            "device": "cpu",
            "dataset": tmp_path / "tasks.jsonl",
            "steps": steps,
            "groups_per_step": len(harnesses),
            "groups_ahead": 0,
            "lr": 1e-3,
            "seed": 0,
            "checkpoint_every": steps,
        },
    )


def released_trajectories(run_dir: Path) -> list[common_pb2.Trajectory]:
    store = RolloutStore(run_dir / "rollout.db")
    try:
        groups = store.released_groups(0, max_groups=100, max_bytes=2**40)
    finally:
        store.close()
    decompress = zstandard.ZstdDecompressor()
    return [
        common_pb2.Trajectory.FromString(decompress.decompress(blob, max_output_size=2**30))
        for group in groups
        for blob in group.trajectories
    ]


def describe(trajectory: common_pb2.Trajectory) -> str:
    calls = [
        (c.call_id, c.extends_call_id, len(c.prompt_token_ids), len(c.sampled_token_ids), c.error)
        for c in trajectory.calls
    ]
    return (
        f"\nsession {trajectory.session_id}: {D.SessionOutcome.Name(trajectory.outcome)}, reward {trajectory.reward}, "
        f"error {trajectory.error or '-'}, exit {trajectory.harness_exit_code}\ncalls {calls}\n"
        f"--- harness output ---\n{trajectory.harness_output[-4000:]}\n--- evaluator ---\n{trajectory.evaluator_output}"
    )


def test_the_runs_cover_every_cli_dialect() -> None:
    assert sorted(name for names in RUNS.values() for name in names) == sorted(HARNESSES)


@pytest.mark.timeout(RUN_TIMEOUT_S["pi"] + 120)
def test_polar_train_takes_steps_on_pi_sessions_in_every_dialect(harness_bin: Path, tmp_path: Path) -> None:
    check_training_run("pi", harness_bin, tmp_path)


def check_training_run(run: str, harness_bin: Path, tmp_path: Path) -> None:
    """One of RUNS as `polar train`, and every check of this module's docstring on what it left."""
    harnesses, steps = RUNS[run], STEPS[run]
    run_dir = tmp_path / "run"
    started = time.monotonic()
    process = subprocess.Popen(
        [*POLAR, "train", str(write_run(tmp_path, harnesses, harness_bin, steps)), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = Lines(process.stdout)
    try:
        lines.wait_for(rf"train: done: {steps} steps", timeout=RUN_TIMEOUT_S[run])
        assert process.wait(timeout=120) == 0, lines.rest()
    finally:
        process.kill()
    output = "\n".join(lines.rest())
    assert "Traceback" not in output and "error" not in output.lower(), output
    seconds = time.monotonic() - started

    trajectories = released_trajectories(run_dir)
    sessions: dict[str, int] = {}
    for trajectory in trajectories:
        harness = trajectory.metadata["harness"]
        sessions[harness] = sessions.get(harness, 0) + 1
        why = f"{harness}:" + describe(trajectory)
        assert D.SessionOutcome.Name(trajectory.outcome) == "SESSION_OUTCOME_COMPLETED", why
        assert trajectory.harness_exit_code == 0 and not trajectory.error, why
        assert FINAL in trajectory.harness_output, why
        assert trajectory.reward == (1.0 if trajectory.session_id.endswith(".0") else 0.5), why
        calls = trajectory.calls
        assert [c.error for c in calls if c.error] == [], why
        assert {c.dialect for c in calls} == {HARNESSES[harness][1]}, why
        # The write, the read and the answer: a chain of three, each prompt extending a call before it.
        assert len(calls) >= 3 and sum(bool(c.extends_call_id) for c in calls) >= 2, why
        assert not any(c.truncated for c in calls), why
        (tmp_path / f"{trajectory.session_id}.pb").write_bytes(trajectory.SerializeToString())
    assert sessions == dict.fromkeys(harnesses, steps * GROUP_SIZE)
    verified = subprocess.run(
        [*POLAR, "verify", *sorted(str(p) for p in tmp_path.glob("*.pb"))], cwd=REPO, capture_output=True, text=True
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr

    rows = read_metrics(run_dir / "metrics.jsonl")
    # Each step pushed its weights: the policy version the inference server answered with.
    assert [row["policy_version"] for row in rows] == list(range(1, steps + 1)), rows
    for row in rows:
        # Every step took a group of every CLI, each with a signal, and trained on all of them.
        first = len(harnesses) * (row["step"] - 1)
        assert sorted(row["task_ids"]) == [f"train-{n:06d}" for n in range(first, first + len(harnesses))], row
        assert row["groups"] == len(harnesses) and row["groups_degenerate"] == 0, row
        assert row["reward_mean"] == 0.75 and row["traces_truncated_skipped"] == 0, row
        assert row["trainable_tokens"] > 0 and row["grad_norm"] > 0, row
    # The first step scores the forced tokens as the engine did: importance weights of 1.
    assert rows[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-3), rows
    print(f"polar train over {', '.join(harnesses)}: {seconds:.0f} s for {steps} steps")
