"""The contract between the gateway core and one API dialect.

A dialect is pure translation: a request body in its shape → a `DialectRequest`; a finished
`DialectResult` → a response body in its shape; parse events → that dialect's streaming events; a
`GatewayError` → its error body and status. It never touches sessions, tokens, engines or sockets:
the core (gateway/core.py) owns session lookup, rendering to token ids, generation, stop strings and
recording, and calls these hooks in this order:

    request = dialect.parse_request(body, route)           # GatewayError(INVALID_REQUEST, …) on bad input
    ...render, generate...
    non-streaming: dialect.render_response(request, result)
    streaming:     renderer = dialect.stream_renderer(request, call)
                   renderer.start(); renderer.events(ev) for each parse event; renderer.finish(result)
                   or, once started, renderer.error(err) — which must still end the stream properly
    any failure:   dialect.error_response(err) -> (status, body)

Every dialect module (openai_chat, openai_responses, anthropic, gemini) has the same skeleton and the
same private names: `_conversation`, `_sampling`, `_tools`, `_tool_choice`, `_finish`, `_usage`,
`_StreamRenderer` (its StreamRenderer; the core's `_StreamWriter` sends what it renders). Each reads
its request through the JSON checks of `gateway.dialects.validation`, worded as that API words its
errors. Records here are frozen; dialect-specific data the response must echo travels opaque in
`DialectRequest.echo`.
"""

from __future__ import annotations

import abc
import enum
import json
import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import orjson

from gateway.conversation import Conversation
from gateway.parsers import ParsedOutput, ParseEvent


class ErrorKind(enum.Enum):
    """What went wrong, independent of any dialect; each dialect maps it to its status and type."""

    INVALID_REQUEST = "invalid_request"  # malformed JSON, wrong types, missing fields: 400
    UNSUPPORTED_CONTENT = "unsupported_content"  # images, audio, files (text-only gateway): 400
    CONTEXT_LENGTH = "context_length"  # the prompt alone does not fit the context: 400
    AUTHENTICATION = "authentication"  # missing, unknown or closed session key: 401
    NOT_FOUND = "not_found"  # unknown route or model: 404
    OVERLOADED = "overloaded"  # inference server down or refusing: 503 (Anthropic: 529 overloaded_error)
    INTERNAL = "internal"  # a bug or an engine failure: 500, without a traceback


class GatewayError(Exception):
    """An error to report to the client in its own dialect."""

    def __init__(self, kind: ErrorKind, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param  # the offending field, in the dialect's own path notation, when known


class ContextLengthError(GatewayError):
    """The prompt does not fit the served model's context. Each dialect words it as its API does, with
    both numbers: clients read them (Claude Code takes the gap from "N tokens > M maximum" to decide
    how much history to drop)."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            ErrorKind.CONTEXT_LENGTH,
            f"the prompt is {prompt_tokens} tokens; the model's context holds {context_length} "
            "(prompt and output together)",
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt that fits: the context less the one token an output needs at least."""
        return self.context_length - 1


class FinishKind(enum.Enum):
    """Why the output ended, as the dialects need to tell it."""

    STOP = "stop"  # the model ended its turn
    TOOL_CALLS = "tool_calls"  # the model ended its turn and the output holds tool calls
    STOP_SEQUENCE = "stop_sequence"  # a client stop string was produced (it is not in the content)
    LENGTH = "length"  # the client's max tokens were reached
    CONTEXT_LENGTH = "context_length"  # the context window filled (a clamped max tokens was reached)
    ABORTED = "aborted"  # generation was cut short (only seen in records, never by a client)


@dataclass(frozen=True)
class Sampling:
    """Sampling as the client asked for it; None means the dialect's default."""

    max_tokens: int | None = None  # None: as many as the context leaves
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first one produced
    seed: int | None = None


@dataclass(frozen=True)
class Route:
    """What the URL and headers said, beyond the body."""

    path: str  # e.g. "/v1/chat/completions", "/v1beta/models/gemini-2.5-pro:streamGenerateContent"
    model: str | None = None  # from the path (Gemini), None otherwise
    stream: bool | None = None  # from the path (Gemini's :streamGenerateContent), None otherwise
    query: Mapping[str, str] = field(default_factory=dict)  # e.g. {"alt": "sse"}, {"beta": "true"}


@dataclass(frozen=True)
class DialectRequest:
    """One request, understood."""

    model: str  # as the client named it; echoed back in responses
    conversation: Conversation
    sampling: Sampling
    stream: bool
    # Tool calls in the output are parsed as tool calls (False when the client disabled tools).
    parse_tool_calls: bool = True
    # The JSON schema the reply must follow (OpenAI response_format / text.format json_schema, Gemini
    # responseSchema); None: free text. Kept by constrained decoding (gateway/request_constraint.py).
    output_schema: Mapping[str, Any] | None = None
    # Dialect-specific fields its responses echo (e.g. Responses' instructions or metadata, Anthropic's
    # stop_sequences); the core never reads them.
    echo: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # every token given to the engine, forced ones included
    completion_tokens: int  # tokens the engine sampled


@dataclass(frozen=True)
class CallInfo:
    """The identity of one call, known before its first token."""

    call_id: str  # unique per gateway; response ids and tool-call ids derive from it
    created: int  # Unix seconds when the request arrived
    prompt_tokens: int  # known once rendered, before generation


@dataclass(frozen=True)
class DialectResult:
    """One finished call, understood."""

    call: CallInfo
    output: ParsedOutput
    finish: FinishKind
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it, for FinishKind.STOP_SEQUENCE


class StreamRenderer(abc.ABC):
    """Turns one call's parse events into the dialect's streaming bytes, incrementally.

    Each method returns the bytes to send now (possibly none). The core sends them immediately.
    """

    media_type: str = "text/event-stream"

    @abc.abstractmethod
    def start(self) -> list[bytes]:
        """Events that open the stream (sent before the first token)."""

    @abc.abstractmethod
    def events(self, event: ParseEvent) -> list[bytes]:
        """Events for one parse event."""

    @abc.abstractmethod
    def finish(self, result: DialectResult) -> list[bytes]:
        """Closing events, usage and the terminator."""

    @abc.abstractmethod
    def error(self, error: GatewayError) -> list[bytes]:
        """The dialect's in-stream error event and terminator, after start() was sent."""


class Dialect(abc.ABC):
    """One API dialect: pure translation between its wire shapes and the core's records."""

    name: str  # e.g. "openai_chat"; also the CallRecord dialect via `record_dialect`
    record_dialect: int  # polar.v1.Dialect value recorded with each call

    @abc.abstractmethod
    def parse_request(self, body: Any, route: Route) -> DialectRequest:
        """Validate and translate a decoded JSON body; raise GatewayError for anything invalid."""

    @abc.abstractmethod
    def render_response(self, request: DialectRequest, result: DialectResult) -> dict[str, Any]:
        """The non-streaming response body."""

    @abc.abstractmethod
    def stream_renderer(self, request: DialectRequest, call: CallInfo) -> StreamRenderer:
        """A renderer for one streaming response."""

    @abc.abstractmethod
    def error_response(self, error: GatewayError) -> tuple[int, dict[str, Any]]:
        """HTTP status and body for an error, in the dialect's error shape."""


Converted = TypeVar("Converted")

# Values a dialect keeps its conversions of: a few harnesses' tools.
BY_IDENTITY_ENTRIES = 16


class ByIdentity(Generic[Converted]):
    """A conversion of a request's values that remembers its last few results by the identity of the
    value converted.

    `gateway.body_decoder.BodyDecoder` hands every body that repeats a known value (a harness's tools)
    the same object, which nothing changes, so a dialect converts it once rather than on every call.
    An entry holds its value, whose id no other object can take while the entry lives. A conversion
    that raises is not remembered, and raises again for the next call.
    """

    def __init__(self, convert: Callable[[Any], Converted], entries: int = BY_IDENTITY_ENTRIES) -> None:
        self._convert = convert
        self._entries = entries
        self._results: OrderedDict[int, tuple[Any, Converted]] = OrderedDict()

    def __call__(self, value: Any) -> Converted:
        held = self._results.get(id(value))
        if held is not None:
            self._results.move_to_end(id(value))
            return held[1]
        result = self._convert(value)
        self._results[id(value)] = (value, result)
        if len(self._results) > self._entries:
            self._results.popitem(last=False)
        return result


State = TypeVar("State")

# Conversations a dialect keeps its conversion of: the latest call of a few hundred sessions.
FOLD_ENTRIES = 512


@dataclass(frozen=True)
class _Folded(Generic[State]):
    items: tuple[Any, ...]
    state: State


class ConversationFold(Generic[State]):
    """A dialect's conversion of a conversation's items, one item at a time, that resumes after the
    longest run of leading items it converted before: the same objects, in the same order.

    A harness sends its whole conversation with every call; `gateway.body_decoder.BodyDecoder` hands a
    session's later call the items its earlier call sent, as the same objects, so converting only the
    new items keeps a call's cost to what it adds. `start()` makes the state before any item,
    `step(state, index, item)` converts one item into it (raising GatewayError for a bad one), and
    `copy(state)` copies a state so that a kept one is never changed. The conversion must depend on
    the items alone, which holds while nothing changes a decoded body. Kept by the identity of the
    last item; an entry holds its items, so their ids are theirs while it lives.
    """

    def __init__(
        self,
        start: Callable[[], State],
        step: Callable[[State, int, Any], None],
        copy: Callable[[State], State],
        entries: int = FOLD_ENTRIES,
    ) -> None:
        self._start, self._step, self._copy = start, step, copy
        self._entries = entries
        self._folded: OrderedDict[int, _Folded[State]] = OrderedDict()

    def __call__(self, items: list[Any]) -> State:
        """The state after every item (kept: read it, never change it)."""
        done, state = self._resume(items)
        for index in range(done, len(items)):
            self._step(state, index, items[index])
        if items:
            self._folded[id(items[-1])] = _Folded(tuple(items), state)
            self._folded.move_to_end(id(items[-1]))
            if len(self._folded) > self._entries:
                self._folded.popitem(last=False)
        return state

    def _resume(self, items: list[Any]) -> tuple[int, State]:
        for count in range(len(items), 0, -1):
            folded = self._folded.get(id(items[count - 1]))
            if folded is not None and len(folded.items) == count and all(map(operator.is_, folded.items, items)):
                if count == len(items):
                    return count, folded.state
                return count, self._copy(folded.state)
        return 0, self._start()


def json_bytes(body: Any) -> bytes:
    """`body` as compact UTF-8 JSON, as a reply or an event carries it (never a prompt's text).

    orjson writes it in a tenth of the standard library's time, which counts where a reply echoes
    the request: a Responses reply holds its instructions and tools (Codex's: 40 kB), and a stream
    sends them twice more. What orjson refuses (an integer past 64 bits, a key that is not a string)
    the standard library writes, as before. A float that is not finite, which no reply holds,
    would be written null, valid JSON, where the standard library writes NaN, which is not.
    """
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; `data` is JSON-encoded unless it is already a string."""
    head = f"event: {event}\ndata: " if event else "data: "
    text = data.encode() if isinstance(data, str) else json_bytes(data)
    return head.encode() + text + b"\n\n"
