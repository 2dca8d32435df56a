"""Recording sessions: keys, call records, the history calls render against, watchers, drain.

One `SessionStore` per gateway process, shared by the HTTP app (which authorises keys and records
calls) and the GatewayService servicer (which opens, closes, reads and watches sessions). Everything
runs on one event loop, so the store needs no locks; waiting (watchers, drain) uses asyncio primitives.

A call's life in its session: `begin_call()` when the prompt is about to go to the engine (this gives
its id, "c0001", … in arrival order, and counts it in flight), then exactly one `finish_call()` with its
`CallRecord`, and, when the client received the reply, the `PriorCall` later requests render against.
A closed session refuses its key for new calls, but calls in flight still finish and are recorded.
A session may carry its task's `SamplingPolicy` (gateway/sampling.py), which the core applies to each
call; `sampled_tokens` counts what its calls sampled, as the tokens arrive, for the policy's budget.

Records are held in parts: the request and response bodies apart, as the gateway received and sent
them, in memory up to the session's cap and past it in a file (gateway/body_store.py), and the prompt ids
of the gateway's own calls packed, as the engine was sent them. Every record leaves the store whole
(`whole` parsed, `serialized` for the wire).

Bounds, so that a gateway serving for weeks holds what its sessions need and no more: a session keeps
its calls' request and response bodies in memory up to a cap and spills the rest; an open session with
no call for the idle timeout is closed as expired (`expire_idle`, run by the gateway's sweeper), and
closed sessions are forgotten after a retention (`forget_closed`). Time comes from the store's clock
(Unix epoch nanoseconds), which tests replace.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from gateway.body_decoder import KnownConversations
from gateway.body_store import DEFAULT_MAX_SESSION_BODY_BYTES, SessionBodies, SpillFolder
from gateway.render import History, PriorCall, PriorCalls
from polar.codec import length_delimited_header
from polar.sampling_policy import NO_POLICY, SamplingPolicy
from polar.v1 import common_pb2, gateway_pb2

# 32 random bytes: far past the 128 bits the contract asks for, and URL-safe for `?key=`.
KEY_BYTES = 32
KEY_PREFIX = "polar-"

PROMPT_FIELD = common_pb2.CallRecord.PROMPT_TOKEN_IDS_FIELD_NUMBER

HISTORY_TO_PROTO = {"faithful": gateway_pb2.HISTORY_POLICY_FAITHFUL, "template": gateway_pb2.HISTORY_POLICY_TEMPLATE}
HISTORY_FROM_PROTO: dict[int, History] = {
    gateway_pb2.HISTORY_POLICY_FAITHFUL: "faithful",
    gateway_pb2.HISTORY_POLICY_TEMPLATE: "template",
}


class SessionError(Exception):
    """A session operation that cannot be done; subclasses say why."""


class UnknownSession(SessionError, LookupError):
    """No session has that key or id."""


class SessionClosed(SessionError):
    """The session was closed (or expired): its key is refused."""


class SessionExists(SessionError):
    """A session with the requested id is already open on this node."""


class Draining(SessionError):
    """The node is draining and opens no new sessions."""


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def call_id_for(index: int) -> str:
    """The id of a session's index-th call (1-based), ordered as the contract shows: c0001, c0002, …"""
    return f"c{index:04d}"


@dataclass(frozen=True)
class RecordParts:
    """What a call's record leaves out, held by its session beside it: the prompt ids packed, as the
    engine was sent them, and the request and response bodies, as the gateway received and sent them.
    Parsing 20k ids or copying 80 kB into a record, and writing them out again for every reader, cost
    more than the rest of recording the call."""

    prompt: bytes = b""
    request_body: bytes = b""
    response_body: bytes = b""


@dataclass
class Session:
    """One harness run: its key, its recorded calls, and what renders against them."""

    session_id: str
    key: str
    bodies: SessionBodies  # its records' request and response bodies: in memory to a cap, then a file
    history: History = "faithful"
    task_id: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    sampling: SamplingPolicy = NO_POLICY
    adapter: str = ""  # the LoRA adapter its calls sample with (GenerateRequest.adapter); "" = the default
    clock: Callable[[], int] = time.time_ns  # Unix epoch nanoseconds (the store's)
    opened_unix_ns: int = 0  # 0: now, by the clock
    closed_unix_ns: int = 0
    # When a call last began or finished (or the session opened): what idle expiry measures from.
    last_active_unix_ns: int = 0
    expired: bool = False  # closed by expire_idle, not by its owner
    # Its records as held: bodies left out (in `bodies`), and the prompt ids of the gateway's own
    # left out too, held packed in `prompts`; `whole` and `serialized` put both back.
    records: list[common_pb2.CallRecord] = field(default_factory=list)
    # Its conversations as its latest calls sent them, read once (gateway/body_decoder.py).
    conversations: KnownConversations = field(default_factory=KnownConversations)
    # Packed prompt ids (polar.codec.packed_ids) by call id (RecordParts.prompt), which leave the
    # gateway as they are.
    prompts: dict[str, bytes] = field(default_factory=dict)
    # Calls whose reply the client received, in completion order: what later prompts extend.
    prior_calls: PriorCalls = field(default_factory=PriorCalls)
    in_flight: int = 0
    # Tokens sampled by the session's calls so far, those in flight included (the policy's budget).
    sampled_tokens: int = 0
    _calls_begun: int = 0
    _watchers: list[asyncio.Queue[common_pb2.CallRecord | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.opened_unix_ns = self.opened_unix_ns or self.clock()
        self.last_active_unix_ns = self.last_active_unix_ns or self.opened_unix_ns

    @property
    def closed(self) -> bool:
        return self.closed_unix_ns != 0

    @property
    def finished(self) -> bool:
        """Closed, and its last call recorded: nothing more will ever be appended."""
        return self.closed and self.in_flight == 0

    def begin_call(self) -> str:
        self._calls_begun += 1
        self.in_flight += 1
        self.last_active_unix_ns = self.clock()
        return call_id_for(self._calls_begun)

    def count_sampled(self, tokens: int) -> None:
        """A call of this session received `tokens` more sampled tokens from the engine."""
        self.sampled_tokens += tokens

    def finish_call(
        self, record: common_pb2.CallRecord, prior: PriorCall | None = None, apart: RecordParts = RecordParts()
    ) -> None:
        """`apart`: what the record leaves out, which the session holds beside it."""
        self.in_flight -= 1
        self.last_active_unix_ns = self.clock()
        self.bodies.keep(record, apart.request_body, apart.response_body)
        self.records.append(record)
        if apart.prompt:
            self.prompts[record.call_id] = apart.prompt
        if prior is not None:
            self.prior_calls.add(prior)
        for queue in self._watchers:
            queue.put_nowait(record)
        self._end_watchers_if_finished()

    def in_order(self) -> list[common_pb2.CallRecord]:
        """Its records as held, in arrival order (concurrent calls may complete out of it)."""
        return sorted(self.records, key=lambda record: record.call_id)

    def ordered_records(self) -> list[common_pb2.CallRecord]:
        """Whole records (bodies and prompt ids included) in arrival order."""
        return [self.whole(record) for record in self.in_order()]

    def serialized(self, record: common_pb2.CallRecord) -> bytes:
        """A record of the session whole, serialized: what it holds, then the fields held apart
        (protobuf reads fields in any order, and a message's fields concatenate)."""
        prompt = self.prompts.get(record.call_id)
        parts = [record.SerializeToString(), self.bodies.missing_fields(record)]
        if prompt:
            parts += (length_delimited_header(PROMPT_FIELD, len(prompt)), prompt)
        return b"".join(parts)

    def whole(self, record: common_pb2.CallRecord) -> common_pb2.CallRecord:
        """A record of the session whole: itself when it holds everything, else a parsed copy."""
        if record.call_id not in self.prompts and not self.bodies.held(record):
            return record
        return common_pb2.CallRecord.FromString(self.serialized(record))

    def close(self, *, expired: bool = False) -> None:
        if not self.closed:
            self.closed_unix_ns = self.clock()
            self.expired = expired
        self._end_watchers_if_finished()

    def to_proto(self) -> gateway_pb2.Session:
        return gateway_pb2.Session(
            session_id=self.session_id,
            key=self.key,
            task_id=self.task_id,
            closed=self.closed,
            call_count=len(self.records),
            opened_unix_ns=self.opened_unix_ns,
            closed_unix_ns=self.closed_unix_ns,
            history=HISTORY_TO_PROTO[self.history],
            metadata=dict(self.metadata),
            sampling=self.sampling.to_proto(),
            expired=self.expired,
            adapter=self.adapter,
        )

    async def watch(self) -> AsyncIterator[common_pb2.CallRecord]:
        """Every record as held (`whole` and `serialized` complete it), those already there first,
        then each new one; ends once the session finished."""
        queue: asyncio.Queue[common_pb2.CallRecord | None] = asyncio.Queue()
        for record in self.in_order():
            queue.put_nowait(record)
        if self.finished:
            queue.put_nowait(None)
        else:
            self._watchers.append(queue)
        try:
            while (record := await queue.get()) is not None:
                yield record
        finally:
            if queue in self._watchers:
                self._watchers.remove(queue)

    def _end_watchers_if_finished(self) -> None:
        if self.finished:
            for queue in self._watchers:
                queue.put_nowait(None)
            self._watchers.clear()


@dataclass
class CallCounts:
    """What the recorded calls hold, summed, for /metrics."""

    failed: int = 0  # ended in an error (the engine's, a timeout, a refused prompt)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, record: common_pb2.CallRecord) -> None:
        self.failed += record.finish_reason == common_pb2.FINISH_REASON_ERROR or bool(record.error)
        self.prompt_tokens += record.usage.prompt_tokens
        self.completion_tokens += record.usage.completion_tokens


class SessionStore:
    """Every session of this gateway, by key and by id."""

    def __init__(
        self,
        default_history: History = "faithful",
        *,
        max_body_bytes: int = DEFAULT_MAX_SESSION_BODY_BYTES,
        spill: SpillFolder | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        """`max_body_bytes`: the request and response bodies each session keeps in memory, the rest
        going to `spill` (a private temporary folder when None); `clock`: Unix epoch nanoseconds."""
        if default_history not in ("faithful", "template"):
            raise ValueError(f"history must be 'faithful' or 'template', not {default_history!r}")
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, not {max_body_bytes}")
        self.default_history: History = default_history
        self.max_body_bytes = max_body_bytes
        self.spill = spill if spill is not None else SpillFolder()
        self.clock = clock
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, Session] = {}
        self._changed = asyncio.Event()
        self.draining = False
        self.calls_total = 0
        self.counts = CallCounts()  # for /metrics (polar.metrics)

    def open(
        self,
        *,
        session_id: str = "",
        task_id: str = "",
        history: History | None = None,
        metadata: Mapping[str, str] | None = None,
        sampling: SamplingPolicy = NO_POLICY,
        adapter: str = "",
    ) -> Session:
        """A new session; `history` None takes the gateway's default policy; `sampling` is applied to
        every call (ValueError naming each field out of range)."""
        if self.draining:
            raise Draining("the gateway is draining: it opens no new sessions")
        history = history or self.default_history
        if history not in ("faithful", "template"):
            raise ValueError(f"history must be 'faithful' or 'template', not {history!r}")
        if problems := sampling.problems():
            raise ValueError("; ".join(problems))
        if session_id and session_id in self._by_id:
            raise SessionExists(f"a session with id {session_id!r} already exists")
        key = new_key()
        session = Session(
            session_id=session_id or f"s-{secrets.token_hex(8)}",
            key=key,
            bodies=SessionBodies(self.spill, self.max_body_bytes),
            history=history,
            task_id=task_id,
            metadata=dict(metadata or {}),
            sampling=sampling,
            adapter=adapter,
            clock=self.clock,
        )
        self._by_key[key] = session
        self._by_id[session.session_id] = session
        return session

    def find(self, key_or_id: str) -> Session:
        """The session with this key or id, open or closed."""
        session = self._by_key.get(key_or_id) or self._by_id.get(key_or_id)
        if session is None:
            raise UnknownSession(f"no session has the key or id {_redacted(key_or_id)!r}")
        return session

    def authorize(self, key: str | None) -> Session:
        """The open session whose key this is; ids are not keys."""
        session = self._by_key.get(key) if key else None
        if session is None:
            raise UnknownSession("missing or unknown session key" if key else "no session key was given")
        if session.expired:
            idle_s = (session.closed_unix_ns - session.last_active_unix_ns) / 1e9
            raise SessionClosed(
                f"session {session.session_id} expired: the gateway closed it after {idle_s:.1f} s without a call"
            )
        if session.closed:
            raise SessionClosed(f"session {session.session_id} is closed")
        return session

    def close(self, key_or_id: str) -> Session:
        """Close a session (its owner is done with it): its key is refused from now on."""
        session = self.find(key_or_id)
        session.close()
        self._changed.set()
        return session

    def forget(self, key_or_id: str) -> None:
        """Drop a closed session and its records from memory (once its results are safe elsewhere)."""
        session = self.find(key_or_id)
        if not session.closed:
            raise SessionError(f"session {session.session_id} is still open")
        del self._by_key[session.key]
        del self._by_id[session.session_id]
        session.bodies.discard()

    def expire_idle(self, idle_s: float) -> int:
        """Close, as expired, every open session with no call in flight whose last call began or
        finished (or which opened) more than `idle_s` ago; returns how many."""
        cutoff = self.clock() - int(idle_s * 1e9)
        idle = [s for s in self._by_id.values() if not s.closed and not s.in_flight and s.last_active_unix_ns < cutoff]
        for session in idle:
            session.close(expired=True)
        if idle:
            self._changed.set()
        return len(idle)

    def forget_closed(self, older_than_s: float, now_ns: int | None = None) -> int:
        """Forget every finished session closed more than `older_than_s` ago; returns how many."""
        cutoff = (self.clock() if now_ns is None else now_ns) - int(older_than_s * 1e9)
        stale = [s.session_id for s in self._by_id.values() if s.finished and s.closed_unix_ns < cutoff]
        for session_id in stale:
            self.forget(session_id)
        return len(stale)

    def record(
        self,
        session: Session,
        record: common_pb2.CallRecord,
        prior: PriorCall | None = None,
        apart: RecordParts = RecordParts(),
    ) -> None:
        """Record a call of the session (`Session.finish_call`)."""
        session.finish_call(record, prior, apart)
        self.calls_total += 1
        self.counts.add(record)

    def open_sessions(self) -> int:
        return sum(not session.closed for session in self._by_id.values())

    def calls_in_flight(self) -> int:
        return sum(session.in_flight for session in self._by_id.values())

    async def drain(self, timeout_s: float) -> int:
        """Open no more sessions; wait up to timeout_s for the open ones to close; return those left."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + max(0.0, timeout_s)
        while self.open_sessions() and (remaining := deadline - asyncio.get_running_loop().time()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                break
        return self.open_sessions()


def _redacted(key_or_id: str) -> str:
    # Error messages may reach logs: never echo a whole key back.
    return key_or_id[: len(KEY_PREFIX) + 4] + "…" if key_or_id.startswith(KEY_PREFIX) else key_or_id
