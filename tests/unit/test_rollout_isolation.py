"""The local runtime's sandbox (polar/app/node/isolation.py, sandbox.py) with real namespaces and real
processes: what a command inside sees of the node, that it ends exactly as it would outside, and
that the harness URL is its only way out under "network", relayed as a stream. Skipped, with the
reason, where this machine cannot make user namespaces. Plus the docker runtime's command line
(Docker itself is not run here)."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import pytest

from polar import credentials
from polar.app.node.isolation import GATEWAY_SOCKET, Isolation, IsolationUnavailable, in_namespace_url, probe, resolve
from polar.app.node.process import run_process
from polar.app.node.runtimes import LocalProvider
from polar.v1 import rollout_pb2

pytestmark = pytest.mark.anyio

with tempfile.TemporaryDirectory() as probe_folder:
    UNAVAILABLE = probe("network", Path(probe_folder))
needs_namespaces = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no user namespaces here: {UNAVAILABLE}")


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state folder with a credential in it, as `polar up` leaves it."""
    folder = tmp_path / "state"
    monkeypatch.setenv(credentials.STATE_ENV_VAR, str(folder))
    credentials.ensure()
    return folder


async def runtime_in(tmp_path: Path, isolation: Isolation):
    return await LocalProvider(tmp_path / "sessions", isolation=isolation).create(rollout_pb2.RuntimeSpec(), name="s")


def _observed(result) -> tuple:
    """What a command's result says, all but its timing."""
    return (result.exit_code, result.timed_out, result.cancelled, result.output, result.output_bytes)


def env() -> dict[str, str]:
    return {"PATH": os.environ["PATH"]}


@needs_namespaces
@pytest.mark.parametrize("mode", ["namespace", "network"])
async def test_a_sandboxed_command_sees_nothing_of_the_node(tmp_path, state, mode):
    runtime = await runtime_in(tmp_path, Isolation(mode, "http://127.0.0.1:9"))
    other = await runtime_in(tmp_path, Isolation())
    try:
        (runtime.workspace / "mine.txt").write_text("mine")
        script = (
            f"cat {state}/credentials/node; ls {other.root}; cat mine.txt; echo; "
            # The working folder was entered after the mounts: ".." leads to the kept folder's parent
            # on the covering tmpfs, not to the sessions folder underneath.
            "echo above: $(ls ../..); "
            # Only this command's processes: no node, no pytest.
            "ls /proc | grep -c '^[0-9]'; "
            f"{sys.executable} -c \"import ctypes; print('umount', ctypes.CDLL(None).umount2(b'/tmp', 2))\""
        )
        result = await runtime.run(["sh", "-c", script], env=env(), timeout_s=30)
    finally:
        await runtime.close()
        await other.close()
    lines = result.output.splitlines()
    assert f"cat: {state}/credentials/node: No such file or directory" in lines
    assert f"ls: cannot access '{other.root}': No such file or directory" in lines
    assert "mine" in lines
    assert "above: polar-session" in lines  # this session only, at the path every session has
    assert int(lines[-2]) <= 4  # init, sh, ls, grep
    assert lines[-1] == "umount -1"
    assert result.exit_code == 0


@needs_namespaces
@pytest.mark.parametrize("mode", ["namespace", "network"])
async def test_every_session_sees_its_own_files_at_the_same_paths(tmp_path, state, mode):
    """A CLI writes its working folder and HOME into its system prompt: the same paths in every
    session make the same prompt, while each session still writes only its own folder."""
    runtimes = [await runtime_in(tmp_path, Isolation(mode, "http://127.0.0.1:9")) for _ in range(2)]
    try:
        seen = []
        for index, runtime in enumerate(runtimes):
            variables = {**env(), "HOME": str(runtime.home), "REWARD": str(runtime.root / "reward")}
            script = f'pwd; echo "$HOME"; echo "$REWARD"; echo {index} > mine.txt; echo {index} > "$REWARD"'
            result = await runtime.run(["sh", "-c", script], env=variables, timeout_s=30)
            assert result.exit_code == 0, result.output
            seen.append(result.output.splitlines())
        assert runtimes[0].root != runtimes[1].root
        assert seen[0] == seen[1] == ["/tmp/polar-session/work", "/tmp/polar-session/home", "/tmp/polar-session/reward"]
        for index, runtime in enumerate(runtimes):
            assert (runtime.workspace / "mine.txt").read_text() == f"{index}\n"
            assert (runtime.root / "reward").read_text() == f"{index}\n"
    finally:
        for runtime in runtimes:
            await runtime.close()


# Timeouts leave the sandbox time to start the command first: under CI's load 1.5 s was not
# enough once (the command was killed after the grace, -9, instead of by the SIGTERM, -15).
SCRIPTS = [
    ("exit 3", None),
    ("echo out; echo err >&2; kill -TERM $$", None),
    ("sleep 30", 3),  # killed by the group's SIGTERM at the timeout
    ("trap 'echo bye; exit 7' TERM; sleep 30 & wait", 3),  # handles it
    ("trap '' TERM; sleep 30", 3),  # ignores it: SIGKILL after the grace
    ("head -c 100000 /dev/zero | tr '\\0' x; echo", None),  # past the output limit
]


@needs_namespaces
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["namespace", "network"])
async def test_a_sandboxed_command_ends_exactly_as_it_would_outside(tmp_path, state, mode):
    runtime = await runtime_in(tmp_path, Isolation(mode, "http://127.0.0.1:9"))
    try:
        for script, timeout_s in SCRIPTS:
            outside = await run_process(
                ["sh", "-c", script],
                cwd=runtime.workspace,
                env=env(),
                timeout_s=timeout_s,
                output_limit=1000,
                kill_grace_s=0.5,
            )
            inside = await runtime.run(["sh", "-c", script], env=env(), timeout_s=timeout_s, output_limit=1000)
            assert _observed(inside) == _observed(outside), script
        cancel = asyncio.Event()
        asyncio.get_running_loop().call_later(1.5, cancel.set)
        cancelled = await runtime.run(["sleep", "30"], env=env(), timeout_s=None, cancel=cancel)
        assert (cancelled.exit_code, cancelled.cancelled, cancelled.timed_out) == (-15, True, False)
        assert cancelled.seconds < 5
    finally:
        await runtime.close()


@needs_namespaces
async def test_under_network_only_the_harness_url_answers_and_it_streams(tmp_path, state):
    """A server standing in for the gateway answers in steps, each only after the client acknowledged
    the one before: a relay that held bytes back would stall it."""

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for step in range(3):
            writer.write(f"event {step}\n".encode())
            await writer.drain()
            assert await reader.readline() == f"ack {step}\n".encode()
        writer.write(b"end\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(gateway, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    other = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    other_port = other.sockets[0].getsockname()[1]
    client = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {other_port}), timeout=5)
    print("other port: ALLOWED")
except OSError as exc:
    print("other port:", exc.strerror)
with socket.create_connection(("127.0.0.1", {port}), timeout=10) as gateway:
    lines = gateway.makefile("rb")
    for step in range(3):
        print(lines.readline().decode().strip(), flush=True)
        gateway.sendall(f"ack {{step}}\\n".encode())
    print(lines.readline().decode().strip())
"""
    runtime = await runtime_in(tmp_path, Isolation("network", f"http://127.0.0.1:{port}"))
    try:
        assert (runtime.root / GATEWAY_SOCKET).is_socket()
        assert runtime.harness_base_url(f"http://127.0.0.1:{port}/x") == f"http://127.0.0.1:{port}/x"
        result = await runtime.run([sys.executable, "-c", client], env=env(), timeout_s=30)
        # A prepare step keeps the node's network.
        prepared = await runtime.run(
            [sys.executable, "-c", client.split("with socket")[0]], env=env(), timeout_s=30, preparing=True
        )
    finally:
        await runtime.close()
        server.close()
        other.close()
    assert result.output.splitlines() == ["other port: Connection refused", "event 0", "event 1", "event 2", "end"]
    assert result.exit_code == 0
    assert prepared.output.strip() == "other port: ALLOWED"


def test_a_harness_url_of_another_host_is_dialled_at_loopback_inside():
    assert in_namespace_url("http://gw.example:8080/v1") == "http://127.0.0.1:8080/v1"
    assert in_namespace_url("http://[::1]:8080") == "http://[::1]:8080"


def test_auto_falls_back_to_none_and_an_explicit_mode_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare` on it
    assert resolve("auto", "http://127.0.0.1:8080", tmp_path / "w") == Isolation()
    assert resolve("none", "http://127.0.0.1:8080", tmp_path / "w") == Isolation()
    with pytest.raises(
        IsolationUnavailable, match="'namespace' is not available here: util-linux `unshare` is not installed"
    ):
        resolve("namespace", "http://127.0.0.1:8080", tmp_path / "w")
    with pytest.raises(IsolationUnavailable, match="needs a harness URL with a host and a port"):
        resolve("network", "http://127.0.0.1", tmp_path / "w")


def test_a_node_python_inside_a_hidden_folder_is_named_as_the_reason(tmp_path, monkeypatch):
    """A checkout under /tmp runs its venv's Python from a folder the sandbox covers: the probe says
    so, rather than blaming user namespaces, and "auto" falls back with that reason."""
    from polar.app.node import isolation

    monkeypatch.setattr(isolation.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(isolation.sys, "executable", "/tmp/checkout/.venv/bin/python")
    assert isolation.probe("namespace", tmp_path / "work") == (
        "the node's Python (/tmp/checkout/.venv/bin/python) lies in /tmp, which the sandbox hides"
    )
