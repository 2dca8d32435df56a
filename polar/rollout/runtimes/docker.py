"""The "docker" runtime: the session folder on this machine, commands run inside a container.

Each session gets its own container from spec.image, started idle and removed at close. It sees the
session folder bind-mounted at the same path, so every path the node hands out (workspace, home,
reward file) means the same inside and out. Commands run with `docker exec` in the workspace; the
variables given add to (and override) the image's environment. Their values travel in the docker
client's environment (`--env NAME`), never on its command line, where any user of the host could
read the session key.

The container has no network (`--network=none`: only its own loopback device), so nothing of the
host (the control plane's ports, Envoy's admin, the internet) is reachable from it, prepare steps
included: bake what a task needs into its image. The one way out is the harness URL: the
container's first process is the forwarder of polar/rollout/sandbox.py, run with the image's
python3 from a read-only bind mount, which listens on the URL's port at 127.0.0.1 (a harness URL
of another host is given to the harness as 127.0.0.1 on the same port) and relays each connection
to the Unix socket `gateway.sock` in the session folder, where the node relays it to the gateway
(polar.rollout.isolation.GatewayRelay). Docker was not available where this was written: the
command line is unit-tested, the container itself is not.

The first process also reaps orphans, so `kill -KILL -1` inside the container (run after every
command) ends everything a command left behind, or everything of a command whose `docker exec`
client was stopped (a timeout or cancel), without ending the container or its forwarder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar.rollout.isolation import SANDBOX, GatewayRelay, forward_target, in_namespace_url
from polar.rollout.process import OUTPUT_LIMIT, ProcessResult, ProcessStartError, run_process
from polar.rollout.runtimes.base import (
    STEP_TIMEOUT_S,
    Runtime,
    RuntimeFailure,
    RuntimeProvider,
    checked_step,
    remove_tree,
)
from polar.rollout.templates import TemplateSources
from polar.v1 import rollout_pb2

log = logging.getLogger("polar.rollout.runtimes")

# The container's first process without a harness URL to forward: sleeps, and reaps orphans (a
# shell's `wait` collects any child).
IDLE_SCRIPT = "while :; do sleep 3600 & wait; done"
# Where the container sees sandbox.py (the forwarder).
SANDBOX_IN_CONTAINER = "/opt/polar/sandbox.py"
# The kill sees every process of the container but its first and itself.
KILL_LEFTOVERS_SCRIPT = "kill -KILL -1 2>/dev/null; exit 0"
ENGINE_CHECK_TIMEOUT_S = 10.0
DOCKER_COMMAND_TIMEOUT_S = 60.0
LABEL = "polar.rollout.session"


def docker_engine_answers(docker: str = "docker") -> bool:
    """Whether the docker client is installed and a Docker engine answers it."""
    binary = shutil.which(docker)
    if binary is None:
        return False
    try:
        result = subprocess.run(
            [binary, "version", "--format", "{{.Server.Version}}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=ENGINE_CHECK_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and bool(result.stdout.strip())


class DockerRuntime(Runtime):
    kind = "docker"

    def __init__(self, root: Path, container: str, docker: str, relay: GatewayRelay | None = None) -> None:
        super().__init__(root)
        self.container = container
        self._docker = docker
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
        names = [f"--env={name}" for name in env]
        client_argv = [self._docker, "exec", f"--workdir={self.workspace}", *names, self.container, *argv]
        try:
            return await run_process(
                client_argv,
                cwd=self.root,
                env={**os.environ, **env},
                timeout_s=timeout_s,
                output_limit=output_limit,
                cancel=cancel,
            )
        finally:
            await asyncio.shield(self._kill_leftovers())

    def harness_base_url(self, base_url: str) -> str:
        return in_namespace_url(base_url)

    def command_env(self, variables: Mapping[str, str]) -> dict[str, str]:
        # The image's environment applies; only HOME is the session's.
        return {"HOME": str(self.home), **variables}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getuid() != 0:
            # Files the container's root user made in the bind mount are not ours to delete.
            owner = f"{os.getuid()}:{os.getgid()}"
            await self._docker_quietly("exec", self.container, "chown", "-R", owner, str(self.root))
        await self._docker_quietly("rm", "--force", self.container)
        if self._relay is not None:
            await self._relay.close()
        await asyncio.to_thread(remove_tree, self.root)

    async def _kill_leftovers(self) -> None:
        await self._docker_quietly("exec", self.container, "sh", "-c", KILL_LEFTOVERS_SCRIPT)

    async def _docker_quietly(self, *arguments: str) -> None:
        """A docker command of the runtime's own upkeep: a failure is logged, not raised."""
        try:
            result = await run_process(
                [self._docker, *arguments], cwd=self.root.parent, env=os.environ, timeout_s=DOCKER_COMMAND_TIMEOUT_S
            )
        except ProcessStartError as exc:
            log.warning("docker %s: %s", arguments[0], exc)
            return
        if result.exit_code != 0:
            log.warning("docker %s %s failed: %s", arguments[0], self.container, result.output.strip()[-500:])


class DockerProvider(RuntimeProvider):
    kind = "docker"

    def __init__(
        self,
        work_root: Path,
        *,
        step_timeout_s: float = STEP_TIMEOUT_S,
        docker: str = "docker",
        templates: TemplateSources | None = None,
        harness_url: str = "",
    ) -> None:
        super().__init__(work_root, step_timeout_s=step_timeout_s, templates=templates)
        self.docker = shutil.which(docker) or docker
        self.harness_url = harness_url  # the gateway's, forwarded into each container ("": none)

    async def _start(self, spec: rollout_pb2.RuntimeSpec, root: Path) -> DockerRuntime:
        if not spec.image:
            raise RuntimeFailure("a docker runtime needs an image")
        container = f"polar-{re.sub(r'[^A-Za-z0-9_.-]', '_', root.name)}-{secrets.token_hex(3)}"
        argv = docker_run_argv(self.docker, container, root, spec.image, self.harness_url)
        relay = None
        if self.harness_url:
            relay = GatewayRelay(root, self.harness_url)
            await relay.start()
        runtime = DockerRuntime(root, container, self.docker, relay)
        try:
            # Pulling the image may be part of this step.
            step = f"image {spec.image!r}: docker run"
            if self.harness_url:
                step += " (its first process, the harness URL's forwarder, runs the image's python3)"
            await checked_step(step, argv, cwd=root, env=os.environ, timeout_s=self.step_timeout_s)
        except BaseException:
            # A client stopped by the timeout may leave the engine to start the container anyway.
            await asyncio.shield(runtime._docker_quietly("rm", "--force", container))
            if relay is not None:
                await asyncio.shield(relay.close())
            raise
        return runtime


def docker_run_argv(docker: str, container: str, root: Path, image: str, harness_url: str) -> list[str]:
    """The `docker run` that starts a session's container: no network; its first process forwards
    the harness URL to the session folder's gateway socket (or, without a URL, only sleeps)."""
    if harness_url:
        host, port, socket_name = forward_target(harness_url)
        first = [
            f"--volume={SANDBOX}:{SANDBOX_IN_CONTAINER}:ro", f"--workdir={root}", "--entrypoint=python3",
            image, SANDBOX_IN_CONTAINER, "forward", host, str(port), socket_name,
        ]  # fmt: skip
    else:
        first = [f"--workdir={root / 'work'}", "--entrypoint=sh", image, "-c", IDLE_SCRIPT]
    return [
        docker, "run", "--detach", "--rm",
        f"--name={container}",
        f"--label={LABEL}={root}",
        "--network=none",
        f"--volume={root}:{root}",
        *first,
    ]  # fmt: skip
