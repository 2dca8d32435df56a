"""The session store: keys, lookup, closing, recording order, watchers and drain."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.sampling import NO_POLICY, SamplingPolicy
from gateway.sessions import Draining, SessionClosed, SessionExists, SessionStore, UnknownSession
from polar.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.anyio


def _finish(store: SessionStore, session, call_id: str) -> None:
    store.record(session, common_pb2.CallRecord(call_id=call_id, session_id=session.session_id))


async def test_keys_are_unguessable_and_distinct():
    store = SessionStore()
    keys = {store.open().key for _ in range(200)}
    assert len(keys) == 200
    # token_urlsafe(32): 43 characters of 6 bits each after the prefix, far past 128 bits.
    assert all(len(key.removeprefix("polar-")) * 6 >= 128 for key in keys)


async def test_a_session_is_found_by_key_or_id_but_only_its_key_authorizes():
    store = SessionStore()
    session = store.open(session_id="run-1", task_id="t")
    assert store.find(session.key) is session and store.find("run-1") is session
    assert store.authorize(session.key) is session
    with pytest.raises(UnknownSession):
        store.authorize("run-1")
    with pytest.raises(UnknownSession):
        store.authorize(None)


async def test_a_closed_key_is_refused_but_the_session_stays_readable():
    store = SessionStore()
    session = store.open()
    store.close(session.key)
    with pytest.raises(SessionClosed):
        store.authorize(session.key)
    proto = store.find(session.session_id).to_proto()
    assert proto.closed and proto.closed_unix_ns >= proto.opened_unix_ns > 0


async def test_ids_are_unique_and_the_history_default_is_the_stores():
    store = SessionStore(default_history="template")
    assert store.open(session_id="a").history == "template"
    assert store.open(history="faithful").to_proto().history == gateway_pb2.HISTORY_POLICY_FAITHFUL
    with pytest.raises(SessionExists):
        store.open(session_id="a")


async def test_calls_are_numbered_on_arrival_and_listed_in_that_order_whatever_finishes_first():
    store = SessionStore()
    session = store.open()
    first, second = session.begin_call(), session.begin_call()
    assert (first, second) == ("c0001", "c0002")
    _finish(store, session, second)
    _finish(store, session, first)
    assert [r.call_id for r in session.ordered_records()] == ["c0001", "c0002"]
    assert store.calls_total == 2 and session.in_flight == 0


async def test_a_watch_replays_then_follows_and_ends_once_closed_and_idle():
    store = SessionStore()
    session = store.open()
    _finish(store, session, session.begin_call())
    in_flight = session.begin_call()
    seen: list[str] = []

    async def watch():
        async for record in session.watch():
            seen.append(record.call_id)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.01)
    store.close(session.key)
    await asyncio.sleep(0.01)
    assert not watcher.done(), "a call in flight is still to be recorded"
    _finish(store, session, in_flight)
    await asyncio.wait_for(watcher, 1)
    assert seen == ["c0001", "c0002"]


async def test_drain_refuses_new_sessions_and_waits_for_open_ones():
    store = SessionStore()
    session = store.open()
    drain = asyncio.create_task(store.drain(5))
    await asyncio.sleep(0.01)
    with pytest.raises(Draining):
        store.open()
    store.close(session.key)
    assert await asyncio.wait_for(drain, 1) == 0


async def test_drain_gives_up_after_its_timeout():
    store = SessionStore()
    store.open()
    assert await store.drain(0.05) == 1


async def test_closed_sessions_are_forgotten_after_the_retention_but_open_and_busy_ones_stay():
    store = SessionStore()
    old, busy, recent, still_open = (store.open(session_id=name) for name in ("old", "busy", "recent", "open"))
    for session in (old, busy, recent):
        store.close(session.session_id)
    busy.begin_call()  # a call still in flight after the close
    now = time.time_ns()
    old.closed_unix_ns = busy.closed_unix_ns = now - 7200 * 10**9
    assert store.forget_closed(3600, now_ns=now) == 1
    with pytest.raises(UnknownSession):
        store.find("old")
    with pytest.raises(UnknownSession):
        store.authorize(old.key)
    assert {store.find(name).session_id for name in ("busy", "recent", "open")} == {"busy", "recent", "open"}
    _finish(store, busy, "c0001")  # its last call recorded: now it goes too
    assert store.forget_closed(3600, now_ns=now) == 1
    assert still_open.closed is False and store.find("open") is still_open


async def test_a_session_keeps_its_sampling_policy_and_counts_what_its_calls_sampled():
    store = SessionStore()
    policy = SamplingPolicy(temperature=0.5, max_tokens_per_call=64, max_tokens_per_session=1000)
    session = store.open(task_id="t", sampling=policy)
    assert session.sampling == policy and store.open().sampling == NO_POLICY
    assert session.to_proto().sampling == policy.to_proto()
    session.count_sampled(30)
    session.count_sampled(12)
    assert session.sampled_tokens == 42
    with pytest.raises(ValueError, match=r"sampling.top_p: .*; sampling.max_tokens_per_call"):
        store.open(sampling=SamplingPolicy(top_p=2.0, max_tokens_per_call=-1))
