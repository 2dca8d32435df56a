"""WeightsReceiver: chunked tensors are rebuilt exactly from the serialized messages; bad or incomplete
streams yield nothing; the wire reader reads what protobuf reads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.inference.engines.base import ParameterSpec, WeightUpdateError
from polar.inference.weights import Chunk, Header, Staging, WeightsReceiver, parse_update_request
from polar.v1 import inference_pb2

SPECS = {
    "embed.weight": ParameterSpec((4, 3), torch.float32),
    "norm.weight": ParameterSpec((5,), torch.float32),
    "half.weight": ParameterSpec((2, 2), torch.bfloat16),
}


def header(count: int, note: str = "") -> bytes:
    return inference_pb2.UpdateWeightsRequest(
        header=inference_pb2.WeightsHeader(tensor_count=count, note=note)
    ).SerializeToString()


def chunk(name, data, offset=0, dtype="float32", shape=None) -> bytes:
    shape = SPECS[name].shape if shape is None else shape
    return inference_pb2.UpdateWeightsRequest(
        chunk=inference_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset, data=data)
    ).SerializeToString()


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def assemble(messages) -> dict[str, torch.Tensor]:
    assembler = WeightsReceiver(SPECS, Staging())
    for message in messages:
        assembler.add(message)
    return assembler.finish()


def test_whole_tensors_round_trip_and_convert_to_the_parameter_dtype():
    embed = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    half = torch.tensor([[1.5, -2.0], [0.25, 8.0]], dtype=torch.float16)
    assembler = WeightsReceiver(SPECS, Staging())
    for message in (
        header(2, note="step 7"),
        chunk("embed.weight", raw(embed)),
        chunk("half.weight", raw(half), dtype="float16"),
    ):
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
    assembler = WeightsReceiver(SPECS, Staging())
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
        ([b""], ["neither a header nor a chunk"]),
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
    assembler = WeightsReceiver(SPECS, Staging())
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
    assembler = WeightsReceiver(SPECS, Staging())
    for message in messages:
        assembler.add(message)
    with pytest.raises(WeightUpdateError) as caught:
        assembler.finish()
    for fragment in fragments:
        assert fragment in str(caught.value)


_CHUNKS = st.builds(
    inference_pb2.TensorChunk,
    name=st.text(max_size=20),
    dtype=st.sampled_from(["float32", "bfloat16", ""]),
    shape=st.lists(st.integers(0, 2**40), max_size=4),
    offset=st.integers(-(2**62), 2**62),
    data=st.binary(max_size=64),
)
_HEADERS = st.builds(
    inference_pb2.WeightsHeader,
    tensor_count=st.integers(-(2**31), 2**31 - 1),
    note=st.text(max_size=20),
    update_id=st.text(max_size=10),
)


@settings(max_examples=300, deadline=None)
@given(
    payload=st.one_of(
        _CHUNKS.map(lambda c: inference_pb2.UpdateWeightsRequest(chunk=c)),
        _HEADERS.map(lambda h: inference_pb2.UpdateWeightsRequest(header=h)),
    ),
    unknown=st.binary(max_size=8).map(lambda b: bytes([15 << 3 | 2, len(b)]) + b),  # field 15, length-delimited
    split_data=st.booleans(),
)
def test_the_wire_reader_reads_what_protobuf_reads(payload, unknown, split_data):
    """Any message protobuf writes, with an unknown field added and (for a chunk) data given twice,
    of which protobuf keeps the last: the reader sees the same fields, data as a slice."""
    raw = payload.SerializeToString() + unknown
    if split_data and payload.WhichOneof("payload") == "chunk":
        # The chunk again, merged by protobuf into the first: the second data wins, shape appends.
        raw += payload.SerializeToString()
    expected = inference_pb2.UpdateWeightsRequest.FromString(raw)
    got = parse_update_request(raw)
    if expected.WhichOneof("payload") == "header":
        h = expected.header
        assert got == Header(h.tensor_count, h.note, h.update_id)
    else:
        c = expected.chunk
        assert isinstance(got, Chunk)
        assert (got.name, got.dtype, got.shape, got.offset, bytes(got.data)) == (
            c.name,
            c.dtype,
            tuple(c.shape),
            c.offset,
            c.data,
        )


def test_a_chunk_s_data_is_read_in_place():
    raw = chunk("norm.weight", bytes(range(20)))
    got = parse_update_request(raw)
    assert got.data.obj is raw  # a view of the received message, not a copy


@pytest.mark.parametrize("raw", [b"\x12\x05ab", b"\x12", b"\x0b", b"\x00\x01"])
def test_malformed_messages_are_refused_with_a_reason(raw):
    with pytest.raises(WeightUpdateError, match="not valid protobuf|wire type"):
        parse_update_request(raw)


def test_staged_buffers_are_reused_and_swapped_back():
    staging = Staging()
    first = WeightsReceiver(SPECS, staging)
    first.add(header(1))
    first.add(chunk("norm.weight", raw(torch.arange(5, dtype=torch.float32))))
    staged = first.finish()["norm.weight"]
    replaced = torch.zeros(5)
    staging.put_back({"norm.weight": replaced})  # what an engine that swapped gives back
    second = WeightsReceiver(SPECS, staging)
    second.add(header(1))
    second.add(chunk("norm.weight", raw(torch.ones(5))))
    again = second.finish()["norm.weight"]
    assert again.data_ptr() == replaced.data_ptr() and torch.equal(again, torch.ones(5))
    assert torch.equal(staged, torch.arange(5, dtype=torch.float32))  # the first one's memory untouched
