"""Property tests of both builders over generated sessions (polar.testing.trajectories)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.testing.trajectories import EVENTS, generate_session
from polar.trajectory import build, verify

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sessions = st.builds(
    generate_session,
    events=st.lists(st.sampled_from(EVENTS), max_size=10),
    seed=st.integers(0, 2**32 - 1),
    end_aborted=st.booleans(),
)
linear_sessions = st.builds(
    generate_session,
    events=st.lists(st.sampled_from(("turn", "truncated")), max_size=12),
    seed=st.integers(0, 2**32 - 1),
    end_aborted=st.booleans(),
)


def distinct_tokens(sequences: list[np.ndarray]) -> int:
    """Nodes of the prefix tree of ``sequences``: tokens counted once per distinct context."""
    ordered = sorted(tuple(s.tolist()) for s in sequences)
    total, previous = 0, ()
    for sequence in ordered:
        shared = 0
        for a, b in zip(sequence, previous):
            if a != b:
                break
            shared += 1
        total += len(sequence) - shared
        previous = sequence
    return total


@SETTINGS
@given(sessions)
def test_every_trace_of_both_builders_verifies(session):
    for builder in ("per_request", "prefix_merging"):
        report = verify(session.calls, build(builder, session.calls).traces)
        assert report.ok, report.render()
        assert report.sampled_tokens == sum(len(c.sampled_ids) for c in session.calls)


@SETTINGS
@given(sessions)
def test_merged_traces_hold_each_sampled_token_once(session):
    traces = build("prefix_merging", session.calls).traces
    sampled_segments = Counter(s.call_id for t in traces for s in t.segments if s.kind == 2)
    with_samples = {c.call_id for c in session.calls if len(c.sampled_ids)}
    assert set(sampled_segments) == with_samples
    assert set(sampled_segments.values()) <= {1}
    assert sum(t.trainable_tokens for t in traces) == sum(len(c.sampled_ids) for c in session.calls)


@SETTINGS
@given(linear_sessions)
def test_a_conversation_without_forks_merges_into_one_trace_of_its_distinct_tokens(session):
    result = build("prefix_merging", session.calls)
    sequences = [np.concatenate((c.prompt_ids, c.sampled_ids)) for c in session.calls if len(c.sampled_ids)]
    assert result.stats.chains == 1
    assert result.stats.forks == {}
    assert result.stats.tokens_after == distinct_tokens(sequences)


@SETTINGS
@given(sessions)
def test_each_merged_trace_is_the_distinct_tokens_of_its_calls(session):
    by_id = {c.call_id: c for c in session.calls}
    for trace in build("prefix_merging", session.calls).traces:
        sequences = []
        for segment in trace.segments:
            call = by_id[segment.call_id]
            if segment.kind == 2:
                sequences.append(np.concatenate((call.prompt_ids, call.sampled_ids)))
            else:
                sequences.append(call.prompt_ids)
        assert len(trace.token_ids) == distinct_tokens(sequences)


@SETTINGS
@given(sessions)
def test_prefix_merging_never_trains_more_tokens_than_per_request(session):
    per_request = build("per_request", session.calls)
    merged = build("prefix_merging", session.calls)
    assert per_request.stats.tokens_after == per_request.stats.tokens_before
    assert merged.stats.tokens_before == per_request.stats.tokens_before
    assert merged.stats.tokens_after <= per_request.stats.tokens_after
    assert merged.stats.chains <= per_request.stats.chains
    assert sum(t.trainable_tokens for t in merged.traces) == sum(t.trainable_tokens for t in per_request.traces)
    assert merged.stats.calls == per_request.stats.calls == len(session.calls)


@SETTINGS
@given(sessions)
def test_fork_reasons_are_the_designed_ones(session):
    result = build("prefix_merging", session.calls)
    forks = {t.segments[0].call_id: t.fork_reason for t in result.traces if t.fork_reason}
    assert forks == dict(session.expected_forks)
    assert dict(result.stats.forks) == dict(Counter(session.expected_forks.values()))
    assert result.traces[0].fork_reason == ""


@SETTINGS
@given(sessions)
def test_trace_weights_are_shares_of_trainable_tokens(session):
    for builder in ("per_request", "prefix_merging"):
        traces = build(builder, session.calls).traces
        total = sum(t.trainable_tokens for t in traces)
        assert abs(sum(t.weight for t in traces) - 1.0) < 1e-9
        for trace in traces:
            assert trace.weight == trace.trainable_tokens / total


@SETTINGS
@given(sessions)
def test_segments_carry_their_call_s_sampling_and_truncation_reaches_exactly_the_traces_holding_it(session):
    calls = {call.call_id: call for call in session.calls}
    for builder in ("per_request", "prefix_merging"):
        for trace in build(builder, session.calls).traces:
            sampled = [calls[s.call_id] for s in trace.segments if s.kind == 2]
            assert [s.sampling for s in trace.segments if s.kind == 2] == [c.sampling for c in sampled]
            assert trace.truncated == any(c.truncated for c in sampled)
    truncated_calls = sum(c.truncated for c in session.calls if len(c.sampled_ids))
    assert sum(t.truncated for t in build("per_request", session.calls).traces) == truncated_calls
