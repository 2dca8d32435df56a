"""What a session's container can reach: the harness URL (forwarded to the gateway) and nothing
else of the node. A listener standing for the gateway and one standing for the control plane run
on this machine; from inside the container (its image's python3, as a harness would):

- the harness URL answers, through the forwarder and the session folder's socket;
- the control plane's port answers neither on loopback (refused) nor on any of this machine's
  addresses (no route: the container has no network but its loopback);
- the credentials folder, the node's work folder and the Docker socket are absent;
- another session's container and files cannot be reached.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess

import pytest

from polar import credentials
from polar.app.node.runtimes import DockerProvider
from polar.v1 import rollout_pb2

pytestmark = pytest.mark.anyio

IMAGE = "polar-base:bookworm"

PROBE = """
import json, os, socket, sys
def connect(host, port):
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"ping\\n")
            return "answered: " + s.recv(100).decode()
    except OSError as exc:
        return type(exc).__name__ + ": " + (exc.strerror or str(exc))
spec = json.loads(sys.argv[1])
print(json.dumps({
    "gateway": connect("127.0.0.1", spec["gateway"]),
    "control_loopback": connect("127.0.0.1", spec["control"]),
    "control_elsewhere": {host: connect(host, spec["control"]) for host in spec["hosts"]},
    "other_session": connect(spec["other"], spec["gateway"]),
    "paths": {path: os.path.exists(path) for path in spec["paths"]},
    "interfaces": sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]),
    "sessions": sorted(os.listdir("/polar")),
}))
"""


def host_addresses() -> list[str]:
    addresses = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    shown = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return sorted((addresses | {a for a in shown if ":" not in a}) - {"127.0.0.1"})


async def test_only_the_harness_url_is_reachable_from_a_sessions_container(tmp_path):
    async def gateway(reader, writer):
        await reader.readline()
        writer.write(b"gateway")
        await writer.drain()
        writer.close()

    async def control_plane(reader, writer):
        writer.write(b"control plane")
        await writer.drain()
        writer.close()

    gateway_server = await asyncio.start_server(gateway, "127.0.0.1", 0)
    control_server = await asyncio.start_server(control_plane, "0.0.0.0", 0)
    gateway_port = gateway_server.sockets[0].getsockname()[1]
    control_port = control_server.sockets[0].getsockname()[1]
    work_root = tmp_path / "sessions"
    provider = DockerProvider(work_root, harness_url=f"http://127.0.0.1:{gateway_port}")
    spec = rollout_pb2.RuntimeSpec(kind="docker", image=IMAGE)
    mine, other = await asyncio.gather(provider.create(spec, name="mine"), provider.create(spec, name="other"))
    try:
        (other.workspace / "secret").write_text("other session")
        inspect = ["docker", "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"]
        other_address = subprocess.run([*inspect, other.container], capture_output=True, text=True).stdout.strip()
        paths = [
            str(credentials.state_dir()),
            str(work_root),
            str(other.root),
            "/var/run/docker.sock",
            "/run/docker.sock",
            "/polar/session/work/secret",
        ]
        probe = {
            "gateway": gateway_port,
            "control": control_port,
            "hosts": host_addresses(),
            "other": other_address or "172.17.0.2",
            "paths": paths,
        }
        result = await mine.run(["python3", "-c", PROBE, json.dumps(probe)], env={}, timeout_s=120)
        assert result.exit_code == 0, result.output
        seen = json.loads(result.output.strip().splitlines()[-1])
        assert seen["gateway"] == "answered: gateway", seen
        assert seen["control_loopback"].startswith("ConnectionRefusedError"), seen
        assert probe["hosts"], "no address of this machine to try"
        for host, answer in seen["control_elsewhere"].items():
            assert "unreachable" in answer.lower(), (host, answer)
        # No container has an address to reach on a network, this one's own or another's.
        assert other_address == "" and "unreachable" in seen["other_session"].lower(), seen
        assert seen["interfaces"] == ["lo"], seen
        assert not any(seen["paths"].values()), seen
        assert seen["sessions"] == ["session"], seen
    finally:
        await asyncio.gather(mine.close(), other.close())
        gateway_server.close()
        control_server.close()
