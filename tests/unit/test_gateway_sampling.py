"""gateway.sampling: a task's sampling policy over what the harness asks (effective_sampling), and the
policy's validation and protobuf conversion."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.dialects.base import ErrorKind, GatewayError, Sampling
from gateway.sampling import DEFAULT_TEMPERATURE, Limit, effective_sampling
from polar.sampling_policy import NO_POLICY, SamplingPolicy, policy_problems
from polar.v1 import common_pb2

ROOM = 30_000  # what the context leaves after the prompt


def test_without_a_policy_the_harness_s_sampling_is_used_within_the_context():
    requested = Sampling(max_tokens=500, temperature=0.7, top_p=0.95, top_k=20, seed=-1)
    params, limit = effective_sampling(requested, NO_POLICY, 0, ROOM)
    assert (params.max_tokens, limit) == (500, Limit.REQUEST)
    assert (params.temperature, params.top_k) == (pytest.approx(0.7), 20)
    assert params.top_p == pytest.approx(0.95)
    assert params.seed == 2**64 - 1
    # No max tokens asked: the context's room, as before policies existed.
    params, limit = effective_sampling(Sampling(), NO_POLICY, 0, ROOM)
    assert (params.max_tokens, limit) == (ROOM, Limit.CONTEXT)
    assert (params.temperature, params.top_p, params.top_k) == (DEFAULT_TEMPERATURE, 0.0, 0)
    assert not params.HasField("seed")


def test_a_policy_s_temperature_and_top_p_replace_the_harness_s():
    requested = Sampling(temperature=0.2, top_p=0.5, top_k=40)
    params, _ = effective_sampling(requested, SamplingPolicy(temperature=1.0, top_p=1.0), 0, ROOM)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 40)  # top_k stays the harness's
    # Greedy is a temperature like any other; an unset field keeps the harness's value.
    params, _ = effective_sampling(requested, SamplingPolicy(temperature=0.0), 0, ROOM)
    assert params.temperature == 0.0 and params.top_p == pytest.approx(0.5)
    params, _ = effective_sampling(Sampling(), SamplingPolicy(top_p=0.9), 0, ROOM)
    assert params.temperature == DEFAULT_TEMPERATURE and params.top_p == pytest.approx(0.9)


def test_a_policy_s_top_k_replaces_the_harness_s_and_zero_turns_truncation_off():
    requested = Sampling(temperature=1.0, top_p=0.95, top_k=64)  # what Gemini CLI asks
    assert effective_sampling(requested, SamplingPolicy(top_k=0), 0, ROOM)[0].top_k == 0
    assert effective_sampling(requested, SamplingPolicy(top_k=5), 0, ROOM)[0].top_k == 5
    assert effective_sampling(requested, SamplingPolicy(top_p=1.0), 0, ROOM)[0].top_k == 64
    assert SamplingPolicy.from_proto(common_pb2.SamplingPolicy(top_k=0)) == SamplingPolicy(top_k=0)
    assert SamplingPolicy(top_k=0).to_proto().HasField("top_k")


def test_a_harness_that_asks_no_max_tokens_gets_the_task_s_cap():
    policy = SamplingPolicy(max_tokens_per_call=4096)
    assert _max_tokens(Sampling(), policy) == (4096, Limit.CALL_CAP)
    assert _max_tokens(Sampling(max_tokens=32000), policy) == (4096, Limit.CALL_CAP)
    # What the harness asked for itself stays its own limit, ties included: reaching it is no truncation.
    assert _max_tokens(Sampling(max_tokens=100), policy) == (100, Limit.REQUEST)
    assert _max_tokens(Sampling(max_tokens=4096), policy) == (4096, Limit.REQUEST)
    # The context bounds every call; a cap that only reaches it is still the cap.
    assert _max_tokens(Sampling(), policy, room=1000) == (1000, Limit.CONTEXT)
    assert _max_tokens(Sampling(), policy, room=4096) == (4096, Limit.CALL_CAP)


def test_the_session_budget_bounds_each_call_by_what_is_left():
    policy = SamplingPolicy(max_tokens_per_call=4096, max_tokens_per_session=10_000)
    assert _max_tokens(Sampling(), policy, used=0) == (4096, Limit.CALL_CAP)
    assert _max_tokens(Sampling(), policy, used=8_000) == (2000, Limit.SESSION_BUDGET)
    assert _max_tokens(Sampling(max_tokens=50), policy, used=9_990) == (10, Limit.SESSION_BUDGET)
    budget_only = SamplingPolicy(max_tokens_per_session=10_000)
    assert _max_tokens(Sampling(), budget_only, used=1) == (9_999, Limit.SESSION_BUDGET)


@pytest.mark.parametrize("used", [10_000, 12_345])
def test_a_used_up_budget_refuses_the_call(used):
    policy = SamplingPolicy(max_tokens_per_session=10_000)
    with pytest.raises(GatewayError) as error:
        effective_sampling(Sampling(max_tokens=10), policy, used, ROOM)
    assert error.value.kind is ErrorKind.INVALID_REQUEST
    assert "token budget is used up" in error.value.message and "10000" in error.value.message


def test_a_max_tokens_below_one_is_an_invalid_request():
    with pytest.raises(GatewayError) as error:
        effective_sampling(Sampling(max_tokens=0), SamplingPolicy(max_tokens_per_call=10), 0, ROOM)
    assert error.value.kind is ErrorKind.INVALID_REQUEST


def test_only_limits_the_harness_did_not_ask_for_truncate():
    assert [limit.truncates for limit in Limit] == [False, True, True, True]


limits = st.one_of(st.none(), st.integers(1, 50_000))


@given(
    requested=limits,
    cap=st.integers(0, 50_000),
    budget=st.integers(0, 100_000),
    used=st.integers(0, 100_000),
    room=st.integers(1, 50_000),
)
def test_max_tokens_is_the_smallest_limit_and_the_limit_named_is_one_that_gives_it(requested, cap, budget, used, room):
    policy = SamplingPolicy(max_tokens_per_call=cap, max_tokens_per_session=budget)
    if budget and used >= budget:
        with pytest.raises(GatewayError):
            effective_sampling(Sampling(max_tokens=requested), policy, used, room)
        return
    params, limit = effective_sampling(Sampling(max_tokens=requested), policy, used, room)
    given_by = {
        Limit.REQUEST: requested,
        Limit.CALL_CAP: cap or None,
        Limit.SESSION_BUDGET: budget - used if budget else None,
        Limit.CONTEXT: room,
    }
    assert params.max_tokens == min(v for v in given_by.values() if v is not None) >= 1
    assert given_by[limit] == params.max_tokens
    # Ties go to the harness's own limit first, then the cap, the budget, the context.
    assert all(given_by[earlier] != params.max_tokens for earlier in list(Limit)[: list(Limit).index(limit)])


def test_policy_problems_name_each_field():
    assert SamplingPolicy(temperature=0.0, top_p=1.0, max_tokens_per_call=1, max_tokens_per_session=1).problems() == []
    assert NO_POLICY.problems() == []
    bad = SamplingPolicy(temperature=-0.5, top_p=0.0, max_tokens_per_call=-1, max_tokens_per_session=-2)
    assert [problem.split(":")[0] for problem in bad.problems()] == [
        "sampling.temperature",
        "sampling.top_p",
        "sampling.max_tokens_per_call",
        "sampling.max_tokens_per_session",
    ]
    assert SamplingPolicy(temperature=math.inf).problems()[0].startswith("sampling.temperature: must be a finite")
    assert SamplingPolicy(temperature=math.nan).problems()[0].startswith("sampling.temperature:")
    assert SamplingPolicy(top_p=1.5).problems() == ["sampling.top_p: must be in (0, 1], got 1.5"]
    assert policy_problems(common_pb2.SamplingPolicy(top_p=-1), "task.sampling")[0].startswith("task.sampling.top_p:")


def test_the_policy_round_trips_through_protobuf_keeping_unset_apart_from_zero():
    assert SamplingPolicy.from_proto(common_pb2.SamplingPolicy()) == NO_POLICY
    greedy = common_pb2.SamplingPolicy(temperature=0.0, max_tokens_per_call=256, max_tokens_per_session=2**40)
    policy = SamplingPolicy.from_proto(greedy)
    assert policy == SamplingPolicy(temperature=0.0, max_tokens_per_call=256, max_tokens_per_session=2**40)
    assert policy.to_proto() == greedy and policy.to_proto().HasField("temperature")
    assert not policy.to_proto().HasField("top_p")


def _max_tokens(requested: Sampling, policy: SamplingPolicy, *, used: int = 0, room: int = ROOM) -> tuple[int, Limit]:
    params, limit = effective_sampling(requested, policy, used, room)
    return params.max_tokens, limit
