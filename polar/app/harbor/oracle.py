"""`polar tasks oracle` for Harbor tasks: solution/solve.sh must score 1 and doing nothing 0.

The solution run: a container of the solution's image (the task's image with solution/ at
/solution), `bash /solution/solve.sh` in its workspace with task.toml's [solution] env and the
agent's timeout, then the task's verifier on that workspace (polar.app.harbor.evaluator). The empty
run: the verifier on a workspace of the task's own image, untouched.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from polar.app.harbor.evaluator import HarborEvaluation, evaluate_harbor
from polar.app.node.process import OUTPUT_LIMIT, ProcessStartError, exit_text
from polar.app.node.runtimes.base import Runtime, RuntimeFailure, RuntimeProvider, output_tail
from polar.v1 import rollout_pb2

SOLVE_COMMAND = "mkdir -p /logs/agent && exec bash /solution/solve.sh"
DEFAULT_SOLVE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class HarborCheck:
    solution: float | None  # None: not run
    empty: float | None
    problems: tuple[str, ...]


async def check_harbor_task(task: rollout_pb2.Task, provider: RuntimeProvider) -> HarborCheck:
    tests = task.evaluator.harbor
    timeout_s = task.evaluator.timeout_seconds or 600.0
    problems: list[str] = []

    async def run(image: str, label: str) -> HarborEvaluation | None:
        spec = rollout_pb2.RuntimeSpec()
        spec.CopyFrom(task.runtime)
        spec.image = image
        try:
            runtime = await provider.create(spec, name=f"{task.task_id}-{label}")
        except RuntimeFailure as exc:
            problems.append(f"{label}: the runtime: {exc}")
            return None
        try:
            if label == "solution" and (problem := await _solve(runtime, tests, task.timeout_seconds)):
                problems.append(f"solution: {problem}")
                return None
            return await evaluate_harbor(
                tests,
                runtime_spec=task.runtime,
                workspace=runtime.workspace,
                provider=provider,
                name=f"{task.task_id}-{label}",
                timeout_s=timeout_s,
                output_limit=OUTPUT_LIMIT,
            )
        finally:
            await asyncio.shield(runtime.close())

    solution = None
    if not tests.solution_image:
        problems.append("solution: the task has no solution/solve.sh")
    else:
        solution = await run(tests.solution_image, "solution")
        _expect(solution, 1.0, "solution", problems)
    empty = await run(task.runtime.image, "empty")
    _expect(empty, 0.0, "empty", problems)
    return HarborCheck(
        None if solution is None else solution.reward,
        None if empty is None else empty.reward,
        tuple(problems),
    )


async def _solve(runtime: Runtime, tests: rollout_pb2.HarborTests, timeout_s: float) -> str:
    """solve.sh run in the runtime's workspace; "" or what went wrong."""
    timeout_s = timeout_s or DEFAULT_SOLVE_TIMEOUT_S
    env = runtime.command_env(dict(tests.solution_env))
    try:
        result = await runtime.run(["sh", "-c", SOLVE_COMMAND], env=env, timeout_s=timeout_s)
    except ProcessStartError as exc:
        return f"solve.sh could not start: {exc}"
    if result.timed_out:
        return f"solve.sh ran past {timeout_s:g} s"
    if result.exit_code != 0:
        return f"solve.sh {exit_text(result.exit_code)}: {output_tail(result.output)}"
    return ""


def _expect(result: HarborEvaluation | None, wanted: float, label: str, problems: list[str]) -> None:
    if result is None:
        return
    if result.error:
        problems.append(f"{label}: {result.error}")
    elif result.reward != wanted:
        why = result.metadata.get("harbor_reason", "")
        problems.append(f"{label}: reward {result.reward:g}, not {wanted:g}{' (' + why + ')' if why else ''}")
