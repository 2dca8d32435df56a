"""Unit tests of the builders on small hand-written sessions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from polar.trajectory import (
    BUILDERS,
    CallView,
    InvalidCallError,
    MergeStats,
    UnknownBuilderError,
    build,
    verify,
    verify_or_raise,
)
from polar.trajectory.records import BuiltTrace, SamplingParams, SegmentKind, views_from_protos
from polar.v1 import common_pb2

STOP, LENGTH, ABORTED = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORTED,
)
END = 2  # end-of-turn id in these sessions


def call(call_id, prompt, sampled, finish=STOP, aborted=False, version=0):
    logprobs = [-0.1 * (i + 1) for i in range(len(sampled))]
    return CallView(call_id, prompt, sampled, logprobs, finish, aborted, policy_version=version)


def merged(calls):
    result = build("prefix_merging", calls)
    verify_or_raise(calls, result.traces)
    return result


def test_stopped_and_cut_responses_both_merge_into_one_trace():
    system = [1, 10, 11, 2, 3, 1, 6, 3]
    stopped = call("c1", system, [20, 21, END], version=3)
    # Cut at max tokens: no end-of-turn in the sample; the next prompt closes the turn itself.
    cut = call("c2", [*system, 20, 21, END, 3, 1, 7, 30, 2, 3, 1, 6, 3], [40, 41], LENGTH, version=4)
    after_cut = call("c3", [*cut.prompt_ids, 40, 41, END, 3, 1, 7, 31, 2, 3, 1, 6, 3], [50, END], version=4)
    result = merged([stopped, cut, after_cut])
    (trace,) = result.traces
    np.testing.assert_array_equal(trace.token_ids, np.concatenate((after_cut.prompt_ids, [50, END])))
    sampled_at = np.flatnonzero(trace.loss_mask).tolist()
    assert sampled_at == [8, 9, 10, 20, 21, 32, 33]
    # The end-of-turn token the engine sampled is trained on; the one the gateway added after the cut is not.
    assert trace.token_ids[10] == END and trace.loss_mask[10] == 1
    assert trace.token_ids[22] == END and trace.loss_mask[22] == 0
    assert trace.policy_versions == (3, 4, 4)
    assert [(s.kind, s.start, s.end, s.call_id) for s in trace.segments] == [
        (1, 0, 8, "c1"),
        (2, 8, 11, "c1"),
        (1, 11, 20, "c2"),
        (2, 20, 22, "c2"),
        (1, 22, 32, "c3"),
        (2, 32, 34, "c3"),
    ]
    assert result.stats == MergeStats(calls=3, chains=1, tokens_before=11 + 22 + 34, tokens_after=34, forks={})


def test_longest_matching_chain_wins():
    a = call("c1", [5, 6], [7, END])
    b = call("c2", [5, 6, 7, END, 8], [9, END])  # extends a
    c = call("c3", [5, 6], [7])  # a's prompt again: a second chain whose tip is [5, 6, 7]
    d = call("c4", [5, 6, 7, END, 8, 9, END, 10], [11])  # extends both tips; b's is the longer
    result = merged([a, b, c, d])
    assert [s.call_id for s in result.traces[0].segments if s.kind == 2] == ["c1", "c2", "c4"]
    assert [s.call_id for s in result.traces[1].segments if s.kind == 2] == ["c3"]


def test_aborted_call_is_split_off_when_its_retry_joins_the_chain():
    first = call("c1", [5, 6], [7, END])
    dropped = call("c2", [5, 6, 7, END, 8], [30, 31], ABORTED, aborted=True)
    retry = call("c3", [5, 6, 7, END, 8], [40, END])
    result = merged([first, dropped, retry])
    assert [t.fork_reason for t in result.traces] == ["", "aborted_call"]
    main, sibling = result.traces
    assert main.token_ids.tolist() == [5, 6, 7, END, 8, 40, END]
    assert sibling.token_ids.tolist() == [5, 6, 7, END, 8, 30, 31]
    assert sibling.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1]


def test_aborted_call_that_ends_the_session_closes_its_chain():
    first = call("c1", [5, 6], [7, END])
    dropped = call("c2", [5, 6, 7, END, 8], [30, 31], ABORTED, aborted=True)
    (trace,) = merged([first, dropped]).traces
    assert trace.token_ids.tolist() == [5, 6, 7, END, 8, 30, 31]
    assert trace.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 1]


def test_a_prompt_that_extends_a_partial_sample_still_joins_before_it():
    dropped = call("c1", [5, 6], [30, 31], common_pb2.FINISH_REASON_ERROR)
    continued = call("c2", [5, 6, 30, 31, 8], [9])
    result = merged([dropped, continued])
    assert [t.fork_reason for t in result.traces] == ["", "aborted_call"]
    assert result.traces[0].loss_mask.tolist() == [0, 0, 0, 0, 0, 1]


def test_calls_that_sampled_nothing_are_left_out():
    empty = call("c1", [5, 6], [], ABORTED, aborted=True)
    real = call("c2", [5, 6], [7])
    for builder in BUILDERS:
        result = build(builder, [empty, real])
        assert len(result.traces) == 1
        assert result.stats.calls == 2
        assert result.stats.tokens_before == 3


def _session_with_main(system, task):
    """A two-turn main conversation: (calls, its tip)."""
    first = call("c1", [*system, *task], [50, END])
    tip = [*first.prompt_ids, 50, END]
    second = call("c2", [*tip, 60, 61], [51, END])
    return [first, second], [*second.prompt_ids, 51, END]


def test_fork_reasons():
    system, task = [1, 4, 3, 70, 71, 72, 2, 3], [1, 5, 3, 80, 81, 2, 3]
    main, tip = _session_with_main(system, task)
    resume = call("c9", [*tip, 62], [52])

    sub = call("c3", [1, 4, 3, 90, 91, 2, 3, 1, 5, 3, 92, 2, 3], [93, END])
    assert [t.fork_reason for t in merged([*main, sub, resume]).traces] == ["", "sub_agent"]

    compacted = call("c3", [*system, 1, 5, 3, 99, 2, 3], [94, END])
    assert [t.fork_reason for t in merged([*main, compacted]).traces] == ["", "compaction"]
    # The same call is a sub-agent when the main chain goes on after it.
    assert [t.fork_reason for t in merged([*main, compacted, resume]).traces] == ["", "sub_agent"]

    edited = list(tip)
    edited[len(system) + 3] = 999  # inside the task, well before the latest call's point
    edit = call("c3", [*edited, 63], [95])
    assert [t.fork_reason for t in merged([*main, edit]).traces] == ["", "edit"]

    branch = call("c3", [*main[1].prompt_ids[:-2], 64, 65], [96])  # same point as c2, new message
    assert [t.fork_reason for t in merged([*main, branch, resume]).traces] == ["", "parallel_branch"]

    resample = call("c3", list(main[1].prompt_ids), [97])  # c2's prompt again
    assert [t.fork_reason for t in merged([*main, resample]).traces] == ["", "parallel_branch"]

    rewritten_sample = call("c3", [*main[1].prompt_ids, 51, 3, 66], [98])  # c2's sample with END dropped
    assert [t.fork_reason for t in merged([*main, rewritten_sample]).traces] == ["", "edit"]


def test_per_request_makes_one_trace_per_call():
    calls = [call("c1", [5, 6], [7, END]), call("c2", [5, 6, 7, END, 8], [9])]
    result = build("per_request", calls)
    verify_or_raise(calls, result.traces)
    assert [t.fork_reason for t in result.traces] == ["", "per_request"]
    assert result.stats == MergeStats(2, 2, 4 + 6, 4 + 6, {"per_request": 1})
    assert [t.weight for t in result.traces] == [2 / 3, 1 / 3]


def test_unknown_builder_is_named_in_the_error():
    with pytest.raises(UnknownBuilderError, match="'merge'.*per_request, prefix_merging"):
        build("merge", [])


def test_duplicate_call_ids_and_mismatched_logprobs_are_refused():
    with pytest.raises(InvalidCallError, match="c1"):
        build("prefix_merging", [call("c1", [1], [2]), call("c1", [1], [3])])
    with pytest.raises(InvalidCallError, match="2 sampled tokens but 1 logprobs"):
        CallView("c1", [1], [2, 3], [-0.5])


def test_records_round_trip_through_protobuf():
    calls = [call("c1", [5, 6], [7, END], version=2), call("c2", [5, 6, 7, END, 8], [9], LENGTH, version=3)]
    back = views_from_protos([c.to_proto("s1") for c in calls])
    for before, after in zip(calls, back):
        assert after.call_id == before.call_id and after.finish_reason == before.finish_reason
        np.testing.assert_array_equal(after.prompt_ids, before.prompt_ids)
        np.testing.assert_array_equal(after.logprobs, before.logprobs)
        assert after.policy_version == before.policy_version
    result = build("prefix_merging", calls)
    traces = [BuiltTrace.from_proto(t) for t in result.to_proto_traces()]
    verify_or_raise(back, traces)
    assert MergeStats.from_proto(result.stats.to_proto()) == result.stats
    assert traces[0].weight == pytest.approx(1.0)


# ------------------------------------------------------------------------- sampling and truncation

GREEDY = SamplingParams(temperature=0.0, max_tokens=512)
WARM = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, max_tokens=4096, stop_token_ids=(END,), seed=7)


def sampled_call(call_id, prompt, sampled, sampling, truncated=False, finish=STOP, aborted=False):
    logprobs = [-0.1 * (i + 1) for i in range(len(sampled))]
    return CallView(call_id, prompt, sampled, logprobs, finish, aborted, sampling=sampling, truncated=truncated)


def _sampled_segments(trace):
    return [(s.call_id, s.sampling) for s in trace.segments if s.kind == SegmentKind.SAMPLED]


def test_sampled_segments_carry_their_call_s_sampling_and_prompts_carry_none():
    first = sampled_call("c1", [5, 6], [7, END], WARM)
    second = sampled_call("c2", [5, 6, 7, END, 8], [9, END], GREEDY)
    for builder, expected in (
        ("prefix_merging", [[("c1", WARM), ("c2", GREEDY)]]),
        ("per_request", [[("c1", WARM)], [("c2", GREEDY)]]),
    ):
        result = build(builder, [first, second])
        verify_or_raise([first, second], result.traces)
        assert [_sampled_segments(trace) for trace in result.traces] == expected
        assert all(s.sampling is None for t in result.traces for s in t.segments if s.kind == SegmentKind.PROMPT)
        assert not any(trace.truncated for trace in result.traces)


def test_a_trace_holding_a_truncated_call_is_marked_truncated_in_both_builders():
    cut = sampled_call("c1", [5, 6], [7, 8, 9], WARM, truncated=True, finish=LENGTH)
    after = sampled_call("c2", [5, 6, 7, 8, 9, END, 4], [10, END], WARM)
    elsewhere = sampled_call("c3", [1, 2], [3, END], WARM)  # a sibling chain without truncation
    calls = [cut, after, elsewhere]
    merged_traces = merged(calls).traces
    assert [t.truncated for t in merged_traces] == [True, False]
    per_request = build("per_request", calls).traces
    verify_or_raise(calls, per_request)
    assert [t.truncated for t in per_request] == [True, False, False]


def test_an_aborted_call_split_off_leaves_its_chain_unmarked():
    first = sampled_call("c1", [5, 6], [7, END], WARM)
    dropped = sampled_call("c2", [5, 6, 7, END, 8], [30, 31], WARM, finish=ABORTED, aborted=True)
    cut = sampled_call("c3", [5, 6, 7, END, 8], [40, 41], GREEDY, truncated=True, finish=LENGTH)
    main, sibling = merged([first, dropped, cut]).traces
    assert (main.truncated, sibling.truncated) == (True, False)
    assert _sampled_segments(sibling) == [("c2", WARM)]


def test_the_verifier_catches_a_wrong_segment_sampling_or_truncation_mark():
    calls = [sampled_call("c1", [5, 6], [7, END], WARM, truncated=True, finish=LENGTH)]
    (trace,) = build("per_request", calls).traces
    unmarked = dataclasses.replace(trace, truncated=False)
    resampled = dataclasses.replace(
        trace, segments=tuple(dataclasses.replace(s, sampling=GREEDY) if s.sampling else s for s in trace.segments)
    )
    assert "truncated" in verify(calls, [unmarked]).render()
    assert "segment sampling" in verify(calls, [resampled]).render()


def test_sampling_and_truncation_round_trip_through_protobuf():
    calls = [
        sampled_call("c1", [5, 6], [7, 8], WARM, truncated=True, finish=LENGTH),
        sampled_call("c2", [5, 6, 7, 8, END, 3], [9, END], GREEDY),
        call("c3", [1], [2]),  # recorded before calls carried their sampling
    ]
    back = views_from_protos([c.to_proto("s1") for c in calls])
    assert [(c.sampling, c.truncated) for c in back] == [(WARM, True), (GREEDY, False), (None, False)]
    assert not back[2].to_proto().HasField("sampling")
    for builder in BUILDERS:
        result = build(builder, calls)
        traces = [BuiltTrace.from_proto(t) for t in result.to_proto_traces()]
        verify_or_raise(back, traces)
        assert [(t.truncated, t.segments) for t in traces] == [(t.truncated, t.segments) for t in result.traces]
        protos = result.to_proto_traces()
        assert protos[0].truncated and protos[0].segments[1].sampling == WARM.to_proto()  # c1's sample
