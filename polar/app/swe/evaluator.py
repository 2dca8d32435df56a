"""The "swe" evaluator: a repository task's reward from its tests (EvaluatorSpec.swe, SweTests).

    1. a fresh runtime of the task's own RuntimeSpec (the repository at its base commit, prepared by
       the node, untouched by the agent);
    2. the agent's change: the session workspace's diff from that base (polar.app.swe.changes, which
       reads the workspace without trusting its `.git`); an empty change is 0 at once;
    3. the change applied to the fresh copy, then the test patch;
    4. the test command run there (sandboxed like any command of the runtime, with the evaluator's
       timeout), its log parsed per test (polar.app.swe.grading): 1 only when every FAIL_TO_PASS test
       passes and every PASS_TO_PASS test still passes.

Nothing the agent left behind runs: its processes ended with the harness, and only its diff reaches
the copy that is tested. What the change does when its code runs under the tests is the limit: code
imported by the tests runs in pytest's process and could forge its report, as with any grader that
runs the code it grades.

A reward of 0 because of the change (empty, too large, not applying, failing tests, no results) is
a completed session with the reason in its metadata; a task whose own parts fail (the fresh copy, the
test patch) is an evaluator error, and the session fails.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from polar.app.node.process import ProcessStartError, exit_text
from polar.app.node.runtimes.base import Runtime, RuntimeFailure, RuntimeProvider
from polar.app.swe.changes import DEFAULT_MAX_BYTES, ChangeRefused, git_env, workspace_change
from polar.app.swe.grading import Grade, files_in_patch, files_to_test, grade, parse_pytest_log
from polar.v1 import rollout_pb2

DEFAULT_TEST_COMMAND = "python -m pytest -rA -p no:cacheprovider {files}"
# The test log read for parsing (its tail holds the summary); what is kept of it is smaller.
TEST_LOG_LIMIT = 4 << 20
KEPT_LOG_CHARS = 16384
KEPT_PATCH_CHARS = 65536
APPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SweEvaluation:
    reward: float
    log: str  # the test command's output, bounded ("" when it did not run)
    error: str  # "" unless the task's own parts failed
    metadata: dict[str, str] = field(default_factory=dict)


async def evaluate_swe(
    tests: rollout_pb2.SweTests,
    *,
    runtime_spec: rollout_pb2.RuntimeSpec,
    workspace: Path,
    provider: RuntimeProvider,
    name: str,
    timeout_s: float,
    output_limit: int = KEPT_LOG_CHARS,
    run_empty: bool = False,
) -> SweEvaluation:
    """Grade the change in `workspace` (see the module docstring). `run_empty`: run the tests even
    for an empty change (`polar tasks oracle` checks that FAIL_TO_PASS tests fail at the base)."""
    metadata = {"swe_instance": tests.instance_id}
    try:
        fresh = await provider.create(runtime_spec, name=f"{name}-grade")
    except RuntimeFailure as exc:
        return SweEvaluation(0.0, "", f"a fresh copy of the task's runtime: {exc}", metadata)
    try:
        return await _grade_in(fresh, tests, workspace, timeout_s, output_limit, run_empty, metadata)
    finally:
        await asyncio.shield(fresh.close())


async def _grade_in(
    fresh: Runtime,
    tests: rollout_pb2.SweTests,
    workspace: Path,
    timeout_s: float,
    output_limit: int,
    run_empty: bool,
    metadata: dict[str, str],
) -> SweEvaluation:
    def zero(reason: str, log: str = "") -> SweEvaluation:
        metadata["swe_reason"] = reason
        return SweEvaluation(0.0, log, "", metadata)

    test_patch_files = files_in_patch(tests.test_patch)
    try:
        max_bytes = tests.max_patch_bytes or DEFAULT_MAX_BYTES
        change = await workspace_change(workspace, fresh.workspace, test_patch_files, max_bytes=max_bytes)
    except ChangeRefused as exc:
        return zero(f"the change was not graded: {exc}")
    metadata["swe_patch"] = _bounded(change.patch.decode("utf-8", "replace"), KEPT_PATCH_CHARS, head=True)
    if change.dropped:
        metadata["swe_dropped"] = "; ".join(change.dropped)
    if not change.patch and not run_empty:
        return zero("empty change: nothing was graded")
    if change.patch and (problem := await apply_patch(fresh, change.patch, "agent.patch")):
        return zero(f"the change does not apply to the base commit: {problem}")
    if tests.test_patch and (problem := await apply_patch(fresh, tests.test_patch.encode(), "test.patch")):
        return SweEvaluation(0.0, "", f"the test patch does not apply: {problem}", metadata)

    ids = [*tests.fail_to_pass, *tests.pass_to_pass]
    files = shlex.join(files_to_test(tests.test_patch, ids))
    command = (tests.test_command or DEFAULT_TEST_COMMAND).replace("{files}", files)
    env = fresh.command_env(_python_first(fresh))
    try:
        result = await fresh.run(["sh", "-c", command], env=env, timeout_s=timeout_s, output_limit=TEST_LOG_LIMIT)
    except ProcessStartError as exc:
        return SweEvaluation(0.0, "", f"the test command could not start: {exc}", metadata)
    log = _bounded(result.output, output_limit)
    metadata["swe_test_log"] = _bounded(result.output, KEPT_LOG_CHARS)
    if result.timed_out:
        return zero(f"the tests ran past {timeout_s:g} s", log)
    outcome: Grade = grade(tests.fail_to_pass, tests.pass_to_pass, parse_pytest_log(result.output))
    metadata.update({f"swe_{key}": value for key, value in outcome.counts().items()})
    if outcome.reward == 1.0:
        return SweEvaluation(1.0, log, "", metadata)
    reason = outcome.reason
    if result.exit_code < 0:
        reason += f" (the test command {exit_text(result.exit_code)})"
    return zero(reason, log)


async def apply_patch(fresh: Runtime, patch: bytes, file_name: str) -> str:
    """Apply `patch` to the runtime's workspace with git (the runtime's own `.git`, which only a fresh
    runtime can be trusted with); "" or what went wrong."""
    path = fresh.root / file_name  # outside the workspace, so the patch is not part of the tree
    path.write_bytes(patch if patch.endswith(b"\n") else patch + b"\n")
    env = fresh.command_env(git_env(fresh.home))
    argv = ["git", "apply", "--binary", "--whitespace=nowarn", str(path)]
    try:
        result = await fresh.run(argv, env=env, timeout_s=APPLY_TIMEOUT_S)
    except ProcessStartError as exc:
        return str(exc)
    if result.timed_out:
        return f"git apply ran past {APPLY_TIMEOUT_S:g} s"
    return "" if result.exit_code == 0 else _bounded(result.output.strip() or exit_text(result.exit_code), 2000)


def _python_first(runtime: Runtime) -> dict[str, str]:
    """On this machine (the local runtime), the node's own Python comes first on PATH, so `python`
    in a test command is the interpreter the node runs with (and has pytest); a container keeps its own."""
    if runtime.kind != "local":
        return {}
    return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])}


def _bounded(text: str, limit: int, *, head: bool = False) -> str:
    """`text` cut to `limit` characters, marked where cut: its tail (a log's summary is at its
    end), or with `head` its start."""
    if len(text) <= limit:
        return text
    mark = f"[… {len(text) - limit} characters omitted …]"
    return text[:limit] + "\n" + mark if head else mark + "\n" + text[-limit:]
