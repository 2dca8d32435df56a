"""The "local" runtime: the session folder on this machine, commands run as the node's user."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar import credentials
from polar.rollout.process import OUTPUT_LIMIT, ProcessResult, run_process
from polar.rollout.runtimes.base import Runtime, RuntimeProvider, remove_tree
from polar.v1 import rollout_pb2


class LocalRuntime(Runtime):
    kind = "local"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._closed = False

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        timeout_s: float | None,
        output_limit: int = OUTPUT_LIMIT,
        cancel: asyncio.Event | None = None,
    ) -> ProcessResult:
        return await run_process(
            argv, cwd=self.workspace, env=env, timeout_s=timeout_s, output_limit=output_limit, cancel=cancel
        )

    def command_env(self, variables: Mapping[str, str]) -> dict[str, str]:
        # The node's environment (PATH, proxies, package index settings), so prepare steps and
        # evaluators find what the operator installed.
        # Never the stack's credentials: an evaluator may run what the harness wrote (a conftest.py).
        return {**credentials.without(os.environ), "HOME": str(self.home), **variables}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(remove_tree, self.root)


class LocalProvider(RuntimeProvider):
    kind = "local"

    async def _start(self, spec: rollout_pb2.RuntimeSpec, root: Path) -> LocalRuntime:
        return LocalRuntime(root)
