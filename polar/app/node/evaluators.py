"""Score a session's workspace after its harness ran: the reward of its trajectory.

Kinds (EvaluatorSpec.kind):
- ""        no evaluator: reward 0.
- "command" `sh -c COMMAND` in the session's runtime, in the workspace. The reward is the number it
            writes to $POLAR_REWARD_FILE if it writes one, else the last line of its output if that is a
            number, else 1.0 for exit code 0 and 0.0 for any other. It also gets POLAR_TASK_ID,
            POLAR_SESSION_ID, POLAR_INSTRUCTION and POLAR_WORKSPACE.
- "python"  "module:function", imported and called as function(workspace: Path, task) in a worker
            thread; it returns the reward.
- "swe"     a repository task graded by its tests (EvaluatorSpec.swe; polar/app/swe/evaluator.py): the
            workspace's diff applied to a fresh runtime of the task, then the test patch, then the
            tests; its counts, patch and log go into the session's metadata.
- "harbor"  a Harbor task's tests/test.sh (EvaluatorSpec.harbor; polar/app/harbor/evaluator.py), run in
            a fresh container of the verifier's image holding a copy of the workspace; the reward is
            the one it writes to /logs/verifier/reward.txt.
- "gym"     a NeMo Gym resources server (EvaluatorSpec.gym): its /seed_session with the row, then its
            /verify with the row and the session's final reply (polar.gym_items.final_response), in
            one cookie session; the reward is the one /verify answers.

An evaluator that crashes (killed by a signal, raises), runs past its timeout, or gives something
that is not a finite number yields reward 0.0 and an `error` saying so; `evaluate` never raises for
it. A Python evaluator that times out cannot be stopped: its thread is abandoned and runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import math
import numbers
import threading
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from polar.app.harbor.evaluator import evaluate_harbor
from polar.app.node.process import OUTPUT_LIMIT, ProcessStartError, exit_text
from polar.app.node.runtimes.base import Runtime, RuntimeProvider
from polar.app.swe.evaluator import evaluate_swe
from polar.gym_items import final_response
from polar.v1 import common_pb2, rollout_pb2

DEFAULT_TIMEOUT_S = 300.0  # EvaluatorSpec.timeout_seconds 0 means this
REWARD_FILE_NAME = "reward"  # in the runtime's root: outside the workspace the harness edits
REWARD_FILE_MAX_BYTES = 4096


@dataclass(frozen=True)
class Evaluation:
    reward: float
    output: str  # the command's output, capped ("" for Python evaluators)
    error: str  # "" unless the evaluator failed (then reward is 0.0)
    metadata: dict[str, str] = field(default_factory=dict)  # added to the trajectory's metadata


class _EvaluatorFailed(Exception):
    """The evaluator gave no reward; the message says why."""


async def evaluate(
    spec: rollout_pb2.EvaluatorSpec,
    *,
    runtime: Runtime,
    task: rollout_pb2.Task,
    session_id: str,
    output_limit: int = OUTPUT_LIMIT,
    provider: RuntimeProvider | None = None,
    calls: list[common_pb2.CallRecord] | None = None,
) -> Evaluation:
    """The session's reward per spec (see the module docstring); failures become Evaluation.error.
    `provider` makes the fresh runtime a "swe" or "harbor" evaluator grades in (the session runtime's kind);
    `calls` are the session's records in order, whose final reply a "gym" evaluator sends."""
    timeout_s = spec.timeout_seconds or DEFAULT_TIMEOUT_S
    if spec.kind == "":
        return Evaluation(0.0, "", "")
    if spec.kind == "swe":
        if provider is None:
            return Evaluation(0.0, "", "a swe evaluator needs the runtime provider to make a fresh copy")
        result = await evaluate_swe(
            spec.swe,
            runtime_spec=task.runtime,
            workspace=runtime.workspace,
            provider=provider,
            name=session_id,
            timeout_s=timeout_s,
            output_limit=output_limit,
        )
        return Evaluation(result.reward, result.log, result.error, result.metadata)
    if spec.kind == "harbor":
        if provider is None:
            return Evaluation(0.0, "", "a harbor evaluator needs the runtime provider to make a fresh container")
        verdict = await evaluate_harbor(
            spec.harbor,
            runtime_spec=task.runtime,
            workspace=runtime.workspace,
            provider=provider,
            name=session_id,
            timeout_s=timeout_s,
            output_limit=output_limit,
        )
        return Evaluation(verdict.reward, verdict.log, verdict.error, verdict.metadata)
    if spec.kind == "gym":
        try:
            reward, output = await _verify_with_gym(spec.gym, task, calls or [], session_id, timeout_s, output_limit)
        except _EvaluatorFailed as exc:
            return Evaluation(0.0, "", str(exc))
        return Evaluation(reward, output, "")
    if spec.kind == "command":
        return await _evaluate_command(spec.command, runtime, task, session_id, timeout_s, output_limit)
    if spec.kind == "python":
        try:
            reward = await _call_python(spec.callable, runtime.workspace, task, timeout_s)
        except _EvaluatorFailed as exc:
            return Evaluation(0.0, "", str(exc))
        return Evaluation(reward, "", "")
    return Evaluation(0.0, "", f"unknown evaluator kind {spec.kind!r}")


# ------------------------------------------------------------------------------------------- command


async def _evaluate_command(
    command: str, runtime: Runtime, task: rollout_pb2.Task, session_id: str, timeout_s: float, output_limit: int
) -> Evaluation:
    reward_file = runtime.root / REWARD_FILE_NAME
    reward_file.unlink(missing_ok=True)
    env = runtime.command_env(
        {
            "POLAR_REWARD_FILE": str(reward_file),
            "POLAR_TASK_ID": task.task_id,
            "POLAR_SESSION_ID": session_id,
            "POLAR_INSTRUCTION": task.instruction,
            "POLAR_WORKSPACE": str(runtime.workspace),
        }
    )
    try:
        result = await runtime.run(["sh", "-c", command], env=env, timeout_s=timeout_s, output_limit=output_limit)
    except ProcessStartError as exc:
        return Evaluation(0.0, "", f"could not start: {exc}")
    if result.timed_out:
        return Evaluation(0.0, result.output, f"timed out after {timeout_s:g} s")
    if result.exit_code < 0:
        return Evaluation(0.0, result.output, exit_text(result.exit_code))
    try:
        reward = _reward_from_file(reward_file)
    except _EvaluatorFailed as exc:
        return Evaluation(0.0, result.output, str(exc))
    if reward is None:
        reward = _last_line_number(result.output)
    if reward is None:
        reward = 1.0 if result.exit_code == 0 else 0.0
    return Evaluation(reward, result.output, "")


def _reward_from_file(path: Path) -> float | None:
    """The number in the reward file; None if the evaluator wrote none."""
    try:
        with path.open("rb") as file:
            data = file.read(REWARD_FILE_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _EvaluatorFailed(f"cannot read the reward file: {exc}") from exc
    text = data[:REWARD_FILE_MAX_BYTES].decode("utf-8", "replace").strip()
    reward = _finite_number(text) if len(data) <= REWARD_FILE_MAX_BYTES else None
    if reward is None:
        raise _EvaluatorFailed(f"the reward file holds {_shorten(text)!r}, not a finite number")
    return reward


def _last_line_number(output: str) -> float | None:
    lines = output.strip().splitlines()
    return _finite_number(lines[-1].strip()) if lines else None


def _finite_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# ----------------------------------------------------------------------------------------------- gym


async def _verify_with_gym(
    spec: rollout_pb2.GymVerifier,
    task: rollout_pb2.Task,
    calls: list[common_pb2.CallRecord],
    session_id: str,
    timeout_s: float,
    output_limit: int,
) -> tuple[float, str]:
    """The reward a NeMo Gym resources server gives the session's final reply, and its /verify
    answer as text (capped) for the evaluator's output."""
    row = json.loads(spec.row_json) if spec.row_json else {}
    row.setdefault("responses_create_params", {"input": [{"role": "user", "content": task.instruction}]})
    url = spec.url.rstrip("/")
    # unsafe: keep the server's session cookie for an IP host (aiohttp's default jar drops those).
    jar = aiohttp.CookieJar(unsafe=True)
    try:
        async with aiohttp.ClientSession(cookie_jar=jar, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            await _gym_post(http, f"{url}/seed_session", row)
            verdict = await _gym_post(
                http, f"{url}/verify", row | {"response": final_response(calls, f"resp_{session_id}")}
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _EvaluatorFailed(f"NeMo Gym resources server {url}: {type(exc).__name__}: {exc}") from None
    reward = verdict.get("reward") if isinstance(verdict, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise _EvaluatorFailed(f"{url}/verify answered no finite reward: {_shorten(json.dumps(verdict))}")
    return float(reward), _shorten(json.dumps(verdict), output_limit)


async def _gym_post(http: aiohttp.ClientSession, url: str, body: dict) -> object:
    async with http.post(url, json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise _EvaluatorFailed(f"{url} answered HTTP {response.status}: {_shorten(text)}")
    try:
        return json.loads(text)
    except ValueError:
        raise _EvaluatorFailed(f"{url} answered no JSON: {_shorten(text)}") from None


# -------------------------------------------------------------------------------------------- python


async def _call_python(target: str, workspace: Path, task: rollout_pb2.Task, timeout_s: float) -> float:
    """Import and call "module:function" in a daemon thread (one that times out is left behind, and
    must not keep the process from exiting); its return value must be a finite real number."""
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise _EvaluatorFailed(f"callable {target!r} is not of the form 'module:function'")
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(outcome: tuple[str, object]) -> None:
        if not done.done():
            done.set_result(outcome)

    def call() -> None:
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            outcome = ("returned", function(workspace, task))
        except BaseException as exc:
            outcome = ("raised", exc)
        with contextlib.suppress(RuntimeError):  # the loop closed while this ran past its timeout
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=call, name=f"evaluator {target}", daemon=True).start()
    try:
        how, value = await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise _EvaluatorFailed(f"{target} timed out after {timeout_s:g} s (its thread is left running)") from None
    if how == "raised":
        raise _EvaluatorFailed(f"{target} raised {type(value).__name__}: {value}")
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        kind = type(value).__name__
        raise _EvaluatorFailed(f"{target} returned {_shorten(repr(value))} ({kind}), not a finite number")
    return float(value)


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
