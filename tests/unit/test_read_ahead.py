"""ReadAhead: every message once, in order, in batches of what arrived; the stream's error after them;
a stream silent past its idle timeout raises StreamIdle."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.batched_stream import ReadAhead, StreamIdle


class StreamFailed(Exception):
    pass


async def _stream(items, *, pauses=(), error: Exception | None = None):
    """Yield items; after item i wait pauses[i] loop turns (0: the next one is there at once)."""
    for index, item in enumerate(items):
        yield item
        for _ in range(pauses[index] if index < len(pauses) else 0):
            await asyncio.sleep(0)
    if error is not None:
        raise error


async def _collect(read_ahead: ReadAhead, consumer_turns: int = 0) -> list[list]:
    batches = []
    async for batch in read_ahead:
        batches.append(batch)
        for _ in range(consumer_turns):  # a consumer busy with each batch
            await asyncio.sleep(0)
    return batches


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.integers(), max_size=30),
    pauses=st.lists(st.integers(0, 3), max_size=30),
    consumer_turns=st.integers(0, 4),
    fails=st.booleans(),
)
def test_every_item_arrives_once_in_order_and_the_error_after_them(items, pauses, consumer_turns, fails):
    async def run():
        read_ahead = ReadAhead(_stream(items, pauses=pauses, error=StreamFailed() if fails else None))
        batches: list[list] = []
        try:
            async for batch in read_ahead:
                batches.append(batch)
                for _ in range(consumer_turns):
                    await asyncio.sleep(0)
        except StreamFailed:
            assert fails
        else:
            assert not fails
        finally:
            read_ahead.close()
        return batches

    batches = asyncio.run(asyncio.wait_for(run(), 5))
    assert [item for batch in batches for item in batch] == items
    assert all(batches)  # never an empty batch


def test_a_stream_spent_before_the_consumer_looks_ends_the_iteration():
    async def run():
        read_ahead = ReadAhead(_stream([1, 2, 3]))
        await asyncio.sleep(0.01)  # the reader has read everything and ended
        return await _collect(read_ahead)

    assert asyncio.run(asyncio.wait_for(run(), 5)) == [[1, 2, 3]]


def test_what_arrives_while_the_consumer_is_busy_comes_as_one_batch():
    async def run():
        return await _collect(ReadAhead(_stream(list(range(6)), pauses=[1] * 6)), consumer_turns=5)

    batches = asyncio.run(asyncio.wait_for(run(), 5))
    assert batches[0] == [0] and len(batches) < 6 and [item for batch in batches for item in batch] == list(range(6))


def test_a_consumer_that_keeps_up_gets_each_item_as_it_comes():
    async def run():
        return await _collect(ReadAhead(_stream(list(range(5)), pauses=[3] * 5)))

    assert asyncio.run(asyncio.wait_for(run(), 5)) == [[0], [1], [2], [3], [4]]


def test_close_stops_the_reader():
    async def endless(done: asyncio.Event):
        try:
            while True:
                yield 1
                await asyncio.sleep(0.001)
        finally:
            done.set()

    async def run():
        done = asyncio.Event()
        read_ahead = ReadAhead(endless(done))
        async for _ in read_ahead:
            break
        read_ahead.close()
        await asyncio.wait_for(done.wait(), 5)
        return done.is_set()

    assert asyncio.run(run())


@pytest.mark.parametrize("before", [0, 3])
def test_an_error_at_once_or_after_items_reaches_the_consumer(before):
    async def run():
        seen = []
        with pytest.raises(StreamFailed):
            async for batch in ReadAhead(_stream(list(range(before)), error=StreamFailed())):
                seen += batch
        return seen

    assert asyncio.run(asyncio.wait_for(run(), 5)) == list(range(before))


def test_a_stream_silent_past_the_idle_timeout_raises_stream_idle_after_what_came_before():
    async def hangs_after_one():
        yield 1
        await asyncio.Event().wait()  # never set: an engine that stopped sending

    async def run():
        seen = []
        read_ahead = ReadAhead(hangs_after_one(), idle_timeout_s=0.05)
        started = asyncio.get_running_loop().time()
        with pytest.raises(StreamIdle) as raised:
            async for batch in read_ahead:
                seen += batch
        read_ahead.close()
        return seen, raised.value, asyncio.get_running_loop().time() - started

    seen, error, waited = asyncio.run(asyncio.wait_for(run(), 5))
    assert seen == [1] and error.seconds == 0.05 and isinstance(error, TimeoutError)
    assert 0.05 <= waited < 2


def test_the_idle_timeout_counts_silences_not_the_whole_stream():
    async def slow(count: int, gap_s: float):
        for index in range(count):
            await asyncio.sleep(gap_s)
            yield index

    async def run():
        # 10 gaps of 20 ms: 200 ms in all, four times the timeout, but no silence reaches it.
        return await _collect(ReadAhead(slow(10, 0.02), idle_timeout_s=0.05))

    batches = asyncio.run(asyncio.wait_for(run(), 5))
    assert [item for batch in batches for item in batch] == list(range(10))


def test_a_slow_consumer_is_not_counted_against_the_stream():
    async def run():
        read_ahead = ReadAhead(_stream([1, 2]), idle_timeout_s=0.05)
        seen = []
        async for batch in read_ahead:
            seen += batch
            await asyncio.sleep(0.1)  # longer than the timeout, with the stream spent meanwhile
        return seen

    assert asyncio.run(asyncio.wait_for(run(), 5)) == [1, 2]


@pytest.mark.parametrize("consumer_pause_s", [0.0, 0.08])
def test_a_silence_after_many_messages_is_timed_from_the_wait_it_stops(consumer_pause_s):
    """Messages 20 ms apart for longer than the timeout, then silence: the silence alone raises,
    timed from the wait it stops, whether the caller kept waiting or was busy (past the timeout)
    when the stream's one timer went off."""

    async def five_then_hangs():
        for index in range(5):
            await asyncio.sleep(0.02)
            yield index
        await asyncio.Event().wait()

    async def run():
        read_ahead = ReadAhead(five_then_hangs(), idle_timeout_s=0.05)
        seen, last_wait = [], 0.0
        loop = asyncio.get_running_loop()
        with pytest.raises(StreamIdle):
            async for batch in read_ahead:
                seen += batch
                await asyncio.sleep(consumer_pause_s)
                last_wait = loop.time()
        read_ahead.close()
        return seen, loop.time() - last_wait

    seen, silence = asyncio.run(asyncio.wait_for(run(), 5))
    assert seen == [0, 1, 2, 3, 4]
    assert 0.05 <= silence < 2


def test_aclose_lets_go_of_the_stream_so_that_it_can_be_closed_at_once():
    async def run():
        released = asyncio.Event()

        async def slow():
            try:
                yield 1
                await asyncio.sleep(60)  # the reader is inside the generator, waiting
                yield 2
            finally:
                released.set()

        stream = slow()
        read_ahead = ReadAhead(stream)
        async for batch in read_ahead:
            assert batch == [1]
            break
        await read_ahead.aclose()
        await stream.aclose()  # an async generator another task is inside cannot be closed
        return released.is_set()

    assert asyncio.run(asyncio.wait_for(run(), 5))
