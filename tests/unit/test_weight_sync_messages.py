"""The weight-sync stream the trainer writes by hand is byte for byte what protobuf would write, and
what the server stages from it is the trainer's tensors bit for bit; so is what it stages from the
buckets of the CUDA IPC transport."""

from __future__ import annotations

import queue

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.inference.engines.base import ParameterSpec
from polar.inference.weights import Header, Staging, WeightsReceiver, byte_view
from polar.v1 import inference_pb2
from trainer import weight_sync
from trainer.weight_sync import bucket_messages, chunk_message, tensor_messages


@given(
    name=st.text(max_size=40),
    shape=st.lists(st.integers(0, 2**40), max_size=4),
    offset=st.integers(0, 2**50),
    data=st.binary(max_size=300),
)
def test_a_chunk_serializes_as_protobuf_would(name, shape, offset, data) -> None:
    expected = inference_pb2.UpdateWeightsRequest(
        chunk=inference_pb2.TensorChunk(name=name, dtype="float32", shape=shape, offset=offset, data=data)
    ).SerializeToString()
    assert chunk_message(name, "float32", shape, offset, memoryview(data)) == expected


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), max_size=3), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from(_DTYPES), min_size=5, max_size=5),
    chunk_bytes=st.integers(1, 600),
    seed=st.integers(0, 2**31),
)
def test_the_stream_path_s_bytes_equal_the_tensors(shapes, dtypes, chunk_bytes, seed):
    """Any tensors, any chunk size (splitting elements too): what the server stages from the
    serialized stream is the trainer's tensors bit for bit (float64, not a wire dtype, as float32)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}.weight": torch.randn(shape, generator=generator).to(dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
    }
    expected = {name: t.float() if t.dtype == torch.float64 else t for name, t in tensors.items()}
    specs = {name: ParameterSpec(tuple(t.shape), t.dtype) for name, t in expected.items()}
    receiver = WeightsReceiver(specs, Staging())
    previous = weight_sync.CHUNK_BYTES
    weight_sync.CHUNK_BYTES = chunk_bytes
    try:
        for message in tensor_messages(tensors.items(), note="step 1", update_id="u1"):
            receiver.add(message)
    finally:
        weight_sync.CHUNK_BYTES = previous
    assert (receiver.note, receiver.update_id) == ("step 1", "u1")
    received = receiver.finish()
    assert received.keys() == tensors.keys()
    assert receiver.bytes_received == sum(t.numel() * t.element_size() for t in expected.values())
    for name, tensor in expected.items():
        assert received[name].dtype == tensor.dtype, name
        assert torch.equal(byte_view(received[name]), byte_view(tensor)), name  # bits, NaNs included


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 30), max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6),
    bucket_bytes=st.integers(256, 3000),
    seed=st.integers(0, 2**31),
)
def test_buckets_carry_every_tensor_exactly_through_two_buffers(shapes, dtypes, bucket_bytes, seed):
    """The CUDA IPC transport's packing (run here over CPU buffers): any tensors, any bucket size
    (tensors larger than a bucket split over several); every piece lies inside its buffer, no two
    pieces of a bucket overlap, and the server's receiver rebuilds the tensors bit for bit while
    the two buffers are handed back and forth."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}.weight": torch.randn(shape, generator=generator).to(dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
    }
    expected = {name: t.float() if t.dtype == torch.float64 else t for name, t in tensors.items()}
    specs = {name: ParameterSpec(tuple(t.shape), t.dtype) for name, t in expected.items()}
    receiver = WeightsReceiver(specs, Staging())
    receiver.header(Header(len(tensors)))
    buffers = [torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8) for _ in range(2)]
    free: queue.Queue = queue.Queue()
    free.put(0)
    free.put(1)
    for message in bucket_messages(tensors.items(), buffers, free):
        bucket = message.bucket
        taken: list[tuple[int, int]] = []
        for piece in bucket.tensors:
            start, end = piece.offset, piece.offset + piece.size_bytes
            assert 0 <= start <= end <= bucket_bytes
            assert all(end <= a or b <= start for a, b in taken)
            taken.append((start, end))
            receiver.piece(
                piece.name, piece.dtype, tuple(piece.shape), piece.tensor_offset, buffers[bucket.buffer][start:end]
            )
        buffers[bucket.buffer].fill_(0xCD)  # the trainer may now overwrite it: nothing may read it later
        free.put(bucket.buffer)
    received = receiver.finish()
    for name, tensor in expected.items():
        assert torch.equal(byte_view(received[name]), byte_view(tensor)), name
