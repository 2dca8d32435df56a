"""The "harbor" evaluator: a Harbor task's reward from its tests/test.sh (EvaluatorSpec.harbor).

    1. a fresh container of the verifier's image (the task's image with tests/ at /tests), the
       task's runtime otherwise: its workspace (the image's WORKDIR) replaced by a copy of the
       session's, so what the agent left in its workspace is what is tested, and nothing else of
       its container (its processes, files elsewhere) reaches the verifier;
    2. `bash /tests/test.sh` there, in the workspace, with task.toml's [verifier] env and the
       evaluator's timeout;
    3. the reward: the number in /logs/verifier/reward.json's "reward", else in reward.txt.

A test.sh that runs past its timeout scores 0 with the reason in the metadata (the agent's code can
make tests hang); one that writes no reward, or no number, is an evaluator error (the task's
verifier is broken), and the session fails, as Harbor fails such a trial.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from polar.app.node.process import ProcessStartError, exit_text
from polar.app.node.runtimes.base import Runtime, RuntimeFailure, RuntimeProvider, remove_tree
from polar.v1 import rollout_pb2

VERIFIER_DIR = "/logs/verifier"
TEST_COMMAND = f"mkdir -p {VERIFIER_DIR} /logs/agent && exec bash /tests/test.sh"
# Prints the reward file's name, then at most 4 KiB of it; exit 3 when there is none.
READ_REWARD = (
    f"cd {VERIFIER_DIR} 2>/dev/null || exit 3; for name in reward.json reward.txt; do "
    'if [ -f "$name" ]; then echo "$name"; head -c 4096 "$name"; exit 0; fi; done; exit 3'
)
READ_TIMEOUT_S = 60.0
KEPT_LOG_CHARS = 16384


@dataclass(frozen=True)
class HarborEvaluation:
    reward: float
    log: str  # test.sh's output, bounded
    error: str  # "" unless the task's own parts failed
    metadata: dict[str, str] = field(default_factory=dict)


async def evaluate_harbor(
    tests: rollout_pb2.HarborTests,
    *,
    runtime_spec: rollout_pb2.RuntimeSpec,
    workspace: Path,
    provider: RuntimeProvider,
    name: str,
    timeout_s: float,
    output_limit: int = KEPT_LOG_CHARS,
) -> HarborEvaluation:
    """Grade the files in `workspace` (see the module docstring)."""
    metadata = {"harbor_task": tests.name}
    spec = rollout_pb2.RuntimeSpec()
    spec.CopyFrom(runtime_spec)
    spec.image = tests.image
    try:
        fresh = await provider.create(spec, name=f"{name}-verify")
    except RuntimeFailure as exc:
        return HarborEvaluation(0.0, "", f"a fresh container of the verifier's image: {exc}", metadata)
    try:
        await asyncio.to_thread(replace_contents, fresh.workspace, workspace)
        return await _verify_in(fresh, tests, timeout_s, output_limit, metadata)
    finally:
        await asyncio.shield(fresh.close())


def replace_contents(target: Path, source: Path) -> None:
    """`target`'s files become a copy of `source`'s (links copied as links); the folder stays, so
    a mount of it stays."""
    for child in list(target.iterdir()):
        if child.is_dir() and not child.is_symlink():
            remove_tree(child)
        else:
            child.unlink()
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)


async def _verify_in(
    fresh: Runtime, tests: rollout_pb2.HarborTests, timeout_s: float, output_limit: int, metadata: dict[str, str]
) -> HarborEvaluation:
    env = fresh.command_env(dict(tests.env))
    try:
        result = await fresh.run(["sh", "-c", TEST_COMMAND], env=env, timeout_s=timeout_s, output_limit=output_limit)
    except ProcessStartError as exc:
        return HarborEvaluation(0.0, "", f"tests/test.sh could not start: {exc}", metadata)
    log = result.output
    metadata["harbor_test_log"] = log[-KEPT_LOG_CHARS:]
    if result.timed_out:
        metadata["harbor_reason"] = f"tests/test.sh ran past {timeout_s:g} s"
        return HarborEvaluation(0.0, log, "", metadata)
    try:
        read = await fresh.run(["sh", "-c", READ_REWARD], env=fresh.command_env({}), timeout_s=READ_TIMEOUT_S)
    except ProcessStartError as exc:
        return HarborEvaluation(0.0, log, f"reading the reward: {exc}", metadata)
    ended = f"tests/test.sh {exit_text(result.exit_code)}" if result.exit_code else "tests/test.sh exited 0"
    if read.exit_code != 0:
        return HarborEvaluation(0.0, log, f"{ended} and wrote no {VERIFIER_DIR}/reward.txt nor reward.json", metadata)
    file_name, _, text = read.output.partition("\n")
    reward = parse_reward(file_name, text)
    if reward is None:
        return HarborEvaluation(0.0, log, f"{VERIFIER_DIR}/{file_name} holds {text[:200]!r}, not a reward", metadata)
    return HarborEvaluation(reward, log, "", metadata)


def parse_reward(file_name: str, text: str) -> float | None:
    """reward.txt's number, or reward.json's "reward"; None when it holds no finite number."""
    if file_name == "reward.json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        value = value.get("reward") if isinstance(value, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        number = float(value)
    else:
        try:
            number = float(text.strip())
        except ValueError:
            return None
    return number if math.isfinite(number) else None
