"""`polar serve xds`: Envoy's control plane alone, as a process of its own. An inference server
joins it, a real Envoy learns the endpoint from it and routes a call there, the rollout server's
other rpcs are not served, and a server that leaves is removed. Every wait is bounded."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from polar import envoy
from polar.config import EnvoyConfig
from polar.inference.engines.scripted import ScriptedEngine
from polar.inference.server import start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from polar.xds.member import UpstreamMember
from polar.xds.snapshot import INFERENCE_CLUSTER
from tests.helpers.polar_command import spawned
from tests.helpers.waiting import until

pytestmark = pytest.mark.anyio

WAIT_S = 15.0
ENVOY_ID = "envoy-standalone"


async def test_the_control_plane_alone_tells_envoy_its_upstreams(tmp_path):
    engine = ScriptedEngine.from_script(
        {"vocab_size": 100, "cycle": True, "outputs": [{"token_ids": [7, 8], "logprobs": [-0.5, -0.5]}]}
    )
    server, port = await start_server(engine)
    try:
        with spawned() as start:
            process, lines = start(
                "serve", "xds", "--port", "0", "--heartbeat-interval-s", "0.2", "--upstream-timeout-s", "1"
            )
            address = (await asyncio.to_thread(lines.wait_for, r"control plane .* on (127\.0\.0\.1:\d+)", 60)).group(1)
            member = UpstreamMember(address, INFERENCE_CLUSTER, f"127.0.0.1:{port}")
            await member.start(timeout_s=WAIT_S)
            config = EnvoyConfig(
                harness_port=0,
                inference_port=0,
                admin_port=0,
                workers=1,
                health_check_interval_s=0.2,
                xds_address=address,
                node_id=ENVOY_ID,
            )
            async with envoy.running_async(config) as proxy, grpc.aio.insecure_channel(address) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)

                async def acknowledged() -> rollout_pb2.EnvoyInfo | None:
                    envoys = {
                        e.node_id: e
                        for e in (await stub.ListUpstreams(rollout_pb2.ListUpstreamsRequest(), timeout=5)).envoys
                    }
                    mine = envoys.get(ENVOY_ID)
                    return (
                        mine
                        if mine is not None and mine.version and mine.acknowledged_version == mine.version
                        else None
                    )

                await until("Envoy acknowledges the control plane's endpoints", acknowledged)

                async def generated() -> list[int] | None:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.inference_port}") as through_envoy:
                        request = inference_pb2.GenerateRequest(
                            prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)
                        )
                        try:
                            calls = inference_pb2_grpc.InferenceServiceStub(through_envoy).Generate(request, timeout=5)
                            return [t async for m in calls for t in m.token_ids]
                        except grpc.aio.AioRpcError:  # Envoy's first health check has not passed yet
                            return None

                assert await until("a call through Envoy reaches the joined server", generated) == [7, 8]
                # Only the control plane's rpcs are served.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.RegisterNode(rollout_pb2.RegisterNodeRequest(runtimes=["local"]), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
                await member.leave()

                async def removed() -> bool:
                    return not (await stub.ListUpstreams(rollout_pb2.ListUpstreamsRequest(), timeout=5)).upstreams

                await until("the server that left is removed", removed)
            process.terminate()
            assert process.wait(timeout=15) == 0
    finally:
        await server.stop(None)
        await engine.stop()
