"""The collective transport's protocol on a CPU (gloo), without gRPC: the trainer's buckets broadcast
over a real process group (a real TCPStore rendezvous, ranks on threads of this process) land in
every server's staged tensors bit for bit, for any tensors and bucket size; a member that leaves
mid-update fails the others within the timeout instead of hanging them."""

from __future__ import annotations

import functools
import queue
import threading
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.inference import collective
from polar.inference.engines.base import ParameterSpec
from polar.inference.weights import Header, Staging, WeightsReceiver, byte_view
from polar.v1 import inference_pb2
from trainer.weight_collective import broadcast_buckets

pytestmark = pytest.mark.skipif(not collective.transports("cpu"), reason="this torch has no gloo")

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@functools.cache
def _store() -> collective.dist.TCPStore:
    return collective.open_store(timeout_s=30)


def _header(rank: int, world_size: int, group_id: str, bucket_bytes: int, tensor_count: int, timeout_s: float = 30):
    return inference_pb2.CollectiveWeightsHeader(
        tensor_count=tensor_count,
        backend="gloo",
        rendezvous=f"127.0.0.1:{_store().port}",
        group_id=group_id,
        world_size=world_size,
        rank=rank,
        bucket_bytes=bucket_bytes,
        buffer_count=2,
        timeout_seconds=timeout_s,
    )


class _Server(threading.Thread):
    """A server's side of one update: join, then receive each bucket announced on `inbox`."""

    def __init__(self, header: inference_pb2.CollectiveWeightsHeader, specs: dict[str, ParameterSpec]) -> None:
        super().__init__(daemon=True)
        self.header = header
        self.inbox: queue.Queue = queue.Queue()
        self.receiver = WeightsReceiver(specs, Staging())
        self.receiver.header(Header(header.tensor_count))
        self.received: dict[str, torch.Tensor] | None = None
        self.error: BaseException | None = None
        self.group: collective.Group | None = None

    def run(self) -> None:
        try:
            buffers = [
                torch.empty(self.header.bucket_bytes, dtype=torch.uint8) for _ in range(self.header.buffer_count)
            ]
            membership = collective.Membership(self.header)
            membership.join(self.header, torch.device("cpu"))  # on this thread, which also runs every broadcast
            self.group = membership.group
            while (bucket := self.inbox.get()) is not None:
                collective.receive_bucket(self.group, bucket, self.receiver, buffers)
            self.received = self.receiver.finish()
        except BaseException as exc:
            self.error = exc
        finally:
            if self.group is not None:
                self.group.close()


def _trainer_group(world_size: int, group_id: str, timeout_s: float = 30) -> collective.Group:
    members = collective.group_store(_store(), group_id)
    deadline = time.monotonic() + timeout_s
    while not collective.ready(members, range(1, world_size), 0):
        assert time.monotonic() < deadline, "the servers never joined"
        time.sleep(0.005)
    return collective.Group("gloo", members, 0, world_size, torch.device("cpu"), "127.0.0.1", timeout_s)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 30), max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6),
    bucket_bytes=st.integers(256, 3000),
    servers=st.integers(1, 2),
    seed=st.integers(0, 2**31),
)
def test_every_server_stages_the_trainer_s_tensors_bit_for_bit(shapes, dtypes, bucket_bytes, servers, seed):
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}.weight": torch.randn(shape, generator=generator).to(dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
    }
    expected = {name: t.float() if t.dtype == torch.float64 else t for name, t in tensors.items()}
    specs = {name: ParameterSpec(tuple(t.shape), t.dtype) for name, t in expected.items()}
    group_id = uuid.uuid4().hex
    members = [
        _Server(_header(rank, servers + 1, group_id, bucket_bytes, len(tensors)), specs)
        for rank in range(1, servers + 1)
    ]
    for member in members:
        member.start()
    group = _trainer_group(servers + 1, group_id)
    buffers = [torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8) for _ in range(2)]
    announced = []

    def announce(bucket):
        announced.append(bucket.buffer)
        for member in members:
            member.inbox.put(bucket)

    try:
        broadcast_buckets(tensors.items(), group, buffers, announce)
    finally:
        for member in members:
            member.inbox.put(None)
            member.join(30)
        group.close()
    assert all(b in (0, 1) for b in announced)
    for member in members:
        assert member.error is None, member.error
        for name, tensor in expected.items():
            assert member.received[name].dtype == tensor.dtype, name
            assert torch.equal(byte_view(member.received[name]), byte_view(tensor)), name


def test_a_member_that_leaves_mid_update_fails_the_trainer_and_the_other_member_within_the_groups_timeout():
    tensors = {f"t{i}.weight": torch.randn(64, 64) for i in range(8)}  # 16 KiB each: 8 buckets of 16 KiB
    specs = {name: ParameterSpec((64, 64), torch.float32) for name in tensors}
    group_id = uuid.uuid4().hex
    timeout_s = 20.0
    staying, leaving = (_Server(_header(rank, 3, group_id, 1 << 14, len(tensors), timeout_s), specs) for rank in (1, 2))
    staying.start()
    leaving.start()
    group = _trainer_group(3, group_id)
    buffers = [torch.empty(1 << 14, dtype=torch.uint8) for _ in range(2)]
    announced = 0

    def announce(bucket):
        nonlocal announced
        announced += 1
        staying.inbox.put(bucket)
        if announced == 3:
            leaving.inbox.put(None)  # it stops early: finish() fails and it leaves the group
        elif announced < 3:
            leaving.inbox.put(bucket)

    started = time.monotonic()
    with pytest.raises(collective.CollectiveFailed) as caught:
        broadcast_buckets(tensors.items(), group, buffers, announce)
    failed_after = time.monotonic() - started
    group.close()
    staying.inbox.put(None)
    # Gloo may notice the departure only when a wait times out (its abort leaves connections open),
    # so the bound is the group's timeout, with room for the threads to wind down: nothing hangs.
    staying.join(timeout_s + 10)
    leaving.join(timeout_s + 10)
    assert failed_after < timeout_s + 5, f"the trainer failed only after {failed_after:.1f} s"
    assert not staying.is_alive() and not leaving.is_alive(), "a member still waits"
    assert "gloo broadcast failed" in str(caught.value)
    assert leaving.error is not None and "before every tensor was complete" in str(leaving.error)
    assert staying.error is not None and staying.received is None  # its update incomplete, nothing staged
