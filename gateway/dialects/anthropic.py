"""Anthropic Messages: `POST /v1/messages` (also `?beta=true`) and `POST /v1/messages/count_tokens`.

System prompts, text, thinking, tool_use and tool_result blocks are read into the conversation; the
result is written back as thinking, text and tool_use blocks, streamed as the Messages event grammar.
What is accepted, ignored and refused, and the error shape Claude Code relies on:
docs/design/dialects.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.conversation import Conversation, Message, ToolCall, ToolChoice, ToolSpec
from gateway.dialects.base import (
    ByIdentity,
    CallInfo,
    ContextLengthError,
    ConversationFold,
    Dialect,
    DialectRequest,
    DialectResult,
    ErrorKind,
    FinishKind,
    GatewayError,
    Route,
    Sampling,
    StreamRenderer,
    Usage,
    sse,
)
from gateway.dialects.validation import INT32_MAX, Checks, Wording
from gateway.parsers import (
    ParsedOutput,
    ParseEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from polar.v1 import common_pb2

COUNT_TOKENS_SUFFIX = "/messages/count_tokens"
# Blocks that exist in the Messages API but belong to one role only: misplaced, they are a plain 400,
# whereas any other unknown type is content this text-only gateway does not serve.
_ROLE_BLOCKS = {
    "user": {"text", "tool_result"},
    "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
}
_MISPLACED_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking"}


# ---------------------------------------------------------------------------------------------------
# Validation: the shared checks, worded as Anthropic's errors; the path is put before the message by
# _error_body, so a message here is only what is wrong (`expected a string`).
# ---------------------------------------------------------------------------------------------------


class _Wording(Wording):
    def wrong_type(self, path: str, expected: str, value: Any) -> str:
        article = "an" if expected[0] in "aeiou" else "a"
        return f"expected {article} {expected}"

    def missing(self, path: str, expected: str) -> str:
        return "field required"

    def bad_value(self, path: str, reason: str) -> str:
        return reason

    def duplicate_tool(self, path: str, name: str) -> str:
        return f"tool names must be unique; {name!r} is repeated"


_check = Checks(_Wording())
_invalid = _check.invalid


def _block_type(block: Any, param: str) -> tuple[dict[str, Any], str]:
    block = _check.object(block, param)
    return block, _check.string(block.get("type"), f"{param}.type", nonempty=True)


def _unsupported(kind: str, param: str) -> GatewayError:
    return GatewayError(
        ErrorKind.UNSUPPORTED_CONTENT,
        f"content blocks of type {kind!r} are not supported: this gateway serves text, tool use and thinking only",
        param=param,
    )


def _text(value: Any, param: str) -> str:
    """A string, or text blocks joined with newlines (system prompts, tool results)."""
    if isinstance(value, str):
        return value
    parts = []
    for j, block in enumerate(_check.array(value, param)):
        block, kind = _block_type(block, f"{param}.{j}")
        if kind != "text":
            raise _unsupported(kind, f"{param}.{j}.type")
        parts.append(_check.string(block.get("text"), f"{param}.{j}.text"))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# Request → conversation, tools, sampling
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Turns:
    """The conversation so far, as `messages` items are converted."""

    system: list[str] = field(default_factory=list)  # text of system messages among the items
    turns: list[Message] = field(default_factory=list)
    tool_names: dict[str, str] = field(default_factory=dict)  # tool_use id → name, for the tool turns

    def copy(self) -> _Turns:
        return _Turns(list(self.system), list(self.turns), dict(self.tool_names))


def _message(state: _Turns, i: int, raw: Any) -> None:
    param = f"messages.{i}"
    raw = _check.object(raw, param)
    role = _check.string(raw.get("role"), f"{param}.role")
    if "content" not in raw:
        raise _invalid(f"{param}.content", "field required")
    content = raw["content"]
    if role == "system":
        state.system.append(_text(content, f"{param}.content"))
    elif role == "user":
        state.turns.extend(_user_turns(content, f"{param}.content", state.tool_names))
    elif role == "assistant":
        turn = _assistant_turn(content, f"{param}.content")
        state.tool_names.update((call.id, call.name) for call in turn.tool_calls)
        state.turns.append(turn)
    else:
        raise _invalid(f"{param}.role", f"must be 'user' or 'assistant', not {role!r}")


# A session's messages, converted once each: a later call converts only what it adds.
_messages = ConversationFold(_Turns, _message, _Turns.copy)


def _conversation(body: dict[str, Any], tools: tuple[ToolSpec, ...], choice: ToolChoice) -> Conversation:
    system = [_text(body["system"], "system")] if body.get("system") is not None else []
    state = _messages(_check.array(body.get("messages"), "messages"))
    if not state.turns:
        raise _invalid("messages", "at least one user or assistant message is required")
    system_prompt = "\n".join(part for part in (*system, *state.system) if part)
    head = (Message("system", system_prompt),) if system_prompt else ()
    return Conversation(head + tuple(state.turns), tools, choice)


def _user_turns(content: Any, param: str, tool_names: dict[str, str]) -> list[Message]:
    if isinstance(content, str):
        return [Message("user", content)]
    turns: list[Message] = []
    texts: list[str] = []  # consecutive text blocks, one user message

    def flush() -> None:
        if texts:
            turns.append(Message("user", "\n".join(texts)))
            texts.clear()

    blocks = _check.array(content, param)
    if not blocks:
        # Anthropic refuses a user message without blocks; taken as an empty prompt turn here, it
        # would put a turn the real API never accepts into the recorded trajectory.
        raise _invalid(param, "a user message needs at least one content block")
    for j, block in enumerate(blocks):
        block, kind = _block_type(block, f"{param}.{j}")
        _check_role(kind, "user", f"{param}.{j}.type")
        if kind == "text":
            texts.append(_check.string(block.get("text"), f"{param}.{j}.text"))
            continue
        flush()
        call_id = _check.string(block.get("tool_use_id"), f"{param}.{j}.tool_use_id", nonempty=True)
        result = "" if block.get("content") is None else _text(block["content"], f"{param}.{j}.content")
        _check.field(block, "is_error", "boolean", f"{param}.{j}.is_error")
        turns.append(Message("tool", result, tool_call_id=call_id, name=tool_names.get(call_id, "")))
    flush()
    return turns


def _assistant_turn(content: Any, param: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(_check.array(content, param)):
        block, kind = _block_type(block, f"{param}.{j}")
        _check_role(kind, "assistant", f"{param}.{j}.type")
        if kind == "text":
            text.append(_check.string(block.get("text"), f"{param}.{j}.text"))
        elif kind == "thinking":
            reasoning.append(_check.string(block.get("thinking"), f"{param}.{j}.thinking"))
        elif kind == "redacted_thinking":
            _check.string(block.get("data"), f"{param}.{j}.data")
        else:
            call_id = _check.string(block.get("id"), f"{param}.{j}.id", nonempty=True)
            name = _check.string(block.get("name"), f"{param}.{j}.name", nonempty=True)
            arguments = _check.object(block.get("input"), f"{param}.{j}.input")
            calls.append(ToolCall(call_id, name, arguments))
    return Message("assistant", "".join(text), "".join(reasoning), tuple(calls))


def _check_role(kind: str, role: str, param: str) -> None:
    if kind in _ROLE_BLOCKS[role]:
        return
    if kind in _MISPLACED_BLOCKS:
        raise _invalid(param, f"{kind!r} blocks cannot appear in {role} messages")
    raise _unsupported(kind, param)


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    paths: list[str] = []  # where each spec's name is, in the raw list that skipped tools are part of
    for i, raw in enumerate(_check.array(value, "tools", optional=True) or ()):
        param = f"tools.{i}"
        raw = _check.object(raw, param)
        if raw.get("type") not in (None, "custom"):
            _check.string(raw["type"], f"{param}.type")
            continue  # an Anthropic-defined tool: see the module docstring
        name = _check.string(raw.get("name"), f"{param}.name", nonempty=True)
        description = _check.string(raw.get("description", ""), f"{param}.description")
        schema = _check.object(raw.get("input_schema"), f"{param}.input_schema")
        specs.append(ToolSpec(name, description, schema))
        paths.append(f"{param}.name")
    _check.unique_tool_names(specs, paths)
    return tuple(specs)


# A harness's tools, converted once: the same object in every call that repeats them (BodyDecoder).
_known_tools = ByIdentity(_tools)


def _tool_choice(body: dict[str, Any], tools: tuple[ToolSpec, ...]) -> ToolChoice:
    raw = _check.field(body, "tool_choice", "object")
    if raw is None:
        return ToolChoice.auto()
    kind = _check.string(raw.get("type"), "tool_choice.type")
    _check.field(raw, "disable_parallel_tool_use", "boolean", "tool_choice.disable_parallel_tool_use")
    if kind == "auto":
        return ToolChoice.auto()
    if kind == "none":
        return ToolChoice.none()
    if kind not in ("any", "tool"):
        raise _invalid("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', not {kind!r}")
    if not tools:
        raise _invalid("tool_choice", f"tool_choice {kind!r} needs at least one custom tool in 'tools'")
    if kind == "any":
        return ToolChoice.required()
    name = _check.string(raw.get("name"), "tool_choice.name", nonempty=True)
    if all(spec.name != name for spec in tools):
        raise _invalid("tool_choice.name", f"no custom tool named {name!r} in 'tools'")
    return ToolChoice.function(name)


def _sampling(body: dict[str, Any], *, counting: bool) -> Sampling:
    if counting:
        max_tokens = None  # count_tokens takes no max_tokens; nothing is generated
    else:
        max_tokens = _check.integer(body.get("max_tokens"), "max_tokens", 1, INT32_MAX)
    stops = _check.field(body, "stop_sequences", "array") or ()
    return Sampling(
        max_tokens=max_tokens,
        temperature=_check.number(body.get("temperature"), "temperature", 0, 1, optional=True),
        top_p=_check.number(body.get("top_p"), "top_p", 0, 1, optional=True),
        top_k=_check.integer(body.get("top_k"), "top_k", 0, INT32_MAX, optional=True),
        # An empty stop sequence would end every output before its first token.
        stop=tuple(_check.string(stop, f"stop_sequences.{i}", nonempty=True) for i, stop in enumerate(stops)),
    )


def _parse(body: Any, *, counting: bool) -> DialectRequest:
    if not isinstance(body, dict):
        raise _invalid(None, "the request body must be a JSON object")
    model = _check.string(body.get("model"), "model", nonempty=True)
    tools = _known_tools(body.get("tools"))
    choice = _tool_choice(body, tools)
    conversation = _conversation(body, tools, choice)
    stream = False if counting else bool(_check.field(body, "stream", "boolean"))
    return DialectRequest(
        model=model,
        conversation=conversation,
        sampling=_sampling(body, counting=counting),
        stream=stream,
        parse_tool_calls=bool(tools) and choice.mode != "none",
    )


# ---------------------------------------------------------------------------------------------------
# Result → response
# ---------------------------------------------------------------------------------------------------

_STOP_REASONS = {
    FinishKind.STOP: "end_turn",
    FinishKind.TOOL_CALLS: "tool_use",
    FinishKind.STOP_SEQUENCE: "stop_sequence",
    FinishKind.LENGTH: "max_tokens",
    FinishKind.CONTEXT_LENGTH: "model_context_window_exceeded",
}


def _finish(result: DialectResult) -> dict[str, Any]:
    """stop_reason and stop_sequence; an aborted call (never shown to a client) has no reason."""
    stop_sequence = result.stop_sequence if result.finish is FinishKind.STOP_SEQUENCE else None
    return {"stop_reason": _STOP_REASONS.get(result.finish), "stop_sequence": stop_sequence}


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        # The gateway's prefix reuse is not Anthropic's prompt cache; clients read these as absent.
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _signature(call: CallInfo) -> str:
    # Clients must echo thinking blocks with a signature; history matching compares the thinking text.
    return f"polar-{call.call_id}"


def _message(request: DialectRequest, call: CallInfo, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"msg_{call.call_id}",
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
    }


def _content(output: ParsedOutput, call: CallInfo) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if output.reasoning:
        blocks.append({"type": "thinking", "thinking": output.reasoning, "signature": _signature(call)})
    if output.content:
        blocks.append({"type": "text", "text": output.content})
    blocks.extend(
        {"type": "tool_use", "id": tool.id, "name": tool.name, "input": tool.arguments} for tool in output.tool_calls
    )
    return blocks


# ---------------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------------


def _event(data: dict[str, Any]) -> bytes:
    # The SDK skips any SSE without an `event:` line, so every event names its type.
    return sse(data, data["type"])


class _StreamRenderer(StreamRenderer):
    """One content block open at a time; a change of kind (or a new tool call) closes it."""

    def __init__(self, request: DialectRequest, call: CallInfo) -> None:
        self._request = request
        self._call = call
        self._index = -1  # index of the last block opened
        self._open: str | None = None  # type of the open block, if any

    def start(self) -> list[bytes]:
        message = _message(self._request, self._call, [])
        message["usage"] = _usage(Usage(self._call.prompt_tokens, 0))
        return [_event({"type": "message_start", "message": message})]

    def events(self, event: ParseEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            out = self._open_block({"type": "text", "text": ""}, reuse=True)
            return out + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ReasoningDelta):
            out = self._open_block({"type": "thinking", "thinking": "", "signature": ""}, reuse=True)
            return out + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            return self._open_block(block, reuse=False)
        if isinstance(event, ToolCallArgumentsDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.arguments})]
        if isinstance(event, ToolCallEnd):
            return self._close()
        raise TypeError(f"not a parse event: {event!r}")

    def finish(self, result: DialectResult) -> list[bytes]:
        usage = _usage(result.usage)
        return self._close() + [
            _event({"type": "message_delta", "delta": _finish(result), "usage": usage}),
            _event({"type": "message_stop"}),
        ]

    def error(self, error: GatewayError) -> list[bytes]:
        # An Anthropic stream ends at its error event; no message_stop follows.
        return [_event(_error_body(error)[1])]

    def _open_block(self, block: dict[str, Any], *, reuse: bool) -> list[bytes]:
        if reuse and self._open == block["type"]:
            return []
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return out + [_event({"type": "content_block_start", "index": self._index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature(self._call)}))
        out.append(_event({"type": "content_block_stop", "index": self._index}))
        self._open = None
        return out


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------

_ERRORS = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.UNSUPPORTED_CONTENT: (400, "invalid_request_error"),
    ErrorKind.CONTEXT_LENGTH: (400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.OVERLOADED: (529, "overloaded_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
}
_TOO_LONG = "prompt is too long"


def _error_body(error: GatewayError) -> tuple[int, dict[str, Any]]:
    status, kind = _ERRORS[error.kind]
    message = error.message
    if isinstance(error, ContextLengthError):
        # The API's own words: Claude Code reads the gap between the two numbers to compact.
        message = f"{_TOO_LONG}: {error.prompt_tokens} tokens > {error.max_prompt_tokens} maximum"
    elif error.kind is ErrorKind.CONTEXT_LENGTH and not message.startswith(_TOO_LONG):
        message = f"{_TOO_LONG}: {message}"
    if error.param:
        message = f"{error.param}: {message}"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------------------------------------------
# The dialect
# ---------------------------------------------------------------------------------------------------


class AnthropicDialect(Dialect):
    name = "anthropic"
    record_dialect = common_pb2.DIALECT_ANTHROPIC_MESSAGES

    def parse_request(self, body: Any, route: Route) -> DialectRequest:
        # The count_tokens route's body has no max_tokens, whichever of the two hooks the core calls.
        return _parse(body, counting=route.path.endswith(COUNT_TOKENS_SUFFIX))

    def parse_count_tokens(self, body: Any, route: Route) -> DialectRequest:
        """A `/v1/messages/count_tokens` body: a Messages body without `max_tokens`, never streamed."""
        return _parse(body, counting=True)

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        return {"input_tokens": input_tokens}

    def render_response(self, request: DialectRequest, result: DialectResult) -> dict[str, Any]:
        body = _message(request, result.call, _content(result.output, result.call))
        body.update(_finish(result))
        body["usage"] = _usage(result.usage)
        return body

    def stream_renderer(self, request: DialectRequest, call: CallInfo) -> StreamRenderer:
        return _StreamRenderer(request, call)

    def error_response(self, error: GatewayError) -> tuple[int, dict[str, Any]]:
        return _error_body(error)


DIALECT = AnthropicDialect()
