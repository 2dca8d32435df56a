"""The "local" runtime: the session folder on this machine, commands run as the node's user, inside
the sandbox that the node's `harness_isolation` asks for (polar.app.node.isolation)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar import credentials
from polar.app.node.isolation import (
    NO_ISOLATION,
    GatewayRelay,
    Isolation,
    as_seen_inside,
    in_namespace_url,
    sandbox_argv,
)
from polar.app.node.process import OUTPUT_LIMIT, ProcessResult, resolve_command, run_process
from polar.app.node.runtimes.base import STEP_TIMEOUT_S, Runtime, RuntimeProvider, remove_tree
from polar.rollout.templates import TemplateSources
from polar.v1 import rollout_pb2


class LocalRuntime(Runtime):
    kind = "local"

    def __init__(self, root: Path, isolation: Isolation = NO_ISOLATION, relay: GatewayRelay | None = None) -> None:
        super().__init__(root)
        self.isolation = isolation
        self._relay = relay
        self._closed = False

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        timeout_s: float | None,
        output_limit: int = OUTPUT_LIMIT,
        cancel: asyncio.Event | None = None,
        preparing: bool = False,
    ) -> ProcessResult:
        if self.isolation.mode != "none":
            network = self.isolation.mode == "network" and not preparing
            # Resolved here, where a missing command is a clear error, not inside the sandbox.
            argv = [resolve_command(argv[0], self.workspace, env.get("PATH", os.defpath)), *argv[1:]]
            # Inside, the session folder is at a fixed path (sandbox.py); so are the paths handed over.
            argv = sandbox_argv(
                [as_seen_inside(arg, self.root) for arg in argv], self.isolation, self.root, network=network
            )
            env = {name: as_seen_inside(value, self.root) for name, value in env.items()}
        return await run_process(
            argv, cwd=self.workspace, env=env, timeout_s=timeout_s, output_limit=output_limit, cancel=cancel
        )

    def harness_base_url(self, base_url: str) -> str:
        return in_namespace_url(base_url) if self.isolation.mode == "network" else base_url

    def command_env(self, variables: Mapping[str, str]) -> dict[str, str]:
        # The node's environment (PATH, proxies, package index settings), so prepare steps and
        # evaluators find what the operator installed.
        # Never the stack's credentials: an evaluator may run what the harness wrote (a conftest.py).
        return {**credentials.without(os.environ), "HOME": str(self.home), **variables}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._relay is not None:
            await self._relay.close()
        await asyncio.to_thread(remove_tree, self.root)


class LocalProvider(RuntimeProvider):
    kind = "local"

    def __init__(
        self,
        work_root: Path,
        *,
        step_timeout_s: float = STEP_TIMEOUT_S,
        templates: TemplateSources | None = None,
        isolation: Isolation = NO_ISOLATION,
    ) -> None:
        super().__init__(work_root, step_timeout_s=step_timeout_s, templates=templates)
        self.isolation = isolation

    async def _start(self, spec: rollout_pb2.RuntimeSpec, root: Path) -> LocalRuntime:
        relay = None
        if self.isolation.mode == "network":
            relay = GatewayRelay(root, self.isolation.harness_url)
            await relay.start()
        return LocalRuntime(root, self.isolation, relay)
