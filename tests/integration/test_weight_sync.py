"""The trainer's weight sync (trainer/weight_sync.py) against real inference servers on loopback
ports, the tiny model on the CPU: a server that dies mid-transfer leaves the trainer with an error
naming it and every other server on the old version, serving; a sync started during a generation
waits for it (Pause), so the generation's tokens are all of the old version; a staged update is applied
only by its commit, and dropped by the next update."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from polar.v1 import inference_pb2
from tests.helpers.tiny_inference_server import new_weights
from trainer.weight_sync import InferencePool, WeightSyncError, tensor_messages

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.mark.parametrize("transport", ["stream", "shm"])
async def test_a_server_that_dies_mid_sync_leaves_the_others_on_the_old_version(tiny_servers, transport):
    first, second = tiny_servers
    before = await first.greedy()
    weights = new_weights(first, seed=1)
    loop = asyncio.get_running_loop()
    calls = 0

    def dying_second_server():
        """The weights, for each server in turn; the second server dies half-way through its own."""
        nonlocal calls
        calls += 1
        for index, item in enumerate(weights.items()):
            if calls == 2 and index == len(weights) // 2:
                asyncio.run_coroutine_threadsafe(second.server.stop(None), loop).result()
            yield item

    pool = InferencePool([first.address, second.address], transport=transport)
    try:
        with pytest.raises(WeightSyncError) as caught:
            await asyncio.to_thread(pool.push, dying_second_server, "step 1")
    finally:
        pool.close()
    message = str(caught.value)
    assert second.address in message and "no server was switched" in message, message
    info = await first.info()
    assert info.policy_version == 0 and not info.paused
    assert await first.greedy() == (before[0], {0})  # the old weights, serving again
    # The first server received the update whole but never applied it: the next sync is complete.
    pool = InferencePool([first.address], transport=transport)
    try:
        result = await asyncio.to_thread(pool.push, weights.items, "step 1")
    finally:
        pool.close()
    assert result.policy_version == 1 and result.transport == transport
    assert (await first.greedy())[0] != before[0]


async def test_a_sync_during_a_generation_waits_for_it_and_the_next_one_sees_the_new_version(tiny_servers):
    server = tiny_servers[0]
    weights = new_weights(server, seed=2)
    generation = asyncio.ensure_future(server.greedy(max_tokens=120))
    await asyncio.sleep(0.3)  # the generation is under way
    assert (await server.info()).policy_version == 0
    pool = InferencePool([server.address])
    try:
        push = asyncio.ensure_future(asyncio.to_thread(pool.push, weights.items, "step 1"))
        tokens, versions = await generation
        generated_at = time.monotonic()
        result = await push
        pushed_at = time.monotonic()
    finally:
        pool.close()
    assert len(tokens) == 120 and versions == {0}  # every token of the old weights
    assert pushed_at >= generated_at and result.policy_version == 1
    assert result.bytes_sent == sum(t.numel() * 4 for t in weights.values())
    assert (await server.greedy())[1] == {1}


async def test_a_staged_update_is_applied_only_by_its_commit_and_dropped_by_the_next_update(tiny_servers):
    server = tiny_servers[0]
    before = await server.greedy()
    send = server.channel.stream_unary(
        "/polar.v1.InferenceService/UpdateWeights", response_deserializer=inference_pb2.UpdateWeightsResponse.FromString
    )
    weights = new_weights(server, seed=3)
    staged = await send(iter(list(tensor_messages(weights.items(), note="a", update_id="a"))))
    assert staged.staged and staged.policy_version == 0
    assert await server.greedy() == (before[0], {0})  # held, not applied
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await server.stub.CommitWeights(inference_pb2.CommitWeightsRequest(update_id="b"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'a' is staged" in caught.value.details()
    # A later update that fails half-way has overwritten the buffers "a" was staged in: "a" is gone.
    half = list(tensor_messages(new_weights(server, seed=4).items(), note="c", update_id="c"))
    with pytest.raises(grpc.aio.AioRpcError):
        await send(iter(half[: len(half) // 2]))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await server.stub.CommitWeights(inference_pb2.CommitWeightsRequest(update_id="a"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert await server.greedy() == (before[0], {0})
    await send(iter(list(tensor_messages(weights.items(), note="a", update_id="a"))))
    committed = (await server.stub.CommitWeights(inference_pb2.CommitWeightsRequest(update_id="a"))).result
    assert committed.policy_version == 1 and committed.tensors_updated == len(weights) and not committed.staged
    after, versions = await server.greedy()
    assert after != before[0] and versions == {1}
