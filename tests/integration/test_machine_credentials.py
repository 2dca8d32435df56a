"""Machines joining a stack with credentials of their own: the rollout server on 127.0.0.1 (with the
stack's own tokens), an inference server on 127.0.0.3 and a node (Envoy and a gateway node) on
127.0.0.2, each `polar up --role ...` with only the credential the operator issued it by name.
`polar status` shows which credential each joined with. The node runs sessions through its Envoy to
the other machine's inference server; a token admits only its own name; revoking cuts each off, the
node's Envoy's open ADS stream included. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format

from polar import codec, credentials
from polar.config import RolloutConfig
from polar.rollout.server import RunningRollout, start_rollout_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from polar.xds.snapshot import ENDPOINT_TYPE, GATEWAY_CLUSTER, INFERENCE_CLUSTER
from tests.helpers.polar_command import run, spawned
from tests.helpers.waiting import until

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0
START_S = 120.0  # a `polar up` share of the stack, started on a machine other tests load too
TASK = {
    "taskId": "on-b",
    "instruction": "Write the word hello to the file hello.txt using the write_file tool.",
    "groupSize": 2,
    "harness": {"preset": "command", "command": ["python3", "agent.py"]},
    "runtime": {"kind": "local", "template": "examples/agent"},
    "evaluator": {"kind": "command", "command": "test -f agent.py"},
    "timeoutSeconds": 60,
}


@contextlib.asynccontextmanager
async def rollout_machine(tmp_path: Path, monkeypatch) -> AsyncIterator[tuple[RunningRollout, credentials.Credentials]]:
    own = credentials.ensure(tmp_path / "a")
    monkeypatch.setenv(credentials.ENV_VAR, str(own.folder))
    config = RolloutConfig(
        host="127.0.0.1", port=0, store=str(tmp_path / "rollout.db"), heartbeat_interval_s=0.5, node_timeout_s=5.0
    )
    running = await start_rollout_server(config)
    try:
        yield running, own
    finally:
        await running.stop(grace=0.5)


def issue(own: credentials.Credentials, name: str, role: str, folder: Path) -> str:
    done = run(
        "credentials",
        "issue",
        name,
        role,
        "--out",
        str(folder),
        env={**os.environ, credentials.ENV_VAR: str(own.folder)},
    )
    assert done.returncode == 0, done.stderr
    return (folder / role).read_text().strip()


def machine_config(folder: Path, host: str) -> str:
    folder.mkdir(exist_ok=True)
    script = folder / "script.json"
    script.write_text(json.dumps({"cycle": True, "outputs": [{"text": "done"}]}))
    path = folder / "stack.toml"
    path.write_text(
        f'[inference]\nhost = "{host}"\nengine = "scripted"\nscript = "{script}"\nport = 0\n'
        f'[gateway]\nhost = "{host}"\nport = 0\ngrpc_port = 0\n'
        f'[envoy]\nhost = "{host}"\nnode_id = "envoy-{host}"\nharness_port = 0\ninference_port = 0\nadmin_port = 0\n'
        f'access_log = "{folder / "access.log"}"\n'
        '[node]\nrunning_slots = 2\nharness_isolation = "none"\n'
    )
    return str(path)


async def _is(status, expected: grpc.StatusCode) -> bool:
    return await status == expected


async def _not(check) -> bool:
    return not await check


@pytest.mark.slow
async def test_machines_join_with_their_own_credentials_run_sessions_and_are_cut_off_when_revoked(
    tmp_path, monkeypatch
):
    async with (
        rollout_machine(tmp_path, monkeypatch) as (rollout, own),
        grpc.aio.insecure_channel(rollout.address) as channel,
    ):
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        operator = own.metadata(credentials.OPERATOR)
        node_b = issue(own, "node-b", credentials.NODE, tmp_path / "b-credentials")
        issue(own, "gpu-c", credentials.INFERENCE, tmp_path / "c-credentials")
        with spawned() as start:
            c, c_lines = start(
                "up",
                "--role",
                "inference",
                "--rollout",
                rollout.address,
                "--config",
                machine_config(tmp_path / "c", "127.0.0.3"),
                cwd=REPO,
                env={**os.environ, credentials.ENV_VAR: str(tmp_path / "c-credentials")},
            )
            b, b_lines = start(
                "up",
                "--role",
                "node",
                "--rollout",
                rollout.address,
                "--config",
                machine_config(tmp_path / "b", "127.0.0.2"),
                cwd=REPO,
                env={**os.environ, credentials.ENV_VAR: str(tmp_path / "b-credentials")},
            )
            await asyncio.to_thread(c_lines.wait_for, r"^  inference\s+127\.0\.0\.3:", START_S)
            await asyncio.to_thread(b_lines.wait_for, r"^  node\s+127\.0\.0\.2:", START_S)

            # Both joined as their names; B's sessions run through B's Envoy on C's server.
            listed = await stub.ListUpstreams(rollout_pb2.ListUpstreamsRequest(), metadata=operator, timeout=10)
            clusters = {u.cluster: u.address for u in listed.upstreams}
            assert clusters[INFERENCE_CLUSTER].startswith("127.0.0.3:") and clusters[GATEWAY_CLUSTER].startswith(
                "127.0.0.2:"
            )
            members = {m.credential: m for m in rollout.servicer.membership.members()}
            assert set(members) == {"node-b", "gpu-c"}

            # `polar status` names the credential (and its role) each node, upstream and Envoy came with.
            status = await asyncio.to_thread(
                run, "status", "--rollout", rollout.address, env={**os.environ, credentials.ENV_VAR: str(own.folder)}
            )
            assert status.returncode == 0, status.stderr
            rows = {line.split()[0]: line for line in status.stdout.splitlines() if line.strip()}
            assert [row.endswith("node-b (node)") for name, row in rows.items() if name.startswith("node-")] == [True]
            assert [
                row.endswith("gpu-c (inference)") for name, row in rows.items() if name.startswith("inference-")
            ] == [True]
            assert [row.endswith("node-b (node)") for name, row in rows.items() if name.startswith("gateway-")] == [
                True
            ]
            assert "node-b (node)" in rows["envoy-127.0.0.2"]
            task = json_format.ParseDict(TASK, rollout_pb2.Task())
            await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task]), metadata=operator, timeout=10)

            async def released() -> rollout_pb2.TaskStatus | None:
                [status] = (
                    await stub.GetTaskStatus(
                        rollout_pb2.GetTaskStatusRequest(task_ids=["on-b"]), metadata=operator, timeout=10
                    )
                ).tasks
                return status if status.released else None

            await until("B runs the task's sessions", released, timeout_s=60.0)
            batch = [
                r
                async for r in stub.WatchResults(
                    rollout_pb2.WatchResultsRequest(until_caught_up=True), metadata=operator, timeout=30
                )
            ]
            trajectories = [t for m in batch for t in codec.read_trajectory_batch(m.zstd_trajectories)]
            assert len(trajectories) == 2
            for trajectory in trajectories:
                assert trajectory.outcome == common_pb2.SESSION_OUTCOME_COMPLETED, trajectory.error
                assert trajectory.calls and all(call.sampled_token_ids for call in trajectory.calls)

            # A stolen token admits only its own name: not the inference cluster ...
            stolen = (("authorization", f"Bearer {node_b}"),)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.JoinUpstream(
                    rollout_pb2.JoinUpstreamRequest(cluster=INFERENCE_CLUSTER, address="127.0.0.9:1"),
                    metadata=stolen,
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # ... and another node registered under it replaces B's (one node per name). B, still
            # running, may register again at once on finding itself replaced, replacing the thief in
            # turn: either way one node holds the name, and it is not B's first.
            [b_node] = (await stub.ListNodes(rollout_pb2.ListNodesRequest(), metadata=operator, timeout=10)).nodes
            thief = await stub.RegisterNode(
                rollout_pb2.RegisterNodeRequest(runtimes=["local"]), metadata=stolen, timeout=10
            )
            nodes = [
                n.node_id
                for n in (await stub.ListNodes(rollout_pb2.ListNodesRequest(), metadata=operator, timeout=10)).nodes
            ]
            assert thief.node_id != b_node.node_id
            assert len(nodes) == 1 and b_node.node_id not in nodes, nodes

            # Revoked: refused at once, and within a second the node and the upstreams are gone.
            async def revoke(name: str) -> None:
                done = await asyncio.to_thread(
                    run, "credentials", "revoke", name, env={**os.environ, credentials.ENV_VAR: str(own.folder)}
                )
                assert done.returncode == 0, done.stderr

            # C admitted B's node while it was issued; once revoked, C learns it with its next heartbeat.
            async def c_admits_b() -> grpc.StatusCode:
                async with grpc.aio.insecure_channel(clusters[INFERENCE_CLUSTER]) as to_c:
                    try:
                        await inference_pb2_grpc.InferenceServiceStub(to_c).GetModelInfo(
                            inference_pb2.GetModelInfoRequest(), metadata=stolen, timeout=10
                        )
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                return grpc.StatusCode.OK

            async def b_envoy_connected() -> bool:
                listed = await stub.ListUpstreams(rollout_pb2.ListUpstreamsRequest(), metadata=operator, timeout=10)
                return next(e.connected for e in listed.envoys if e.node_id == "envoy-127.0.0.2")

            assert await c_admits_b() == grpc.StatusCode.OK
            assert await b_envoy_connected()
            await revoke("node-b")
            await until(
                "C refuses the revoked node", lambda: _is(c_admits_b(), grpc.StatusCode.UNAUTHENTICATED), timeout_s=15.0
            )
            # B's Envoy held its ADS stream open with the revoked credential: the stream ends, and
            # reconnecting (Envoy retries within a second) is refused.
            await until("B's Envoy is cut off the control plane", lambda: _not(b_envoy_connected()), timeout_s=15.0)
            await asyncio.sleep(1.5)
            assert not await b_envoy_connected()
            await revoke("gpu-c")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterNode(
                    rollout_pb2.RegisterNodeRequest(runtimes=["local"]), metadata=stolen, timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

            async def cut_off() -> bool:
                nodes = (await stub.ListNodes(rollout_pb2.ListNodesRequest(), metadata=operator, timeout=10)).nodes
                upstreams = (
                    await stub.ListUpstreams(rollout_pb2.ListUpstreamsRequest(), metadata=operator, timeout=10)
                ).upstreams
                return not nodes and not upstreams

            await until("the revoked machines are removed", cut_off, timeout_s=15.0)
            for process in (b, c):
                assert process.poll() is None  # still running, but refused: it stays out


async def test_revoking_a_credential_ends_the_ads_streams_opened_with_it_and_refuses_it_again(tmp_path, monkeypatch):
    async with (
        rollout_machine(tmp_path, monkeypatch) as (rollout, own),
        grpc.aio.insecure_channel(rollout.address) as channel,
    ):
        stolen = issue(own, "edge-9", credentials.NODE, tmp_path / "edge-credentials")
        ads = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)

        async def subscribed(node_id: str, metadata) -> grpc.aio.StreamStreamCall:
            """An ADS stream asking for the endpoints, as Envoy opens one, once answered."""
            first = discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=node_id), type_url=ENDPOINT_TYPE)
            # Written with call.write, the stream left open as Envoy leaves it: no request generator
            # of this test is left suspended when the call ends (anyio's loop runs the next test,
            # which would see that generator finalized mid-await).
            call = ads.StreamAggregatedResources(metadata=metadata)
            await call.write(first)
            response = await asyncio.wait_for(call.read(), WAIT_S)
            assert response.type_url == ENDPOINT_TYPE and response.version_info
            return call

        issued = await subscribed("edge-9", (("authorization", f"Bearer {stolen}"),))
        stacks_own = await subscribed("stack-envoy", own.metadata(credentials.NODE))
        done = await asyncio.to_thread(
            run, "credentials", "revoke", "edge-9", env={**os.environ, credentials.ENV_VAR: str(own.folder)}
        )
        assert done.returncode == 0, done.stderr

        async def ended(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass
            return await call.code()

        assert await asyncio.wait_for(ended(issued), 5.0) == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in await issued.details()
        # The stack's own Envoy keeps its stream; the revoked credential cannot open another.
        assert not stacks_own.done()
        again = ads.StreamAggregatedResources(
            iter([discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id="edge-9"), type_url=ENDPOINT_TYPE)]),
            metadata=(("authorization", f"Bearer {stolen}"),),
        )
        assert await asyncio.wait_for(ended(again), WAIT_S) == grpc.StatusCode.UNAUTHENTICATED
        stacks_own.cancel()
