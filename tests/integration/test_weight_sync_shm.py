"""Shared memory ("shm"), the weight transport between a trainer and a CPU inference server of one
machine: the trainer's InferencePool against a real tiny-model server on a loopback port. After a
sync the server's parameters are the trainer's tensors bit for bit, through buckets much smaller
than a tensor; no block is left in /dev/shm; a header naming no block on this machine, or GPU buffers
for a CPU engine, fails cleanly and leaves the server on its old version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from polar.inference import sharing
from polar.v1 import inference_pb2
from tests.helpers.tiny_inference_server import TinyServer, new_weights
from trainer.weight_sync import InferencePool

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sharing.SHM not in sharing.transports("cpu"), reason="no /dev/shm or boot id here"),
]

SHM = Path("/dev/shm")


@pytest.fixture
async def server():
    started = await TinyServer().start()
    yield started
    await started.stop()


async def push(server: TinyServer, weights: dict[str, torch.Tensor], pool: InferencePool | None = None):
    """One sync of `weights` to `server` in 64 KiB buckets (most tensors of the tiny model span
    several, and the two buffers alternate), through `pool` or a pool of its own."""
    own = pool is None
    pool = pool or InferencePool([server.address], transport="auto", bucket_bytes=64 << 10)
    try:
        return await asyncio.to_thread(pool.push, lambda: iter(weights.items()), "step")
    finally:
        if own:
            pool.close()


async def test_a_cpu_server_on_this_machine_takes_the_weights_through_shared_memory_bit_for_bit(server):
    assert (await server.info()).weight_transports[0] == sharing.SHM
    weights = new_weights(server, seed=1)
    blocks_before = set(SHM.iterdir())
    result = await push(server, weights)
    assert result.transport == sharing.SHM
    assert result.bytes_sent == sum(t.numel() * t.element_size() for t in weights.values())
    parameters = server.parameters()
    for name, tensor in weights.items():
        assert torch.equal(parameters[name], tensor), name
    _, versions = await server.greedy()
    assert versions == {result.policy_version}
    assert set(SHM.iterdir()) <= blocks_before  # the trainer unlinked its blocks


async def shared_update(server: TinyServer, header: inference_pb2.SharedWeightsHeader) -> grpc.aio.AioRpcError:
    async def requests():
        yield inference_pb2.UpdateWeightsSharedRequest(header=header)

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in server.stub.UpdateWeightsShared(requests(), timeout=30):
            pass
    return raised.value


async def test_buffers_the_server_cannot_open_fail_cleanly_and_change_nothing(server):
    before = {name: t.clone() for name, t in server.parameters().items()}
    version = (await server.info()).policy_version
    missing = inference_pb2.SharedWeightsHeader(
        tensor_count=1, host_buffers=[inference_pb2.HostSharedBuffer(name="polar-no-such-block", size_bytes=1024)]
    )
    error = await shared_update(server, missing)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot open the trainer's shared memory 'polar-no-such-block'" in error.details()
    escaping = inference_pb2.SharedWeightsHeader(
        tensor_count=1, host_buffers=[inference_pb2.HostSharedBuffer(name="../etc/passwd", size_bytes=1)]
    )
    assert (await shared_update(server, escaping)).code() == grpc.StatusCode.INVALID_ARGUMENT
    gpu = inference_pb2.SharedWeightsHeader(
        tensor_count=1, buffers=[inference_pb2.CudaIpcBuffer(device=0, size_bytes=1)]
    )
    error = await shared_update(server, gpu)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot open CUDA buffers" in error.details()
    assert (await server.info()).policy_version == version
    for name, tensor in server.parameters().items():
        assert torch.equal(tensor, before[name]), name


async def test_a_server_that_cannot_open_the_blocks_gets_the_stream_in_that_sync_and_the_next(server, monkeypatch):
    """The same boot id but another /dev/shm (two containers of one host): the server refuses the
    blocks (FAILED_PRECONDITION), and the trainer sends the stream instead, without failing the sync."""

    def elsewhere(described):
        raise sharing.SharingUnavailable(f"cannot open the trainer's shared memory {described.name!r}")

    monkeypatch.setattr(sharing, "open_host_buffer", elsewhere)
    pool = InferencePool([server.address], transport="auto", bucket_bytes=64 << 10)
    try:
        for seed in (3, 4):
            weights = new_weights(server, seed=seed)
            result = await push(server, weights, pool)
            assert result.transport == sharing.STREAM
            parameters = server.parameters()
            assert all(torch.equal(parameters[name], tensor) for name, tensor in weights.items())
    finally:
        pool.close()


async def test_without_room_in_shared_memory_the_trainer_sends_the_stream(server, monkeypatch):
    """/dev/shm smaller than two blocks (64 MB in a default container): the blocks' pages are
    reserved when made, so that fails there, not as a SIGBUS mid-copy, and the stream goes instead."""

    def full(count, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharing, "HostBuffers", full)
    weights = new_weights(server, seed=5)
    result = await push(server, weights)
    assert result.transport == sharing.STREAM
    assert all(torch.equal(server.parameters()[name], tensor) for name, tensor in weights.items())
