"""How far a node keeps the commands of its local runtime (harnesses, evaluators, prepare steps) from
itself: the node setting `harness_isolation`.

    none       the command runs as the node's user, beside the node: it can read the stack's
               credentials, connect to every loopback port, signal and trace the node's processes.
    namespace  Linux namespaces made without privileges (util-linux `unshare`; see sandbox.py): the
               state folder (credentials), $POLAR_CREDENTIALS, the node's work folder (other
               sessions), the temporary folders (/tmp, /dev/shm, $TMPDIR, $XDG_RUNTIME_DIR: Envoy's
               admin socket, other services' scratch) are empty, the Docker socket is /dev/null, and
               no process outside the command's own is visible. The network is the node's.
    network    namespace, plus a network namespace of its own: only the harness's base URL answers
               there (forwarded through a Unix socket in the session folder to the gateway); every
               other port, loopback or not, is unreachable. Prepare steps keep the node's network
               (they install what the task needs, before anything model-written exists).
    auto       namespace where this machine allows it, else none.

What the namespaces cannot hide: the rest of the file system is as the node's user sees it, and
writable where that user can write (the rollout store, a trainer's run folder, the user's home
outside the state folder); under "namespace", every port on the machine. Run the node as a user that
owns nothing else, or use the docker runtime, to keep those out of reach too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from polar import credentials
from polar.child_processes import dying_with_parent
from polar.service_base import ServiceError

log = logging.getLogger("polar.app.node.isolation")

MODES = ("auto", "namespace", "network", "none")
SANDBOX = Path(__file__).with_name("sandbox.py")
GATEWAY_SOCKET = "gateway.sock"  # in the session folder: the node's end of the harness URL
# Where a sandboxed command finds its session folder (sandbox.py: on the tmpfs that hides /tmp), the
# same for every session.
SESSION_FOLDER = "/tmp/polar-session"
PROBE_TIMEOUT_S = 20.0
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock")


class IsolationUnavailable(ServiceError):
    """The isolation asked for cannot be made on this machine; the message says why."""


@dataclass(frozen=True)
class Isolation:
    """What a local runtime does to its commands: `mode` ("none", "namespace" or "network"), and for
    "network" the gateway's harness URL that the namespace forwards."""

    mode: str = "none"
    harness_url: str = ""


NO_ISOLATION = Isolation()


def resolve(requested: str, harness_url: str, work_root: Path) -> Isolation:
    """The isolation a node applies for its `harness_isolation` setting: the namespaces are tried
    once, now (a second or so); "auto" falls back to "none" where they cannot be made, an explicit
    "namespace" or "network" raises IsolationUnavailable saying why."""
    if requested not in MODES:
        raise ValueError(f"harness_isolation must be one of {', '.join(MODES)}, not {requested!r}")
    if requested == "none":
        return Isolation()
    mode = "namespace" if requested == "auto" else requested
    if mode == "network":
        gateway_address(harness_url)  # a URL without a port is refused before anything runs
    problem = probe(mode, work_root)
    if problem is None:
        return Isolation(mode, harness_url if mode == "network" else "")
    if requested == "auto":
        log.warning("harnesses run without isolation: %s", problem)
        return Isolation()
    raise IsolationUnavailable(f"harness_isolation = {requested!r} is not available here: {problem}")


def probe(mode: str, work_root: Path) -> str | None:
    """None when a command runs in a sandbox of `mode` here, else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "util-linux `unshare` is not installed"
    interpreter = (Path(sys.executable).absolute(), Path(os.path.realpath(sys.executable)))
    for path, _ in hidden_paths(work_root):
        if any(name.is_relative_to(path) for name in interpreter):
            # The sandbox runs sandbox.py with this interpreter once its folders are hidden.
            return f"the node's Python ({sys.executable}) lies in {path}, which the sandbox hides"
    work_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-", dir=work_root) as root:
        argv = sandbox_argv(["true"], Isolation(mode), Path(root), network=mode == "network")
        try:
            result = subprocess.run(
                argv,
                cwd=root,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`unshare` did not run: {exc}"
    if result.returncode != 0:
        output = (result.stderr + result.stdout).strip()[-500:] or f"exit code {result.returncode}"
        return f"a sandboxed command did not run here ({output})"
    return None


def hidden_paths(work_root: Path) -> list[list[str]]:
    """[path, mode] of what the sandbox covers, parents before what they hold."""
    folders = {str(credentials.state_dir()), str(work_root.resolve())}
    if os.environ.get(credentials.ENV_VAR):
        folders.add(os.environ[credentials.ENV_VAR])
    if os.environ.get("XDG_RUNTIME_DIR"):
        folders.add(os.environ["XDG_RUNTIME_DIR"])
    shared = {"/tmp", "/dev/shm", tempfile.gettempdir()}
    paths = {os.path.realpath(path): "0755" for path in folders}
    paths.update({os.path.realpath(path): "1777" for path in shared})
    paths.update({path: "" for path in DOCKER_SOCKETS if os.path.exists(path)})
    return [[path, mode] for path, mode in sorted(paths.items()) if path != "/"]


def sandbox_argv(argv: list[str], isolation: Isolation, root: Path, *, network: bool) -> list[str]:
    """argv, run in the sandbox `isolation` asks for (sandbox.py), in session folder `root`;
    `network`: in a network namespace of its own (forwarding the harness URL when there is one)."""
    unshare = shutil.which("unshare") or "unshare"
    spec = {
        "hide": hidden_paths(root.parent),
        "keep": str(root.resolve()),
        "mount_at": SESSION_FOLDER,
        "network": network,
        "forward": forward_target(isolation.harness_url) if network and isolation.harness_url else None,
        "uid": os.getuid(),
        "gid": os.getgid(),
        "unshare": unshare,
        "dying_with_parent": dying_with_parent([], "KILL"),
    }
    namespaces = [unshare, "--user", "--map-root-user", "--mount", *(["--net"] if network else [])]
    # -S: sandbox.py needs no site-packages, and the site module's start-up was most of its CPU time
    # (about 30 of 50 ms, paid twice per command: leader and init).
    return [*namespaces, "--", sys.executable, "-I", "-S", str(SANDBOX), "leader", json.dumps(spec), "--", *argv]


def as_seen_inside(value: str, root: Path) -> str:
    """`value` (an argument or an environment variable's value, maybe a PATH-like list) with every
    path in the session folder `root` rewritten to where a sandboxed command sees it (SESSION_FOLDER)."""
    prefixes = {str(root), str(root.resolve())}

    def one(part: str) -> str:
        for prefix in prefixes:
            if part == prefix or part.startswith(prefix + os.sep):
                return SESSION_FOLDER + part[len(prefix) :]
        return part

    return os.pathsep.join(one(part) for part in value.split(os.pathsep))


def gateway_address(url: str) -> tuple[str, int]:
    """The host and port a harness URL names; ValueError when it names no port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise IsolationUnavailable(
            f"harness_isolation = 'network' needs a harness URL with a host and a port, not {url!r}"
        )
    return parts.hostname, port


def in_namespace_url(url: str) -> str:
    """The harness URL as a harness in the network namespace dials it: a loopback address kept, any
    other host replaced by 127.0.0.1 (the forwarder listens there, on the same port)."""
    host, port = gateway_address(url)
    if _is_loopback(host):
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


def forward_target(url: str) -> list:
    """[host, port, socket] of the forwarder inside the namespace."""
    host, port = gateway_address(in_namespace_url(url))
    return [host, port, GATEWAY_SOCKET]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GatewayRelay:
    """The node's end of a sandbox's harness URL: a Unix socket in the session folder whose every
    connection is relayed, byte for byte as it arrives, to the gateway's harness address."""

    def __init__(self, root: Path, harness_url: str) -> None:
        self.path = root / GATEWAY_SOCKET
        self.address = gateway_address(harness_url)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        folder = os.open(self.path.parent, os.O_PATH | os.O_DIRECTORY)
        try:
            # Through the folder's descriptor: a socket's address holds at most 107 bytes, a session
            # folder's path may not.
            listener.bind(f"/proc/self/fd/{folder}/{self.path.name}")
        except OSError:
            listener.close()
            raise
        finally:
            os.close(folder)
        self._server = await asyncio.start_unix_server(self._relay, sock=listener)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.address)
            except OSError as exc:
                log.warning("a sandboxed harness's connection to the gateway %s:%s failed: %s", *self.address, exc)
                return
            try:
                await asyncio.gather(_pump(reader, upstream_writer), _pump(upstream_reader, writer))
            finally:
                upstream_writer.close()
        finally:
            writer.close()
            self._connections.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
