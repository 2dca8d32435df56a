"""Reward bookkeeping: a session weighs the same however it is cut into traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.testing.trajectories import EVENTS, generate_session
from polar.trajectory import build, credit_traces, session_loss, token_share_weights
from polar.trajectory.rewards import token_weights, with_token_share_weights

sessions = st.builds(
    generate_session,
    events=st.lists(st.sampled_from(EVENTS), max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
weights = st.floats(0.0, 10.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=20), weights)
def test_shares_sum_to_the_session_weight(counts, session_weight):
    shares = token_share_weights(counts, session_weight)
    assert shares.shape == (len(counts),)
    assert np.all(shares >= 0)
    expected = session_weight if sum(counts) else 0.0
    assert shares.sum() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert all(share == 0 for share, count in zip(shares, counts) if count == 0)


@settings(max_examples=40, deadline=None)
@given(sessions, st.floats(-3.0, 3.0, allow_nan=False), weights, st.integers(0, 2**32 - 1))
def test_session_loss_does_not_depend_on_how_the_session_was_split(session, advantage, session_weight, seed):
    rng = np.random.default_rng(seed)
    # One loss value per sampled token, keyed by (call, offset in its sample): the same token has the
    # same loss whichever trace holds it.
    per_call = {c.call_id: rng.normal(size=len(c.sampled_ids)) for c in session.calls}
    losses = {}
    for builder in ("per_request", "prefix_merging"):
        traces = with_token_share_weights(build(builder, session.calls).traces, session_weight)
        token_losses = []
        for trace in traces:
            values = np.zeros(len(trace.token_ids))
            for segment in trace.segments:
                if segment.kind == 2:
                    values[segment.start : segment.end] = per_call[segment.call_id]
            token_losses.append(values)
        losses[builder] = session_loss(traces, token_losses)
        credits = credit_traces(traces, advantage, session_weight)
        assert {c.advantage for c in credits} <= {advantage}
        assert sum(c.weight for c in credits) == pytest.approx(session_weight if credits else 0.0)
        for trace in traces:
            per_token = token_weights(trace)
            assert np.all(per_token[trace.loss_mask == 0] == 0)
    every_token = np.concatenate([v for v in per_call.values()] or [np.zeros(0)])
    expected = session_weight * every_token.mean() if every_token.size else 0.0
    assert losses["per_request"] == pytest.approx(expected, abs=1e-9)
    assert losses["prefix_merging"] == pytest.approx(expected, abs=1e-9)


def test_a_short_side_trace_claims_only_its_share():
    session = generate_session(["sub_agent"], seed=3)
    traces = build("prefix_merging", session.calls).traces
    credits = credit_traces(traces, advantage=1.0)
    total = sum(t.trainable_tokens for t in traces)
    assert [c.weight for c in credits] == [t.trainable_tokens / total for t in traces]
    assert traces[1].fork_reason == "sub_agent" and credits[1].weight < credits[0].weight


def test_nothing_to_train_means_no_weight():
    assert token_share_weights([0, 0]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        token_share_weights([-1])
