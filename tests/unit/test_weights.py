"""WeightsAssembler: chunked tensors are rebuilt exactly; bad or incomplete streams yield nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.inference.engines.base import ParameterSpec, WeightUpdateError
from polar.inference.weights import WeightsAssembler
from polar.v1 import inference_pb2

SPECS = {
    "embed.weight": ParameterSpec((4, 3), torch.float32),
    "norm.weight": ParameterSpec((5,), torch.float32),
    "half.weight": ParameterSpec((2, 2), torch.bfloat16),
}


def header(count: int, note: str = "") -> inference_pb2.UpdateWeightsRequest:
    return inference_pb2.UpdateWeightsRequest(header=inference_pb2.WeightsHeader(tensor_count=count, note=note))


def chunk(name, data, offset=0, dtype="float32", shape=None) -> inference_pb2.UpdateWeightsRequest:
    shape = SPECS[name].shape if shape is None else shape
    return inference_pb2.UpdateWeightsRequest(
        chunk=inference_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset, data=data)
    )


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def assemble(messages) -> dict[str, torch.Tensor]:
    assembler = WeightsAssembler(SPECS)
    for message in messages:
        assembler.add(message)
    return assembler.finish()


def test_whole_tensors_round_trip_and_convert_to_the_parameter_dtype():
    embed = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    half = torch.tensor([[1.5, -2.0], [0.25, 8.0]], dtype=torch.float16)
    assembler = WeightsAssembler(SPECS)
    for message in (header(2, note="step 7"), chunk("embed.weight", raw(embed)), chunk("half.weight", raw(half), dtype="float16")):
        assembler.add(message)
    got = assembler.finish()
    assert assembler.note == "step 7"
    assert assembler.bytes_received == 48 + 8
    assert torch.equal(got["embed.weight"], embed)
    assert got["half.weight"].dtype == torch.bfloat16
    assert torch.equal(got["half.weight"], half.to(torch.bfloat16))


def test_bfloat16_on_the_wire():
    norm = torch.tensor([1.0, 2.0, 3.0, -0.5, 0.125], dtype=torch.bfloat16)
    got = assemble([header(1), chunk("norm.weight", raw(norm), dtype="bfloat16")])
    assert torch.equal(got["norm.weight"], norm.to(torch.float32))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_chunking_in_any_order_rebuilds_the_tensor(data):
    values = torch.tensor(data.draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=12, max_size=12)))
    buffer = raw(values.reshape(4, 3))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(buffer) - 1), max_size=10)))
    bounds = list(zip([0, *cuts], [*cuts, len(buffer)], strict=True))
    order = data.draw(st.permutations(bounds))
    got = assemble([header(1)] + [chunk("embed.weight", buffer[a:b], offset=a) for a, b in order])
    assert torch.equal(got["embed.weight"], values.reshape(4, 3))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_gap_or_overlap_is_refused(data):
    """Random byte ranges: accepted exactly when they tile the buffer without overlap."""
    size = 48
    ranges = data.draw(
        st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, size)), min_size=1, max_size=8).map(
            lambda pairs: [(a, min(a + n, size)) for a, n in pairs]
        )
    )
    buffer = bytes(range(size))
    assembler = WeightsAssembler(SPECS)
    assembler.add(header(1))
    covered: set[int] = set()
    try:
        for a, b in ranges:
            assembler.add(chunk("embed.weight", buffer[a:b], offset=a))
            assert covered.isdisjoint(range(a, b))
            covered.update(range(a, b))
        assembler.finish()
    except WeightUpdateError:
        tiles = sum(b - a for a, b in ranges) == size and len(set().union(*(range(a, b) for a, b in ranges))) == size
        assert not tiles
    else:
        assert covered == set(range(size))


@pytest.mark.parametrize(
    ("messages", "fragments"),
    [
        ([chunk("norm.weight", bytes(20))], ["before the header"]),
        ([header(0)], ["tensor_count = 0"]),
        ([header(1), header(1)], ["second header"]),
        ([inference_pb2.UpdateWeightsRequest()], ["neither a header nor a chunk"]),
        ([header(1), chunk("lm_head.weight", bytes(20), shape=(5,))], ["unknown parameter", "'lm_head.weight'"]),
        ([header(1), chunk("norm.weight", bytes(24), shape=(6,))], ["'norm.weight'", "[6]", "[5]"]),
        ([header(1), chunk("norm.weight", bytes(40), dtype="float64")], ["'norm.weight'", "'float64'"]),
        ([header(1), chunk("norm.weight", bytes(24))], ["'norm.weight'", "[0, 24)", "20 bytes"]),
        ([header(1), chunk("norm.weight", bytes(4), offset=-4)], ["'norm.weight'", "[-4, 0)"]),
        ([header(1), chunk("norm.weight", b"", offset=4)], ["'norm.weight'", "no data"]),
        (
            [header(1), chunk("norm.weight", bytes(8)), chunk("norm.weight", bytes(8), offset=4)],
            ["'norm.weight'", "overlap", "[4, 12)"],
        ),
        (
            [header(1), chunk("norm.weight", bytes(8)), chunk("norm.weight", bytes(4), offset=8, dtype="float16")],
            ["'norm.weight'", "'float16'", "'float32'"],
        ),
        (
            [header(1), chunk("norm.weight", bytes(20)), chunk("embed.weight", bytes(48))],
            ["'embed.weight'", "tensor_count = 1"],
        ),
    ],
)
def test_bad_chunks_fail_as_they_arrive(messages, fragments):
    assembler = WeightsAssembler(SPECS)
    for message in messages[:-1]:
        assembler.add(message)
    with pytest.raises(WeightUpdateError) as caught:
        assembler.add(messages[-1])
    for fragment in fragments:
        assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("messages", "fragments"),
    [
        ([], ["without a header"]),
        ([header(2), chunk("norm.weight", bytes(20))], ["tensor_count = 2", "1 arrived"]),
        ([header(1), chunk("norm.weight", bytes(8))], ["'norm.weight' (8 of 20 bytes)"]),
    ],
)
def test_a_stream_that_ends_early_yields_nothing(messages, fragments):
    assembler = WeightsAssembler(SPECS)
    for message in messages:
        assembler.add(message)
    with pytest.raises(WeightUpdateError) as caught:
        assembler.finish()
    for fragment in fragments:
        assert fragment in str(caught.value)
