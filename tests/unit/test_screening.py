"""What a step does with traces too long to train on, forks, cut, aborted, failed, retried and refused
calls (trainer/screening.py, polar/trajectory/call_stats.py): each kept or left out as defined, and
counted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar.rollout.client import Group
from polar.trajectory import CallView, build, views_from_protos
from polar.trajectory.call_stats import CALL_COUNTS, call_counts
from polar.v1 import common_pb2
from trainer.screening import SCREEN_KEYS, Screener

BUDGET = 100
STOP, ERROR, ABORTED = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORTED


def call(call_id: str, prompt: list[int], sampled: list[int], finish: int = STOP, **fields) -> CallView:
    return CallView(call_id, prompt, sampled, [-0.5] * len(sampled), finish_reason=finish, **fields)


def trajectory(session: str, calls: list[CallView], task: str = "t1", reward: float = 0.0) -> common_pb2.Trajectory:
    built = build("prefix_merging", calls)
    return common_pb2.Trajectory(
        trajectory_id=session,
        session_id=session,
        task_id=task,
        reward=reward,
        traces=built.to_proto_traces(),
        stats=built.stats.to_proto(),
        calls=[c.to_proto(session) for c in calls],
    )


def chain(session: str, prompt_length: int, task: str = "t1") -> common_pb2.Trajectory:
    """A session of one call: a trace of prompt_length + 2 tokens."""
    return trajectory(session, [call("c0001", list(range(1, prompt_length + 1)), [7, 8])], task)


def screener(too_long: str = "group") -> tuple[Screener, list[str]]:
    warnings: list[str] = []
    return Screener(BUDGET, too_long, warnings.append), warnings


def test_a_group_holding_a_trace_past_the_budget_leaves_the_step_whole_by_default():
    screen, warnings = screener()
    fits = Group("1", [chain("a", 10), chain("b", 20)])
    holds_long = Group("2", [chain("c", 10, "t2"), chain("d", 150, "t2"), chain("e", 120, "t2")])
    screened = screen.screen([fits, holds_long])
    assert screened.groups == [fits] and screened.dropped == ["t2"]
    counts = screened.counts
    assert (counts["traces_too_long"], counts["groups_too_long_dropped"], counts["sessions_too_long_dropped"]) == (
        2,
        1,
        0,
    )
    [warning] = warnings
    assert "task t2" in warning and "2 of its 3 sessions" in warning and "session d, 152 tokens" in warning
    assert "the group left out" in warning


def test_too_long_session_leaves_only_its_session_unless_one_would_be_left_alone():
    screen, warnings = screener("session")
    three = Group("1", [chain("a", 10), chain("b", 150), chain("c", 30)])
    two = Group("2", [chain("d", 10, "t2"), chain("e", 150, "t2")])
    screened = screen.screen([three, two])
    [kept] = screened.groups
    assert [t.session_id for t in kept.trajectories] == ["a", "c"] and kept.cursor == "1"
    assert (screened.counts["sessions_too_long_dropped"], screened.counts["groups_too_long_dropped"]) == (1, 1)
    assert len(warnings) == 2 and "those sessions left out" in warnings[0] and "the group left out" in warnings[1]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="too_long must be one of group, session"):
        Screener(BUDGET, "trace", print)


def test_forks_cut_aborted_failed_retried_and_refused_calls_are_counted():
    p1 = [1, 2, 3]
    calls = [
        call("c0001", p1, [4, 5], truncated=True, finish=common_pb2.FINISH_REASON_LENGTH),
        call("c0002", [1, 2, 3, 4, 5, 6], [7], finish=ERROR, error="engine lost"),  # fails mid-way
        call("c0003", [1, 2, 3, 4, 5, 6], [8, 9]),  # the harness retries it
        call("c0004", [1, 2, 3, 4, 5, 6, 8, 9, 10], [11], aborted=True, finish=ABORTED),
        call("c0005", [1] + [3] * 200, [], finish=ERROR, prompt_too_long=True),  # refused: too long
        call("c0006", [1, 2, 20], [21, 22]),  # compacted
    ]
    screen, warnings = screener()
    group = Group("1", [trajectory("a", calls), chain("b", 10)])
    counts = screen.screen([group]).counts
    assert set(SCREEN_KEYS) <= set(counts)
    expected = {
        "calls": 7,
        "calls_truncated": 1,
        "calls_failed": 1,
        "calls_retried": 1,
        "calls_aborted": 1,
        "calls_prompt_too_long": 1,
        "forks_aborted_call": 1,  # the failed call's partial sample, split off its chain
        "forks_compaction": 1,
        "traces_truncated": 1,
        "sessions_first_call_too_long": 0,
        "traces_too_long": 0,
    }
    assert {key: counts[key] for key in expected} == expected
    assert warnings == []


def test_a_first_call_over_the_context_is_counted_and_warned_once():
    screen, warnings = screener()
    refused = [call("c0001", list(range(300)), [], finish=ERROR, prompt_too_long=True, error="prompt is 300 tokens")]
    for step in range(2):
        group = Group(str(step), [trajectory("a", refused), trajectory("b", refused)])
        assert screen.screen([group]).counts["sessions_first_call_too_long"] == 2
    [warning] = warnings
    assert "first call does not fit the served model's context (prompt is 300 tokens)" in warning


outcomes = st.sampled_from(["ok", "aborted", "failed", "too_long"])


@given(st.lists(st.tuples(st.integers(0, 3), outcomes, st.booleans()), max_size=12))
def test_call_counts_hold_their_definitions(plan):
    calls = []
    for index, (prompt, outcome, truncated) in enumerate(plan):
        fields = {
            "ok": {"finish": STOP},
            "aborted": {"finish": ABORTED, "aborted": True},
            "failed": {"finish": ERROR},
            "too_long": {"finish": ERROR, "prompt_too_long": True},
        }[outcome]
        sampled = [] if outcome == "too_long" else [9]
        calls.append(call(f"c{index:04d}", [1, prompt], sampled, truncated=truncated, **fields))
    counts = call_counts(calls)
    assert set(counts) == set(CALL_COUNTS) and counts["calls"] == len(plan)
    for key, outcome in (
        ("calls_aborted", "aborted"),
        ("calls_failed", "failed"),
        ("calls_prompt_too_long", "too_long"),
    ):
        assert counts[key] == sum(o == outcome for _, o, _ in plan)
    assert counts["calls_truncated"] == sum(t for _, _, t in plan)
    # A retry repeats the prompt of an earlier call that did not succeed.
    failed_before = [any(p2 == p and o2 != "ok" for p2, o2, _ in plan[:i]) for i, (p, _, _) in enumerate(plan)]
    assert counts["calls_retried"] == sum(failed_before)
    # Views read back from their records count the same.
    assert call_counts(views_from_protos([c.to_proto("s") for c in calls])) == counts
