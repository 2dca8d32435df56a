"""The collective transport end to end on a CPU (gloo): the trainer's InferencePool against real
inference servers (the tiny model) on loopback ports, the group set up through their gRPC
UpdateWeightsCollective streams. After a sync every server's parameters are the trainer's tensors
bit for bit; a server killed mid-sync leaves the trainer with an error naming it within the timeout,
and the other server on the old version, serving; a server that joins later is in the next sync's
group; a group is kept between syncs while its servers stay the same, and built anew when one joins,
restarts, or a sync failed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from polar.inference import collective
from polar.v1 import inference_pb2_grpc
from tests.helpers.tiny_inference_server import TinyServer, new_weights
from trainer.weight_collective import CollectiveSender
from trainer.weight_sync import InferencePool, WeightSyncError

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.slow,
    pytest.mark.skipif(not collective.transports("cpu"), reason="this torch has no gloo"),
]

ROOT = Path(__file__).resolve().parents[2]
_SERVE = """
import asyncio, sys
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.server import start_server
async def main():
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", dtype="float32", max_batch_size=2))
    server, port = await start_server(engine)
    print("port", port, flush=True)
    await asyncio.to_thread(sys.stdin.read)
asyncio.run(main())
"""


async def push(
    addresses: list[str], weights, transport: str = "gloo", bucket_bytes: int = 1 << 20, timeout_s: float = 30.0
):
    pool = InferencePool(addresses, transport=transport, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    try:
        return await asyncio.to_thread(pool.push, weights, "step 1")
    finally:
        pool.close()


async def test_after_a_gloo_sync_every_server_holds_the_trainer_s_tensors_and_a_late_joiner_is_brought_in(tiny_servers):
    first, second = tiny_servers
    assert "gloo" in (await first.info()).weight_transports
    weights = new_weights(first, seed=1)
    # 1 MiB buckets: the 12.6 MB embedding goes in pieces over several.
    result = await push([first.address, second.address], weights.items)
    assert result.transport == "gloo" and result.policy_version == 1
    assert result.bytes_sent == sum(t.numel() * 4 for t in weights.values())
    assert {s.address for s in result.servers} == {first.address, second.address}
    assert all(s.transport == "gloo" and s.gb_per_s > 0 for s in result.servers)
    for server in tiny_servers:
        held = server.parameters()
        assert all(torch.equal(held[name], tensor) for name, tensor in weights.items())
        assert (await server.greedy())[1] == {1}
    # A server started later (at the run's version) is a member of the next sync's group.
    late = await TinyServer().start(policy_version=1)
    try:
        weights = new_weights(first, seed=2)
        result = await push([first.address, second.address, late.address], weights.items)
        assert result.policy_version == 2 and len(result.servers) == 3
        outputs = [await server.greedy() for server in (*tiny_servers, late)]
        assert all(output == outputs[0] for output in outputs) and outputs[0][1] == {2}
        assert all(torch.equal(late.parameters()[name], tensor) for name, tensor in weights.items())
    finally:
        await late.stop()


async def test_a_server_killed_mid_sync_fails_the_trainer_in_bounded_time_and_the_other_stays_on_the_old_version(
    tiny_servers,
):
    staying = tiny_servers[0]
    before = await staying.greedy()
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = await asyncio.to_thread(process.stdout.readline)
        assert line.startswith("port "), line
        dying = f"127.0.0.1:{line.split()[1]}"
        weights = new_weights(staying, seed=3)

        class KilledHalfWay:
            """The weights, read as the trainer packs them (it knows their number first, as of a
            backend's); the second server is killed (SIGKILL) half-way through them."""

            def __len__(self) -> int:
                return len(weights)

            def __iter__(self):
                for index, item in enumerate(weights.items()):
                    if index == len(weights) // 2:
                        process.send_signal(signal.SIGKILL)
                        process.wait()
                        killed.append(time.monotonic())
                    yield item

        killed: list[float] = []

        timeout_s = 30.0
        started = time.monotonic()
        with pytest.raises(WeightSyncError) as caught:
            # 64 KiB buckets: many broadcasts are still to come when the server dies.
            await push([staying.address, dying], KilledHalfWay, bucket_bytes=1 << 16, timeout_s=timeout_s)
        assert killed and time.monotonic() - started < timeout_s  # killed mid-broadcast, noticed before the timeout
    finally:
        process.kill()
        process.wait()
    message = str(caught.value)
    assert dying in message and "(gloo)" in message and "no server was switched" in message, message
    info = await staying.info()
    assert info.policy_version == 0 and not info.paused
    assert await staying.greedy() == (before[0], {0})  # the old weights, serving again
    result = await push([staying.address], weights.items)  # the survivor takes the next sync whole
    assert result.policy_version == 1 and all(torch.equal(staying.parameters()[n], t) for n, t in weights.items())


async def test_a_transport_a_server_does_not_offer_is_refused_naming_it(tiny_servers):
    with pytest.raises(WeightSyncError) as caught:
        await push([tiny_servers[0].address], new_weights(tiny_servers[0], seed=4).items, transport="nccl")
    assert tiny_servers[0].address in str(caught.value) and "does not offer the nccl" in str(caught.value)
    assert (await tiny_servers[0].info()).policy_version == 0


async def test_a_group_is_kept_between_syncs_and_built_anew_when_a_server_joins_restarts_or_a_sync_failed(tiny_servers):
    """The trainer's CollectiveSender against real servers: consecutive syncs to the same servers go
    over one group; a server joining, a failed sync, and a server restarted at the same address
    (which no longer holds the group) each lead to a new one, and every sync lands whole."""
    first, second = tiny_servers
    sender = CollectiveSender(bucket_bytes=1 << 20, timeout_s=30.0)
    channels: list[grpc.Channel] = []

    def member(server: TinyServer) -> tuple[str, object]:
        channels.append(grpc.insecure_channel(server.address))
        return server.address, inference_pb2_grpc.InferenceServiceStub(channels[-1])

    async def sync(members, weights) -> bool:
        sent = await asyncio.to_thread(sender.send, "gloo", members, weights.items(), "", "")
        assert len(sent.results) == len(members)
        return sent.new_group

    late = None
    try:
        pair = [member(first), member(second)]
        weights = new_weights(first, seed=5)
        assert await sync(pair, weights) and not await sync(pair, new_weights(first, seed=6))
        assert sender.groups_built == 1
        weights = new_weights(first, seed=7)
        assert not await sync(pair, weights) and sender.groups_built == 1
        assert all(torch.equal(s.parameters()[n], t) for s in tiny_servers for n, t in weights.items())
        versions = [s.engine.policy_version for s in tiny_servers]

        # A server joins: a new group of three.
        late = await TinyServer().start()
        trio = [*pair, member(late)]
        assert await sync(trio, new_weights(first, seed=8)) and sender.groups_built == 2
        assert not await sync(trio, new_weights(first, seed=9)) and sender.groups_built == 2

        # A sync that fails half-way (the trainer's weights break off): the group is not used again.
        def broken():
            for index, item in enumerate(new_weights(first, seed=10).items()):
                if index == 3:
                    raise RuntimeError("the trainer's weights broke off")
                yield item

        class Broken:
            def __len__(self) -> int:
                return len(first.engine.parameter_specs())

            def __iter__(self):
                return broken()

        with pytest.raises(RuntimeError, match="broke off"):
            await asyncio.to_thread(sender.send, "gloo", trio, Broken(), "", "")
        weights = new_weights(first, seed=11)
        assert await sync(trio, weights) and sender.groups_built == 3
        assert all(torch.equal(s.parameters()[n], t) for s in (*tiny_servers, late) for n, t in weights.items())
        assert [s.engine.policy_version for s in tiny_servers] == [v + 3 for v in versions]

        # A server restarted at the same address holds no group: the sync goes over a new one.
        port = int(late.address.rsplit(":", 1)[1])
        await late.stop()
        late = await TinyServer().start(port=port)
        weights = new_weights(first, seed=12)
        assert await sync(trio, weights) and sender.groups_built == 4
        assert all(torch.equal(s.parameters()[n], t) for s in (*tiny_servers, late) for n, t in weights.items())
    finally:
        sender.close()
        for channel in channels:
            channel.close()
        if late is not None:
            await late.stop()
