"""A minimal dialect for testing the core through real routes, before and beside the real dialects.

Its wire shape is deliberately small: `{"messages": [{"role", "content", "tool_calls"?}], "tools"?,
"tool_choice"?, "stream"?, "max_tokens"?, "stop"?}` in; out, the parsed output, finish and usage;
streams send one SSE event per parse event. Errors: `{"error": {"kind", "message"}}`.

And `HangingEngine`, the scripted engine gone quiet: an inference server that stops sending.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from gateway.conversation import Conversation, Message, ToolCall, ToolChoice, ToolSpec
from gateway.dialects.base import (
    CallInfo,
    Dialect,
    DialectRequest,
    DialectResult,
    ErrorKind,
    GatewayError,
    Route,
    Sampling,
    StreamRenderer,
    sse,
)
from gateway.parsers import ParseEvent
from polar.inference.engines.base import GenerationEnd, GenerationRequest, TokenChunk
from polar.inference.engines.scripted import ScriptedEngine
from polar.v1 import common_pb2

STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.UNSUPPORTED_CONTENT: 400,
    ErrorKind.CONTEXT_LENGTH: 400,
    ErrorKind.AUTHENTICATION: 401,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.INTERNAL: 500,
}


def _message(entry: Any) -> Message:
    if not isinstance(entry, dict) or not isinstance(entry.get("content", ""), str):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "a message is an object with string content")
    calls = tuple(ToolCall(c.get("id", ""), c["name"], c["arguments"]) for c in entry.get("tool_calls", ()))
    try:
        return Message(entry.get("role", "user"), entry.get("content", ""), tool_calls=calls)
    except ValueError as exc:
        raise GatewayError(ErrorKind.INVALID_REQUEST, str(exc)) from exc


def _tool_choice(value: Any) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice.auto()
    if value == "required":
        return ToolChoice.required()
    return ToolChoice.function(value["name"])


class FakeDialect(Dialect):
    name = "fake"
    record_dialect = common_pb2.DIALECT_OPENAI_CHAT

    def parse_request(self, body: Any, route: Route) -> DialectRequest:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "messages must be a non-empty list", param="messages")
        tools = tuple(ToolSpec(t["name"]) for t in body.get("tools", ()))
        conversation = Conversation(tuple(_message(m) for m in messages), tools, _tool_choice(body.get("tool_choice")))
        sampling = Sampling(max_tokens=body.get("max_tokens"), stop=tuple(body.get("stop", ())), temperature=0.0)
        return DialectRequest(body.get("model", "m"), conversation, sampling, bool(body.get("stream")))

    def render_response(self, request: DialectRequest, result: DialectResult) -> dict[str, Any]:
        output = result.output
        return {
            "id": result.call.call_id,
            "content": output.content,
            "reasoning": output.reasoning,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in output.tool_calls],
            "finish": result.finish.value,
            "stop_sequence": result.stop_sequence,
            "usage": asdict(result.usage),
        }

    def stream_renderer(self, request: DialectRequest, call: CallInfo) -> StreamRenderer:
        return _StreamRenderer(self, request)

    def error_response(self, error: GatewayError) -> tuple[int, dict[str, Any]]:
        return STATUS[error.kind], {"error": {"kind": error.kind.value, "message": error.message}}


class HookOrderError(AssertionError):
    """The core called a renderer hook out of the contract's order (start, events, finish or error)."""


class _StreamRenderer(StreamRenderer):
    def __init__(self, dialect: FakeDialect, request: DialectRequest) -> None:
        self._dialect = dialect
        self._request = request
        self._started = False

    def start(self) -> list[bytes]:
        self._started = True
        return [sse({"type": "start"})]

    def events(self, event: ParseEvent) -> list[bytes]:
        if not self._started:
            raise HookOrderError("events() before start()")
        return [sse({"type": type(event).__name__, **asdict(event)})]

    def finish(self, result: DialectResult) -> list[bytes]:
        if not self._started:
            raise HookOrderError("finish() before start()")
        return [sse({"type": "finish", **self._dialect.render_response(self._request, result)}), sse("[DONE]")]

    def error(self, error: GatewayError) -> list[bytes]:
        return [sse({"type": "error", **self._dialect.error_response(error)[1]}), sse("[DONE]")]


def read_sse(text: str) -> list[Any]:
    """The data of each event of an SSE body, JSON-decoded where it is JSON."""
    events = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


class HangingEngine(ScriptedEngine):
    """The scripted engine, hung: while `hang_after` is set, each generation sends that many chunks
    of its scripted output (one token each with the script's delay_seconds) and then nothing at all
    until it is cancelled, which `cancelled` counts."""

    hang_after: int | None = None
    cancelled = 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        stream = super().generate(request)
        try:
            sent = 0
            async for item in stream:
                if self.hang_after is not None and sent >= self.hang_after:
                    try:
                        await asyncio.Event().wait()  # never set
                    except asyncio.CancelledError:
                        self.cancelled += 1
                        raise
                yield item
                sent += 1
        finally:
            await stream.aclose()
