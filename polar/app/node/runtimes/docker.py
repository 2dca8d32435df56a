"""The "docker" runtime: the session folder on this machine, every command of the session (the
harness, prepare steps, evaluators) run inside a container of the task's image.

What a container sees, at the same paths in every session (so a harness's prompt, which names its
working folder and HOME, is the same from every session and the prefix caches cover all of it):

    /polar/session      the session folder (read-write): home/ (HOME), the reward file, the
                        gateway socket; work/ too, unless the workspace is elsewhere
    WORKDIR             the workspace (RuntimeSpec.workdir, e.g. /testbed; default
                        /polar/session/work), bind-mounted from the session folder's work/, so the
                        node reads and diffs it where it always does. Without a template, the
                        image's own files at WORKDIR fill it when the runtime is made.
    /opt/polar/node     the node's Node.js binary (read-only), on PATH
    /opt/polar/harness/N/node_modules   each folder of the node's harness_path (read-only), its
                        .bin on PATH: the node's installed harness CLIs run here, unchanged
    /opt/polar/sandbox.py   the forwarder (read-only)

Paths the node hands a command (arguments, environment values) are rewritten to those. Variables
travel in the docker client's environment (`--env NAME`), never on its command line, where any
user of the host could read the session key.

Nothing else of the node is there: not its files, not the credentials, not the Docker socket. The
container has no network (`--network=none`: its own loopback only), so no port of the host (the
control plane, Envoy's admin) nor any other session's container is reachable, prepare steps
included: bake what a task needs into its image. The one way out is the harness URL: the
container's first process is the forwarder of polar/app/node/sandbox.py, run with the image's
python3, which listens on the URL's port at 127.0.0.1 and relays each connection to the Unix socket
`gateway.sock` in the session folder, where the node relays it to the gateway
(polar.app.node.isolation.GatewayRelay); the session key is the only credential it carries.

The first process also reaps orphans, so `kill -KILL -1` inside the container (run after every
command) ends everything a command left behind, or everything of a command whose `docker exec`
client was stopped (a timeout or cancel), without ending the container or its forwarder.

Limits: `--cpus`, `--memory` (swap included) and `--pids-limit` from the spec, else the provider's
defaults. At most `start_limit` containers are being started at once per provider.

Every container carries the label `polar.owner` (this machine's boot, the node process's id and its
start time): `remove_orphans` removes the containers, and their session folders, of owners that no
longer run, which is what a node does when it starts after a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from polar.app.node.isolation import SANDBOX, GatewayRelay, forward_target, in_namespace_url
from polar.app.node.process import OUTPUT_LIMIT, ProcessResult, ProcessStartError, run_process
from polar.app.node.runtimes.base import (
    STEP_TIMEOUT_S,
    Runtime,
    RuntimeFailure,
    RuntimeProvider,
    checked_step,
    remove_tree,
)
from polar.app.node.sandbox import LISTENING_MARKER
from polar.rollout.templates import TemplateSources
from polar.v1 import rollout_pb2

log = logging.getLogger("polar.app.node.runtimes")

SESSION_IN_CONTAINER = "/polar/session"
SANDBOX_IN_CONTAINER = "/opt/polar/sandbox.py"
NODE_IN_CONTAINER = "/opt/polar/node/bin/node"
HARNESS_IN_CONTAINER = "/opt/polar/harness"
# The container's first process without a harness URL to forward: sleeps, and reaps orphans (a
# shell's `wait` collects any child).
IDLE_SCRIPT = "while :; do sleep 3600 & wait; done"
# The kill sees every process of the container but its first and itself.
KILL_LEFTOVERS_SCRIPT = "kill -KILL -1 2>/dev/null; exit 0"
ENGINE_CHECK_TIMEOUT_S = 10.0
DOCKER_COMMAND_TIMEOUT_S = 60.0
LABEL = "polar.rollout.session"  # the session folder, on the host
OWNER_LABEL = "polar.owner"  # boot id:pid:start time of the node process that made it
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Limits:
    """A container's limits; 0 means none."""

    cpus: float = 0.0
    memory_bytes: int = 0
    max_processes: int = 0

    def over(self, spec: rollout_pb2.RuntimeSpec) -> Limits:
        """These defaults, with what spec sets."""
        return Limits(
            spec.cpus or self.cpus, spec.memory_bytes or self.memory_bytes, spec.max_processes or self.max_processes
        )

    def argv(self) -> list[str]:
        flags = []
        if self.cpus:
            flags.append(f"--cpus={self.cpus:g}")
        if self.memory_bytes:
            flags += [f"--memory={self.memory_bytes}", f"--memory-swap={self.memory_bytes}"]
        if self.max_processes:
            flags.append(f"--pids-limit={self.max_processes}")
        return flags


def docker_engine_answers(docker: str = "docker") -> bool:
    """Whether the docker client is installed and a Docker engine answers it."""
    return engine_problem(docker) is None


def engine_problem(docker: str = "docker") -> str | None:
    """None when a Docker engine answers the docker client, else why not."""
    binary = shutil.which(docker)
    if binary is None:
        return f"no {docker!r} client is installed"
    try:
        result = subprocess.run(
            [binary, "version", "--format", "{{.Server.Version}}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ENGINE_CHECK_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker version` did not answer: {exc}"
    if result.returncode != 0 or not result.stdout.strip():
        return f"no Docker engine answers: {(result.stderr or result.stdout).strip()[-300:]}"
    return None


def owner_id(pid: int | None = None) -> str:
    """This machine's boot, a process's id and its start time: unique to one running process."""
    pid = os.getpid() if pid is None else pid
    return f"{_boot_id()}:{pid}:{_start_time(pid)}"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot; "" when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # The command name (field 2) may hold spaces and parentheses; the fields after it do not.
    return stat.rsplit(")", 1)[1].split()[19]


def owner_runs(owner: str) -> bool:
    """Whether the process an `owner_id` names still runs on this machine."""
    boot, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if boot != _boot_id() or not pid.isdigit():
        return False
    return _start_time(int(pid)) == started != ""


def remove_orphans(docker: str = "docker") -> list[str]:
    """Remove every Polar container whose owner no longer runs, and its session folder; the names
    of the containers removed. Failures are logged: a node still starts."""
    columns = f'{{{{.Names}}}}\t{{{{.Label "{OWNER_LABEL}"}}}}\t{{{{.Label "{LABEL}"}}}}'
    listing = [docker, "ps", "--all", "--filter", f"label={OWNER_LABEL}", "--format", columns]
    try:
        result = subprocess.run(listing, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("listing Polar's containers failed: %s", exc)
        return []
    orphans = []
    for line in result.stdout.splitlines():
        name, owner, folder = (line.split("\t") + ["", ""])[:3]
        if owner_runs(owner):
            continue
        orphans.append(name)
        if folder and os.path.isdir(folder):
            remove_tree(Path(folder))
    if orphans:
        removal = [docker, "rm", "--force", *orphans]
        removed = subprocess.run(removal, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        if removed.returncode != 0:
            log.warning("removing orphaned containers failed: %s", removed.stderr.strip()[-500:])
        log.warning("removed %d container(s) left by a node that no longer runs: %s", len(orphans), ", ".join(orphans))
    return orphans


class DockerRuntime(Runtime):
    kind = "docker"

    def __init__(
        self, root: Path, container: str, docker: str, workdir: str, relay: GatewayRelay | None = None
    ) -> None:
        super().__init__(root)
        self.container = container
        self.workdir = workdir  # the workspace, as commands in the container see it
        self._docker = docker
        self._relay = relay
        self._closed = False

    def inside(self, value: str) -> str:
        """`value` (an argument, a variable's value, maybe a PATH-like list) with each path in the
        session folder rewritten to where the container sees it."""
        mounts = [(str(self.workspace), self.workdir), (str(self.root), SESSION_IN_CONTAINER)]
        resolved = self.root.resolve()
        if str(resolved) != str(self.root):
            mounts += [(str(resolved / "work"), self.workdir), (str(resolved), SESSION_IN_CONTAINER)]

        def one(part: str) -> str:
            for host, container in mounts:
                if part == host or part.startswith(host + os.sep):
                    return container + part[len(host) :]
            return part

        return os.pathsep.join(one(part) for part in value.split(os.pathsep))

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
        inside_env = {name: self.inside(value) for name, value in env.items()}
        names = [f"--env={name}" for name in inside_env]
        client_argv = [self._docker, "exec", f"--workdir={self.workdir}", *names, self.container]
        client_argv += [self.inside(arg) for arg in argv]
        try:
            return await run_process(
                client_argv,
                cwd=self.root,
                env={**os.environ, **inside_env},
                timeout_s=timeout_s,
                output_limit=output_limit,
                cancel=cancel,
            )
        finally:
            await asyncio.shield(self._kill_leftovers())

    def harness_base_url(self, base_url: str) -> str:
        return in_namespace_url(base_url)

    def command_env(self, variables: Mapping[str, str]) -> dict[str, str]:
        # The container's environment applies (the image's, PATH with the node's CLIs); only HOME
        # is the session's.
        return {"HOME": str(self.home), **variables}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getuid() != 0:
            # Files the container's root user made in the bind mount are not ours to delete.
            owner = f"{os.getuid()}:{os.getgid()}"
            await self._docker_quietly("exec", self.container, "chown", "-R", owner, SESSION_IN_CONTAINER, self.workdir)
        await self._docker_quietly("rm", "--force", self.container)
        if self._relay is not None:
            await self._relay.close()
        await asyncio.to_thread(remove_tree, self.root)

    async def _kill_leftovers(self) -> None:
        await self._docker_quietly("exec", self.container, "sh", "-c", KILL_LEFTOVERS_SCRIPT)

    async def _docker_quietly(self, *arguments: str) -> None:
        await docker_quietly(self._docker, arguments, self.root.parent)


async def docker_quietly(docker: str, arguments: Sequence[str], cwd: Path) -> None:
    """A docker command of the runtime's own upkeep: a failure is logged, not raised."""
    try:
        result = await run_process([docker, *arguments], cwd=cwd, env=os.environ, timeout_s=DOCKER_COMMAND_TIMEOUT_S)
    except ProcessStartError as exc:
        log.warning("docker %s: %s", arguments[0], exc)
        return
    if result.exit_code != 0:
        log.warning("docker %s failed: %s", " ".join(arguments[:3]), result.output.strip()[-500:])


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
        harness_path: str = "",
        limits: Limits = Limits(),
        start_limit: int = 4,
    ) -> None:
        super().__init__(work_root, step_timeout_s=step_timeout_s, templates=templates)
        self.docker = shutil.which(docker) or docker
        self.harness_url = harness_url  # the gateway's, forwarded into each container ("": none)
        self.limits = limits
        self.owner = owner_id()
        self.mounts, self.extra_path = _node_mounts(harness_path)
        self._starts = asyncio.Semaphore(start_limit)
        self._image_paths: dict[str, str] = {}

    async def _start(self, spec: rollout_pb2.RuntimeSpec, root: Path) -> DockerRuntime:
        if not spec.image:
            raise RuntimeFailure("a docker runtime needs an image")
        workdir = spec.workdir or f"{SESSION_IN_CONTAINER}/work"
        if not PurePosixPath(workdir).is_absolute() or ".." in PurePosixPath(workdir).parts:
            raise RuntimeFailure(f"workdir {spec.workdir!r}: an absolute path in the container, without '..'")
        container = f"polar-{re.sub(r'[^A-Za-z0-9_.-]', '_', root.name)}-{secrets.token_hex(3)}"
        relay = None
        if self.harness_url:
            relay = GatewayRelay(root, self.harness_url)
            await relay.start()
        runtime = DockerRuntime(root, container, self.docker, workdir, relay)
        try:
            async with self._starts:
                path = await self._image_path(spec.image, root)
                if spec.workdir and not spec.template:
                    await self._fill_from_image(spec.image, spec.workdir, root, container)
                argv = self.run_argv(container, root, spec, workdir, path)
                step = f"image {spec.image!r}: docker run"
                if self.harness_url:
                    step += " (its first process, the harness URL's forwarder, runs the image's python3)"
                await checked_step(step, argv, cwd=root, env=os.environ, timeout_s=self.step_timeout_s)
                if self.harness_url:
                    await self._forwarder_listening(root, container)
        except BaseException:
            # A client stopped by the timeout may leave the engine to start the container anyway.
            # Cancelled (a node stopping), the removal goes on: `settle` waits for it.
            await self.cleanup(self._remove(runtime, relay))
            raise
        return runtime

    async def _forwarder_listening(self, root: Path, container: str) -> None:
        """Wait for the container's forwarder to listen on the harness URL's port (`docker run`
        returns once its python3 is started, not once it listens)."""
        deadline = time.monotonic() + self.step_timeout_s
        checked = time.monotonic()
        while not (root / LISTENING_MARKER).exists():
            now = time.monotonic()
            if now > deadline:
                raise RuntimeFailure(f"the harness URL's forwarder did not listen within {self.step_timeout_s:g} s")
            if now - checked > 1.0:
                checked = now
                state = await run_process(
                    [self.docker, "container", "inspect", "--format={{.State.Running}}", container],
                    cwd=root,
                    env=os.environ,
                    timeout_s=DOCKER_COMMAND_TIMEOUT_S,
                )
                if state.output.strip() != "true":
                    raise RuntimeFailure(
                        f"the harness URL's forwarder exited before it listened: {state.output.strip()}"
                    )
            await asyncio.sleep(0.02)

    async def _remove(self, runtime: DockerRuntime, relay: GatewayRelay | None) -> None:
        await runtime._docker_quietly("rm", "--force", runtime.container)
        if relay is not None:
            await relay.close()

    async def _image_path(self, image: str, root: Path) -> str:
        """The image's PATH (its environment's, else Debian's default), asked once per image."""
        if image not in self._image_paths:
            argv = [self.docker, "image", "inspect", "--format", "{{json .Config.Env}}", image]
            step = f"image {image!r}: docker image inspect (build or pull the image on this machine first)"
            result = await checked_step(step, argv, cwd=root, env=os.environ, timeout_s=DOCKER_COMMAND_TIMEOUT_S)
            variables = json.loads(result.output.strip() or "null") or []
            path = next((value[5:] for value in variables if value.startswith("PATH=")), DEFAULT_PATH)
            self._image_paths[image] = path
        return self._image_paths[image]

    async def _fill_from_image(self, image: str, workdir: str, root: Path, container: str) -> None:
        """root/work = the image's files at workdir: copied from a container created, never started."""
        workspace = root / "work"
        source = f"{container}-fill"
        create = [self.docker, "create", f"--name={source}", f"--label={OWNER_LABEL}={self.owner}", image, "true"]
        timeout_s = self.step_timeout_s
        await checked_step(f"image {image!r}: docker create", create, cwd=root, env=os.environ, timeout_s=timeout_s)
        try:
            copy = [self.docker, "cp", "--archive", f"{source}:{workdir.rstrip('/')}/.", str(workspace)]
            step = f"image {image!r}: copying its {workdir}"
            await checked_step(step, copy, cwd=root, env=os.environ, timeout_s=timeout_s)
        finally:
            await asyncio.shield(docker_quietly(self.docker, ["rm", "--force", source], root))

    def run_argv(
        self, container: str, root: Path, spec: rollout_pb2.RuntimeSpec, workdir: str, image_path: str
    ) -> list[str]:
        """The `docker run` that starts a session's container (see the module docstring)."""
        if self.harness_url:
            host, port, socket_name = forward_target(self.harness_url)
            first = [f"--volume={SANDBOX}:{SANDBOX_IN_CONTAINER}:ro", f"--workdir={SESSION_IN_CONTAINER}"]
            first += ["--entrypoint=python3", spec.image, SANDBOX_IN_CONTAINER, "forward", host, str(port), socket_name]
        else:
            first = [f"--workdir={workdir}", "--entrypoint=sh", spec.image, "-c", IDLE_SCRIPT]
        workspace = [f"--volume={root / 'work'}:{workdir}"] if spec.workdir else []
        path = os.pathsep.join([*self.extra_path, image_path])
        labels = [f"--label={LABEL}={root}", f"--label={OWNER_LABEL}={self.owner}"]
        isolated = ["--network=none", "--security-opt=no-new-privileges", *self.limits.over(spec).argv()]
        volumes = [f"--volume={root}:{SESSION_IN_CONTAINER}", *workspace, *self.mounts]
        start = [self.docker, "run", "--detach", "--rm", f"--name={container}"]
        return [*start, *labels, *isolated, f"--env=PATH={path}", *volumes, *first]


def _node_mounts(harness_path: str) -> tuple[list[str], list[str]]:
    """The read-only mounts of the node's Node.js and harness CLIs, and the folders they add to
    PATH in the container, first."""
    mounts, path = [], []
    for index, folder in enumerate(part for part in harness_path.split(os.pathsep) if part):
        folder = Path(folder).resolve()
        if not folder.is_dir():
            continue
        # A node_modules/.bin's entries link into their packages beside it: the whole node_modules goes.
        source, below = (folder.parent, ".bin") if folder.name == ".bin" else (folder, "")
        target = f"{HARNESS_IN_CONTAINER}/{index}/{source.name}"
        mounts.append(f"--volume={source}:{target}:ro")
        path.append(f"{target}/{below}".rstrip("/"))
    node = shutil.which("node")
    if node is not None:
        mounts.append(f"--volume={os.path.realpath(node)}:{NODE_IN_CONTAINER}:ro")
        path.append(str(PurePosixPath(NODE_IN_CONTAINER).parent))
    return mounts, path
