"""The weight-sync stream the trainer writes by hand is byte for byte what protobuf would write."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from polar.inference.engines.base import ParameterSpec
from polar.inference.weights import WeightsAssembler
from polar.v1 import inference_pb2
from trainer import weight_sync
from trainer.weight_sync import chunk_message, tensor_messages


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


def test_the_stream_carries_every_tensor_exactly(monkeypatch) -> None:
    monkeypatch.setattr(weight_sync, "CHUNK_BYTES", 1000)  # several chunks per tensor
    tensors = {
        "a.weight": torch.randn(33, 17),
        "b.bias": torch.randn(5).to(torch.bfloat16),
        "c.empty": torch.zeros(0, 4),
    }
    specs = {name: ParameterSpec(tuple(t.shape), t.dtype) for name, t in tensors.items()}
    assembler = WeightsAssembler(specs)
    for message in tensor_messages(tensors.items(), note="step 1"):
        assembler.add(inference_pb2.UpdateWeightsRequest.FromString(message))
    assert assembler.note == "step 1"
    received = assembler.finish()
    assert received.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
