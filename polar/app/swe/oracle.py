"""`polar tasks oracle FILE`: check a SWE-style or Harbor task set before anyone trains on it.

For each task with a "swe" evaluator, two runs of its evaluator in runtimes of its own spec: one
whose workspace holds the gold patch (must score 1) and one with no change, its tests run anyway
(must score 0: its FAIL_TO_PASS tests fail at the base commit). A task that misses either is
reported broken with the reason, as SWE-bench users validate their environments.

A task with a "harbor" evaluator is checked the same way by polar.app.harbor.oracle: its
solution/solve.sh must score 1 (the "gold" column) and doing nothing 0.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from polar.app.harbor.oracle import check_harbor_task
from polar.app.node.process import OUTPUT_LIMIT
from polar.app.node.runtimes import (
    DockerProvider,
    LocalProvider,
    RuntimeFailure,
    RuntimeProvider,
    docker_engine_answers,
)
from polar.app.node.runtimes.base import remove_tree
from polar.app.swe.evaluator import SweEvaluation, apply_patch, evaluate_swe
from polar.v1 import rollout_pb2


@dataclass(frozen=True)
class OracleResult:
    task_id: str
    instance_id: str
    gold: float | None  # None: not run
    empty: float | None
    problems: tuple[str, ...]  # empty when the task is sound
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


async def check_task(task: rollout_pb2.Task, provider: RuntimeProvider) -> OracleResult:
    """The gold run and the empty run of one task (see the module docstring)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    tests = task.evaluator.swe
    timeout_s = task.evaluator.timeout_seconds or 600.0
    problems: list[str] = []

    async def run(patch: str, label: str) -> SweEvaluation | None:
        try:
            runtime = await provider.create(task.runtime, name=f"{task.task_id}-{label}")
        except RuntimeFailure as exc:
            problems.append(f"{label}: the runtime: {exc}")
            return None
        try:
            if patch and (problem := await apply_patch(runtime, patch.encode(), "gold.patch")):
                problems.append(f"{label}: the gold patch does not apply: {problem}")
                return None
            return await evaluate_swe(
                tests,
                runtime_spec=task.runtime,
                workspace=runtime.workspace,
                provider=provider,
                name=f"{task.task_id}-{label}",
                timeout_s=timeout_s,
                output_limit=OUTPUT_LIMIT,
                run_empty=not patch,
            )
        finally:
            await asyncio.shield(runtime.close())

    gold = empty = None
    if not tests.gold_patch:
        problems.append("gold: the task carries no gold patch")
    else:
        gold = await run(tests.gold_patch, "gold")
        _expect(gold, 1.0, "gold", problems)
    empty = await run("", "empty")
    _expect(empty, 0.0, "empty", problems)
    return OracleResult(
        task.task_id,
        tests.instance_id,
        None if gold is None else gold.reward,
        None if empty is None else empty.reward,
        tuple(problems),
        loop.time() - started,
    )


def _expect(result: SweEvaluation | None, wanted: float, label: str, problems: list[str]) -> None:
    if result is None:
        return
    if result.error:
        problems.append(f"{label}: {result.error}")
    elif result.reward != wanted:
        why = result.metadata.get("swe_reason", "")
        f2p, p2p = (result.metadata.get(f"swe_{key}", "?") for key in ("fail_to_pass", "pass_to_pass"))
        counts = f"FAIL_TO_PASS {f2p}, PASS_TO_PASS {p2p}"
        problems.append(f"{label}: reward {result.reward:g}, not {wanted:g} ({counts}{'; ' + why if why else ''})")


async def check_any_task(task: rollout_pb2.Task, provider: RuntimeProvider) -> OracleResult:
    """check_task for a "swe" task; polar.app.harbor.oracle's check for a "harbor" one."""
    if task.evaluator.kind != "harbor":
        return await check_task(task, provider)
    loop = asyncio.get_running_loop()
    started = loop.time()
    checked = await check_harbor_task(task, provider)
    name = task.evaluator.harbor.name
    return OracleResult(task.task_id, name, checked.solution, checked.empty, checked.problems, loop.time() - started)


async def check_tasks(tasks: Sequence[rollout_pb2.Task], *, jobs: int, work_root: Path) -> list[OracleResult]:
    """Every task checked, `jobs` at a time, in the order given."""
    providers: dict[str, RuntimeProvider] = {"local": LocalProvider(work_root)}
    if any(task.runtime.kind == "docker" for task in tasks) and await asyncio.to_thread(docker_engine_answers):
        providers["docker"] = DockerProvider(work_root)
    limit = asyncio.Semaphore(jobs)

    async def one(task: rollout_pb2.Task) -> OracleResult:
        provider = providers.get(task.runtime.kind)
        if provider is None:
            problem = f"no {task.runtime.kind!r} runtime on this machine (is a Docker engine running?)"
            label = task.evaluator.swe.instance_id or task.evaluator.harbor.name
            return OracleResult(task.task_id, label, None, None, (problem,), 0.0)
        async with limit:
            return await check_any_task(task, provider)

    return list(await asyncio.gather(*(one(task) for task in tasks)))


def report(results: Sequence[OracleResult], out: TextIO) -> None:
    """A table of the results, then the broken tasks with their reasons, then a totals line."""

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    width = max([len("task"), *(len(result.task_id) for result in results)])
    print(f"{'task':<{width}}  gold  empty  seconds  verdict", file=out)
    for result in results:
        verdict = "ok" if result.ok else "BROKEN"
        row = f"{result.task_id:<{width}}  {shown(result.gold):>4}  {shown(result.empty):>5}  {result.seconds:7.1f}"
        print(f"{row}  {verdict}", file=out)
    broken = [result for result in results if not result.ok]
    for result in broken:
        print(f"\n{result.task_id} ({result.instance_id}):", file=out)
        for problem in result.problems:
            print(f"  {problem}", file=out)
    print(f"\n{len(results) - len(broken)} of {len(results)} tasks sound, {len(broken)} broken", file=out)


def oracle_command(tasks: Sequence[rollout_pb2.Task], jobs: int, out: TextIO = sys.stdout) -> int:
    """`polar tasks oracle`: 0 when every task is sound, 1 otherwise."""
    swe_tasks = [task for task in tasks if task.evaluator.kind in ("swe", "harbor")]
    if not swe_tasks:
        raise ValueError(
            "the file holds no task with a 'swe' or 'harbor' evaluator"
            " (make one with `polar tasks import swe` or `polar tasks import harbor`)"
        )
    work_root = Path(tempfile.mkdtemp(prefix="polar-oracle-"))
    try:
        results = asyncio.run(check_tasks(swe_tasks, jobs=jobs, work_root=work_root))
    finally:
        remove_tree(work_root)
    report(results, out)
    return 0 if all(result.ok for result in results) else 1


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))
