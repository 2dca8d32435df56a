"""The session store: keys, lookup, closing, recording order, watchers and drain; its bounds: bodies
past a session's cap spilled to a file and read back whole, idle sessions expired."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.body_store import SpillFolder
from gateway.sessions import Draining, RecordParts, SessionClosed, SessionExists, SessionStore, UnknownSession
from polar.codec import packed_ids
from polar.sampling_policy import NO_POLICY, SamplingPolicy
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


# ------------------------------------------------------------------------------------- bodies


def _call(session, tokens=(5, 6, 7)) -> common_pb2.CallRecord:
    """A call begun, and its record (which leaves the bodies out, as the gateway's do)."""
    call_id = session.begin_call()
    return common_pb2.CallRecord(
        call_id=call_id,
        session_id=session.session_id,
        prompt_token_ids=[1, 2, 3],
        sampled_token_ids=list(tokens),
        sampled_logprobs=[-0.5] * len(tokens),
    )


def _record(store, session, request: bytes, response: bytes, tokens=(5, 6, 7)) -> None:
    store.record(session, _call(session, tokens), apart=RecordParts(request_body=request, response_body=response))


async def test_bodies_past_the_cap_go_to_a_file_and_come_back_whole(tmp_path):
    store = SessionStore(max_body_bytes=200, spill=SpillFolder(str(tmp_path)))
    session = store.open()
    bodies = [(b"q%d" % i * 40, b"r%d" % i * 20) for i in range(5)]  # 80 + 40 bytes per call
    for index, (request, response) in enumerate(bodies):
        _record(store, session, request, response, tokens=(10 + index, 11))
    # The first call fits (120 bytes); the second would pass 200: it and every later one spill.
    assert session.bodies.in_memory == 120 and session.bodies.spilled == 4
    assert not any(record.request_body or record.response_body for record in session.records)
    # ... but never the token ids or logprobs.
    assert [list(r.sampled_token_ids) for r in session.records] == [[10 + i, 11] for i in range(5)]
    [folder] = tmp_path.iterdir()
    assert folder.stat().st_mode & 0o777 == 0o700
    [spill_file] = folder.iterdir()
    assert spill_file.stat().st_size == 4 * 120
    whole = session.ordered_records()
    assert [(r.request_body, r.response_body) for r in whole] == bodies
    assert not any(r.bodies_dropped for r in whole)
    assert [list(r.sampled_token_ids) for r in whole] == [[10 + i, 11] for i in range(5)]
    store.close(session.key)
    store.forget(session.key)
    assert not spill_file.exists()
    store.spill.remove()
    assert not folder.exists()


async def test_a_watch_gets_spilled_records_whole():
    store = SessionStore(max_body_bytes=0)  # every body to the file
    session = store.open()
    _record(store, session, b"first request", b"first response")
    seen = []

    async def watch():
        async for record in session.watch():
            whole = session.whole(record)
            seen.append((whole.request_body, whole.response_body))

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(0)
    _record(store, session, b"second request", b"second response")
    store.close(session.key)
    await asyncio.wait_for(watcher, 5)
    assert seen == [(b"first request", b"first response"), (b"second request", b"second response")]
    assert all(not r.request_body for r in session.records)
    store.spill.remove()


async def test_bodies_that_cannot_be_spilled_are_dropped_with_a_marker_and_the_tokens_kept(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    store = SessionStore(max_body_bytes=10, spill=SpillFolder(str(not_a_folder)))
    session = store.open()
    _record(store, session, b"small", b"ok")  # 7 bytes: kept
    _record(store, session, b"a request too many", b"{}")
    _record(store, session, b"q", b"a")  # would fit, but the session is past its cap
    first, second, third = session.ordered_records()
    assert (first.request_body, first.bodies_dropped) == (b"small", False)
    for dropped in (second, third):
        assert (dropped.request_body, dropped.response_body, dropped.bodies_dropped) == (b"", b"", True)
        assert list(dropped.sampled_token_ids) == [5, 6, 7] and list(dropped.sampled_logprobs) == [-0.5] * 3


async def test_a_spill_file_gone_marks_the_bodies_dropped_when_read_back(tmp_path):
    store = SessionStore(max_body_bytes=0, spill=SpillFolder(str(tmp_path)))
    session = store.open()
    _record(store, session, b"request", b"response")
    for path in store.spill.path.iterdir():
        path.unlink()
    [record] = session.ordered_records()
    assert record.bodies_dropped and record.request_body == b"" and list(record.sampled_token_ids) == [5, 6, 7]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    calls=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2**31 - 1), max_size=300),  # prompt ids, held packed when any
            st.binary(max_size=300),
            st.binary(max_size=300),
        ),
        min_size=1,
        max_size=6,
    ),
    cap=st.integers(0, 1500),
)
def test_records_held_in_parts_come_back_as_the_records_they_were(tmp_path, calls, cap):
    """A record whose prompt ids the session holds packed and whose bodies went to the file (past a
    cap anywhere) reads back, parsed or serialized, as the record made whole in the first place."""
    store = SessionStore(max_body_bytes=cap, spill=SpillFolder(str(tmp_path)))
    session = store.open()
    expected = []
    for prompt, request, response in calls:
        record = _call(session)
        record.ClearField("prompt_token_ids")
        whole = common_pb2.CallRecord(request_body=request, response_body=response)
        whole.MergeFrom(record)
        whole.prompt_token_ids.extend(prompt)
        expected.append(whole)
        store.record(session, record, apart=RecordParts(packed_ids(prompt), request, response))
    assert all(not held.prompt_token_ids for held in session.records)
    assert session.ordered_records() == expected
    assert [common_pb2.CallRecord.FromString(session.serialized(held)) for held in session.in_order()] == expected
    store.close(session.key)
    store.forget(session.key)
    store.spill.remove()


# ------------------------------------------------------------------------------------- expiry


class FakeClock:
    """Unix epoch nanoseconds that move only when told."""

    def __init__(self) -> None:
        self.now_ns = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


async def test_a_session_idle_past_the_timeout_expires_and_is_forgotten_later():
    clock = FakeClock()
    store = SessionStore(clock=clock)
    idle, active = store.open(session_id="idle"), store.open(session_id="active")
    assert idle.opened_unix_ns == clock.now_ns
    clock.advance(3000)
    _record(store, active, b"{}", b"{}")  # a call renews the session
    clock.advance(601)
    assert store.expire_idle(3600) == 1
    assert idle.closed and idle.expired and idle.closed_unix_ns == clock.now_ns and not active.closed
    with pytest.raises(SessionClosed, match=r"session idle expired: the gateway closed it after 3601\.0 s without"):
        store.authorize(idle.key)
    assert idle.to_proto().expired and idle.to_proto().closed and not active.to_proto().expired
    # What it recorded stays readable until it is forgotten like any closed session.
    assert store.find("idle") is idle
    clock.advance(3599)
    assert store.forget_closed(3600) == 0
    clock.advance(2)
    assert store.forget_closed(3600) == 1
    with pytest.raises(UnknownSession):
        store.find("idle")
    assert store.authorize(active.key) is active  # 1 h 40 min after its call: not yet


async def test_a_call_in_flight_keeps_its_session_from_expiring():
    clock = FakeClock()
    store = SessionStore(clock=clock)
    session = store.open()
    record = _call(session)  # begun: in flight
    clock.advance(7200)
    assert store.expire_idle(3600) == 0 and not session.closed
    store.record(session, record)
    clock.advance(3599)
    assert store.expire_idle(3600) == 0
    clock.advance(2)
    assert store.expire_idle(3600) == 1 and session.expired


async def test_a_session_closed_by_its_owner_is_not_expired():
    clock = FakeClock()
    store = SessionStore(clock=clock)
    session = store.open()
    store.close(session.key)
    clock.advance(7200)
    assert store.expire_idle(3600) == 0 and not session.expired
    with pytest.raises(SessionClosed, match=r"is closed$"):
        store.authorize(session.key)
