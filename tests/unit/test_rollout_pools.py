"""The node's pools, its READY buffer of prewarmed runtimes, and its stage clock (polar/app/node/pools.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.app.node.pools import Pool, ReadyBuffer, StageClock
from polar.v1 import rollout_pb2

pytestmark = pytest.mark.anyio


def spec(name: str) -> rollout_pb2.RuntimeSpec:
    return rollout_pb2.RuntimeSpec(kind="local", template=name)


async def test_pool_counts_active_and_waiting_sessions() -> None:
    pool = Pool("running", 2)
    release = asyncio.Event()
    entered = []

    async def session(n: int) -> None:
        async with pool.slot():
            entered.append(n)
            await release.wait()

    tasks = [asyncio.create_task(session(n)) for n in range(3)]
    await asyncio.sleep(0.01)
    assert (pool.active, pool.waiting, pool.free) == (2, 1, 0)
    assert entered == [0, 1]
    release.set()
    await asyncio.gather(*tasks)
    assert (pool.active, pool.waiting, pool.free) == (0, 0, 2)
    assert entered == [0, 1, 2]


async def test_pool_slot_is_returned_when_the_holder_fails() -> None:
    pool = Pool("postrun", 1)
    with pytest.raises(RuntimeError):
        async with pool.slot():
            raise RuntimeError("evaluator crashed")
    async with asyncio.timeout(1):
        async with pool.slot():
            assert pool.active == 1


async def test_a_cancelled_waiter_leaves_the_counts_straight() -> None:
    pool = Pool("init", 1)
    await pool.acquire()
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    assert pool.waiting == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert (pool.active, pool.waiting) == (1, 0)
    pool.release()
    assert pool.free == 1


def test_a_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least 1 slot"):
        Pool("running", 0)


def test_ready_buffer_serves_the_spec_asked_for_oldest_first() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(4, [("a", spec("a"))])
    buffer.put("a", spec("a"), "a1")
    buffer.put("a", spec("a"), "a2")
    assert buffer.take("b") is None
    assert buffer.take("a")[0] == "a1"
    assert buffer.take("a")[0] == "a2"
    assert buffer.take("a") is None


def test_ready_buffer_fills_to_capacity_counting_runtimes_being_prepared() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(2, [("a", spec("a"))])
    assert buffer.next_to_prepare() == ("a", spec("a"))
    buffer.preparing = 1
    buffer.put("a", spec("a"), "a1")
    assert buffer.next_to_prepare() is None
    buffer.preparing = 0
    assert buffer.next_to_prepare() == ("a", spec("a"))


def test_ready_buffer_prepares_the_most_recently_wanted_spec_first() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(4, [])
    buffer.want("a", spec("a"))
    buffer.want("b", spec("b"))
    assert buffer.next_to_prepare()[0] == "b"
    buffer.put("b", spec("b"), "b1")
    # b has one, a none: the emptier one comes next, so the buffer is shared among warm specs.
    assert buffer.next_to_prepare()[0] == "a"


def test_configured_specs_step_aside_once_a_task_wants_another() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(4, [("default", spec("default"))])
    buffer.put("default", spec("default"), "d1")
    assert buffer.want("default", spec("default")) == []  # a task wanting the default keeps it
    buffer.want("a", spec("a"))
    assert buffer.next_to_prepare()[0] == "a"


def test_placeholder_runtimes_are_given_back_when_a_task_spec_arrives() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(4, [("default", spec("default"))])
    buffer.put("default", spec("default"), "d1")
    buffer.put("default", spec("default"), "d2")
    assert sorted(buffer.want("a", spec("a"))) == ["d1", "d2"]
    assert buffer.size == 0
    buffer.put("a", spec("a"), "a1")
    buffer.want("b", spec("b"))  # no placeholders any more: a stays warm
    assert buffer.take("a")[0] == "a1"


def test_ready_buffer_keeps_at_most_capacity_specs() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(2, [])
    buffer.want("a", spec("a"))
    buffer.put("a", spec("a"), "a1")
    buffer.want("b", spec("b"))
    assert buffer.want("c", spec("c")) == ["a1"]  # a, the least recently wanted, is pushed out
    assert buffer.take("a") is None


def test_ready_buffer_gives_up_the_least_wanted_spec_when_full() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(2, [])
    buffer.want("a", spec("a"))
    buffer.put("a", spec("a"), "a1")
    buffer.want("b", spec("b"))
    buffer.put("b", spec("b"), "b1")
    assert buffer.evict_for("c") == "a1"  # a was wanted before b
    assert buffer.size == 1
    buffer.want("c", spec("c"))
    assert buffer.next_to_prepare()[0] == "c"


def test_ready_buffer_evicts_nothing_while_there_is_room() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(3, [])
    buffer.want("a", spec("a"))
    buffer.put("a", spec("a"), "a1")
    assert buffer.evict_for("b") is None
    assert buffer.size == 1


def test_ready_buffer_drain_returns_every_runtime() -> None:
    buffer: ReadyBuffer[str] = ReadyBuffer(3, [])
    buffer.want("a", spec("a"))
    buffer.put("a", spec("a"), "a1")
    buffer.want("b", spec("b"))
    buffer.put("b", spec("b"), "b1")
    assert sorted(buffer.drain()) == ["a1", "b1"]
    assert buffer.size == 0


@settings(max_examples=200)
@given(
    st.integers(1, 6),
    st.lists(
        st.tuples(st.sampled_from(["want", "take", "prepare", "evict"]), st.sampled_from("abc")),
        max_size=60,
    ),
)
def test_ready_buffer_never_holds_more_than_its_capacity(capacity: int, operations) -> None:
    """Whatever sessions ask for, prepared plus preparing runtimes stay within capacity, and every
    runtime put in comes out exactly once (taken, evicted or drained)."""
    buffer: ReadyBuffer[str] = ReadyBuffer(capacity, [("a", spec("a"))])
    made, out = [], []
    for op, key in operations:
        if op == "want":
            out += buffer.want(key, spec(key))
        elif op == "take":
            if (taken := buffer.take(key)) is not None:
                out.append(taken[0])
        elif op == "prepare":
            if (wanted := buffer.next_to_prepare()) is not None:
                name = f"{wanted[0]}{len(made)}"
                made.append(name)
                buffer.put(wanted[0], wanted[1], name)
        elif (evicted := buffer.evict_for(key)) is not None:
            out.append(evicted)
        assert buffer.size + buffer.preparing <= capacity
    out += buffer.drain()
    assert sorted(out) == sorted(made)


def test_stage_clock_adds_up_each_stage() -> None:
    clock = StageClock()
    start = time.monotonic()
    clock.enter("init", since=start - 2.0)
    clock.enter("ready")
    clock.enter("init")  # a stage entered twice accumulates
    clock.stop()
    timings = clock.timings()
    assert 2.0 <= timings.init_seconds < 2.5
    assert 0 <= timings.ready_seconds < 0.5
    assert timings.running_seconds == 0.0
    assert clock.stage is None


def test_stage_clock_counts_the_current_stage_so_far() -> None:
    clock = StageClock()
    clock.enter("running", since=time.monotonic() - 1.0)
    assert clock.timings().running_seconds >= 1.0
    assert clock.stage == "running"
