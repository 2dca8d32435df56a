"""polar.codec: zstd frames round-trip, bounded decompression refuses bombs and damage, and a batch
framed from serialized trajectories is the TrajectoryBatch protobuf itself would write."""

from __future__ import annotations

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from polar import codec
from polar.v1 import common_pb2, inference_pb2

trajectories = st.builds(
    common_pb2.Trajectory,
    trajectory_id=st.text(max_size=20),
    reward=st.floats(allow_nan=False),
    outcome=st.sampled_from(list(common_pb2.SessionOutcome.values())),
    harness_output=st.text(max_size=300),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    traces=st.lists(
        st.builds(common_pb2.Trace, token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=200)), max_size=3
    ),
)


@given(st.binary(max_size=5000))
def test_compress_round_trips(data):
    assert codec.decompress(codec.compress(data), max_bytes=len(data)) == data


@given(st.lists(trajectories, max_size=6))
def test_batch_from_serialized_trajectories_equals_protobufs_own(items):
    # Deterministic: map entries are otherwise written in no fixed order.
    serialized = [t.SerializeToString(deterministic=True) for t in items]
    framed = codec.trajectory_batch(serialized)
    assert framed == common_pb2.TrajectoryBatch(trajectories=items).SerializeToString(deterministic=True)
    assert codec.read_trajectory_batch(codec.compress(framed)) == items


def test_batch_frames_a_trajectory_longer_than_one_varint_byte():
    big = common_pb2.Trajectory(harness_output="x" * 100_000)
    framed = codec.trajectory_batch([big.SerializeToString()])
    assert common_pb2.TrajectoryBatch.FromString(framed).trajectories[0] == big


def test_decompress_refuses_a_frame_declaring_more_than_the_limit():
    frame = codec.compress(b"\0" * 10_000)
    with pytest.raises(codec.CodecError, match="declares 10000 bytes, more than the limit of 9999"):
        codec.decompress(frame, max_bytes=9_999)


def test_decompress_refuses_a_streamed_frame_that_inflates_past_the_limit():
    # A streamed frame does not declare its size, so only decompressing can tell; it must stop early.
    compressor = zstandard.ZstdCompressor().compressobj()
    frame = compressor.compress(b"\0" * 1_000_000) + compressor.flush()
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(codec.CodecError, match="inflates past the limit of 1000 bytes"):
        codec.decompress(frame, max_bytes=1000)
    assert codec.decompress(frame, max_bytes=1_000_000) == b"\0" * 1_000_000


@pytest.mark.parametrize(
    "damaged, problem",
    [
        (b"", "not a zstd frame"),
        (b"not zstd at all", "not a zstd frame"),
        (codec.compress(b"hello world" * 50)[:-4], "corrupt or incomplete"),
        (codec.compress(b"one") + codec.compress(b"two"), "corrupt or incomplete"),
    ],
    ids=["empty", "garbage", "truncated", "two frames"],
)
def test_decompress_refuses_damaged_input(damaged, problem):
    with pytest.raises(codec.CodecError, match=problem):
        codec.decompress(damaged, max_bytes=1 << 20)


def test_read_trajectory_batch_refuses_bytes_that_are_not_a_batch():
    with pytest.raises(codec.CodecError, match="not a serialized TrajectoryBatch"):
        codec.read_trajectory_batch(codec.compress(b"\x0a\xff\xff\xff"))


TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40)


@given(pieces=st.lists(TOKEN_IDS, max_size=5))
def test_packed_ids_of_pieces_join_into_the_field_of_all_their_ids(pieces):
    joined = b"".join(codec.packed_ids(piece) for piece in pieces)
    everything = [token for piece in pieces for token in piece]
    assert joined == codec.packed_ids(everything)
    assert codec.unpacked_ids(joined) == tuple(everything)
    # The field a message parses, and the bytes protobuf itself writes for it.
    request = inference_pb2.GenerateRequest.FromString(codec.length_delimited(3, joined))
    assert list(request.prompt_token_ids) == everything
    assert request.SerializeToString() == (codec.length_delimited(3, joined) if everything else b"")
