"""The verifier catches every kind of unfaithful trace, and session files round-trip through it."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.testing.trajectories import EVENTS, generate_session
from polar.trajectory import (
    Segment,
    SegmentKind,
    SessionFileError,
    VerificationError,
    build,
    read_session,
    session_trajectory,
    verify,
    verify_command,
    verify_file,
    verify_or_raise,
    write_session,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CORRUPTIONS = ("mask_off", "mask_on", "token", "logprob", "context", "version")


def _with(trace, **arrays):
    return replace(trace, **{k: np.array(v) for k, v in arrays.items()})


def corrupt(trace, kind, draw):
    """A copy of ``trace`` with one corruption of ``kind`` at a drawn position."""
    sampled = [s for s in trace.segments if s.kind == SegmentKind.SAMPLED]
    span = draw(st.sampled_from(sampled))
    at = draw(st.integers(span.start, span.end - 1))
    mask, tokens, logprobs = trace.loss_mask.copy(), trace.token_ids.copy(), trace.logprobs.copy()
    if kind == "mask_off":
        mask[at] = 0
        return _with(trace, loss_mask=mask)
    if kind == "token":
        tokens[at] += 1
        return _with(trace, token_ids=tokens)
    if kind == "logprob":
        logprobs[at] = np.nextafter(logprobs[at], np.float32(0))
        return _with(trace, logprobs=logprobs)
    if kind == "version":
        versions = list(trace.policy_versions)
        versions[sampled.index(span)] += 1
        return replace(trace, policy_versions=tuple(versions))
    prompt_positions = np.flatnonzero(trace.loss_mask == 0)
    before = prompt_positions[prompt_positions < span.start]
    at = int(draw(st.sampled_from(before.tolist())))
    if kind == "mask_on":
        mask[at] = 1
        return _with(trace, loss_mask=mask)
    tokens[at] += 1  # "context": a token the engine was given, not sampled
    return _with(trace, token_ids=tokens)


@SETTINGS
@given(
    st.lists(st.sampled_from(EVENTS), max_size=6),
    st.integers(0, 2**32 - 1),
    st.sampled_from(("per_request", "prefix_merging")),
    st.sampled_from(CORRUPTIONS),
    st.data(),
)
def test_every_corruption_is_caught(events, seed, builder, kind, data):
    session = generate_session(events, seed)
    traces = list(build(builder, session.calls).traces)
    index = data.draw(st.integers(0, len(traces) - 1))
    traces[index] = corrupt(traces[index], kind, data.draw)
    report = verify(session.calls, traces)
    assert not report.ok
    assert any(p.trace_id == traces[index].trace_id for p in report.problems), report.render()


def _session():
    session = generate_session(["turn", "sub_agent", "aborted", "parallel"], seed=7)
    return session.calls, list(build("prefix_merging", session.calls).traces)


def test_missing_and_duplicated_samples_are_named_by_call():
    calls, traces = _session()
    dropped = traces.pop(1)
    report = verify(calls, traces)
    missing = {p.call_id for p in report.problems if "appear in no trace" in p.message}
    assert missing == {s.call_id for s in dropped.segments if s.kind == SegmentKind.SAMPLED}
    traces.insert(1, dropped)
    traces.append(replace(dropped, trace_id="copy"))
    report = verify(calls, traces)
    assert any("appear 2 times" in p.message for p in report.problems)


def test_broken_segments_lengths_and_weights_are_reported():
    calls, traces = _session()
    first = traces[0]
    gap = replace(first, segments=(replace(first.segments[0], end=first.segments[0].end - 1), *first.segments[1:]))
    assert "does not continue" in verify(calls, [gap, *traces[1:]]).render()
    short = replace(first, loss_mask=first.loss_mask[:-1])
    assert "mask entries" in verify(calls, [short, *traces[1:]]).render()
    unknown = Segment(SegmentKind.PROMPT, 0, first.segments[0].end, "nobody")
    stranger = replace(first, segments=(unknown, *first.segments[1:]))
    assert "not in the session" in verify(calls, [stranger, *traces[1:]]).render()
    heavy = replace(first, weight=first.weight + 0.5)
    assert "weights sum to" in verify(calls, [heavy, *traces[1:]]).render()


def test_raising_variant_lists_problems_with_trace_position_and_call():
    calls, traces = _session()
    tokens = traces[0].token_ids.copy()
    position = int(np.flatnonzero(traces[0].loss_mask)[0])
    tokens[position] += 1
    with pytest.raises(VerificationError, match=rf"trace t0, position {position}, call c0001: sampled span"):
        verify_or_raise(calls, [replace(traces[0], token_ids=tokens), *traces[1:]])


@pytest.mark.parametrize("name", ["session.json", "session.pb", "session.binpb.zst", "session.json.zst"])
def test_session_files_round_trip_and_verify(tmp_path, name):
    calls, traces = _session()
    result = build("prefix_merging", calls)
    path = tmp_path / name
    write_session(path, session_trajectory(calls, result, session_id="s1"))
    stored_calls, stored_traces = read_session(path)
    assert [c.call_id for c in stored_calls] == [c.call_id for c in calls]
    assert verify_file(path).ok
    out = io.StringIO()
    assert verify_command(path, out) == 0
    assert f"ok: {len(traces)} traces" in out.getvalue()


def test_verify_command_exit_status_for_unfaithful_and_unreadable_files(tmp_path):
    calls, traces = _session()
    result = build("prefix_merging", calls)
    trajectory = session_trajectory(calls, result)
    trajectory.traces[0].behaviour_logprobs[int(np.flatnonzero(traces[0].loss_mask)[0])] += 1.0
    path = tmp_path / "bad.pb"
    write_session(path, trajectory)
    out = io.StringIO()
    assert verify_command(path, out) == 1
    assert "FAILED" in out.getvalue() and "behaviour logprob differs" in out.getvalue()
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert verify_command(garbage, io.StringIO()) == 2
    with pytest.raises(SessionFileError, match="unknown session file suffix"):
        read_session(tmp_path / "session.txt")
