"""OpenAI Chat Completions: `POST /v1/chat/completions` (Qwen Code, pi and most OpenAI-compatible clients).

Messages, tools and sampling are read into the conversation; the result is written back as a
`chat.completion` (streamed as `chat.completion.chunk` events and `[DONE]`). What is accepted,
ignored and refused, and why: docs/design/dialects.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
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
from gateway.dialects.validation import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    Checks,
    Wording,
    json_type,
    nested_deeper_than,
)
from gateway.parsers import (
    ParseEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from polar.v1 import common_pb2

# ---------------------------------------------------------------------------------------------------
# Shared with openai_responses: the JSON checks in OpenAI's words, and the OpenAI error shape
# ---------------------------------------------------------------------------------------------------


class _Wording(Wording):
    """OpenAI's phrasing: `Invalid type for 'messages[0].content': expected string, got integer.`"""

    def wrong_type(self, path: str, expected: str, value: Any) -> str:
        return f"Invalid type for '{path}': expected {expected}, got {json_type(value)}."

    def missing(self, path: str, expected: str) -> str:
        return f"Missing required parameter: '{path}'."

    def bad_value(self, path: str, reason: str) -> str:
        return f"Invalid value for '{path}': {reason}."

    def duplicate_tool(self, path: str, name: str) -> str:
        return f"Duplicate function name '{name}' in 'tools'."


CHECKS = Checks(_Wording())
invalid = CHECKS.invalid
field = CHECKS.field

# Unsupported media parts of both OpenAI dialects.
MEDIA_PARTS = frozenset({"image_url", "input_audio", "file", "input_image", "input_file"})


def as_object(value: Any, param: str | None) -> dict[str, Any]:
    """An object at `param`; the request body itself when `param` is None."""
    if param is not None:
        return CHECKS.object(value, param)
    if not isinstance(value, dict):
        raise invalid(None, f"The request body must be a JSON object, not {json_type(value)}.")
    return value


def unique_tool_names(tools: list[ToolSpec]) -> None:
    CHECKS.unique_tool_names(tools, [f"tools[{index}]" for index in range(len(tools))])


def parse_arguments(text: str, param: str) -> dict[str, Any]:
    """Tool-call arguments echoed as a JSON string; empty means no arguments."""
    if not text.strip():
        return {}
    try:
        arguments = json.loads(text)
    except ValueError:
        raise invalid(param, f"Invalid '{param}': not valid JSON.") from None
    except RecursionError:  # nested past what the parser takes
        raise invalid(param, f"Invalid '{param}': nested more than {MAX_JSON_DEPTH} levels deep.") from None
    if nested_deeper_than(arguments, MAX_JSON_DEPTH):
        raise invalid(param, f"Invalid '{param}': nested more than {MAX_JSON_DEPTH} levels deep.")
    if not isinstance(arguments, dict):
        raise invalid(param, f"Invalid '{param}': must be a JSON object.")
    return arguments


def text_of(content: Any, param: str, text_types: tuple[str, ...]) -> str:
    """The text of a string or an array of text parts (joined with `\\n`); media parts are unsupported."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"Invalid type for '{param}': expected string or array, got {json_type(content)}.")
    texts = []
    for index, raw in enumerate(content):
        part_param = f"{param}[{index}]"
        part = as_object(raw, part_param)
        kind = field(part, "type", "string", f"{part_param}.type", required=True)
        if kind in MEDIA_PARTS:
            raise GatewayError(
                ErrorKind.UNSUPPORTED_CONTENT,
                f"Content parts of type '{kind}' are not supported: this gateway is text-only.",
                param=f"{part_param}.type",
            )
        if kind not in text_types:
            expected = ", ".join(f"'{name}'" for name in text_types)
            raise invalid(f"{part_param}.type", f"Invalid value '{kind}' for '{part_param}.type': expected {expected}.")
        key = "refusal" if kind == "refusal" else "text"
        texts.append(field(part, key, "string", f"{part_param}.{key}", required=True))
    return "\n".join(texts)


def function_parameters(spec: Mapping[str, Any], param: str) -> dict[str, Any]:
    parameters = field(spec, "parameters", "object", param)
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def named_tool_choice(name: str, tools: tuple[ToolSpec, ...], param: str) -> ToolChoice:
    if not name:
        raise invalid(param, f"Invalid value for '{param}': the function name is empty.")
    if all(tool.name != name for tool in tools):
        raise invalid(param, f"Invalid value for '{param}': no function named '{name}' in 'tools'.")
    return ToolChoice.function(name)


ContextWords = Callable[[ContextLengthError], tuple[str, str]]
_ERRORS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.UNSUPPORTED_CONTENT: (400, "invalid_request_error"),
    ErrorKind.CONTEXT_LENGTH: (400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.OVERLOADED: (503, "server_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


def error_code(error: GatewayError) -> str | None:
    """OpenAI's `code` for an error: the ones clients branch on, as OpenAI spells them."""
    if error.kind is ErrorKind.NOT_FOUND:
        return "model_not_found" if error.param == "model" else "not_found"
    return {
        ErrorKind.CONTEXT_LENGTH: "context_length_exceeded",
        ErrorKind.AUTHENTICATION: "invalid_api_key",
        ErrorKind.UNSUPPORTED_CONTENT: "unsupported_content",
        ErrorKind.OVERLOADED: "overloaded",
    }.get(error.kind)


def context_words(error: ContextLengthError) -> tuple[str, str]:
    """(message, param) of Chat Completions' context-length error, in the API's words."""
    return (
        f"This model's maximum context length is {error.context_length} tokens. However, your messages "
        f"resulted in {error.prompt_tokens} tokens. Please reduce the length of the messages.",
        "messages",
    )


def error_object(error: GatewayError, words: ContextWords = context_words) -> dict[str, Any]:
    """`words`: how this API words a context-length error (Chat's and Responses' differ)."""
    message, param = words(error) if isinstance(error, ContextLengthError) else (error.message, error.param)
    return {
        "message": message,
        "type": _ERRORS[error.kind][1],
        "param": param,
        "code": error_code(error),
    }


def error_response(error: GatewayError, words: ContextWords = context_words) -> tuple[int, dict[str, Any]]:
    return _ERRORS[error.kind][0], {"error": error_object(error, words)}


# ---------------------------------------------------------------------------------------------------
# Request
# ---------------------------------------------------------------------------------------------------

_IGNORED_FIELDS = {
    "parallel_tool_calls": "boolean",
    "user": "string",
    "metadata": "object",
    "store": "boolean",
    "reasoning_effort": "string",
    "frequency_penalty": "number",
    "presence_penalty": "number",
    "logit_bias": "object",
    "top_logprobs": "integer",
    "service_tier": "string",
    "prompt_cache_key": "string",
    "safety_identifier": "string",
    "verbosity": "string",
}

_SYSTEM_ROLES = ("system", "developer")
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _tool_calls(raw: list[Any], param: str) -> tuple[ToolCall, ...]:
    calls = []
    for index, item in enumerate(raw):
        call_param = f"{param}[{index}]"
        call = as_object(item, call_param)
        kind = field(call, "type", "string", f"{call_param}.type")
        if kind not in (None, "function"):
            raise invalid(f"{call_param}.type", f"Invalid value '{kind}' for '{call_param}.type': expected 'function'.")
        call_id = field(call, "id", "string", f"{call_param}.id", required=True)
        function = field(call, "function", "object", f"{call_param}.function", required=True)
        name = field(function, "name", "string", f"{call_param}.function.name", required=True)
        arguments = field(function, "arguments", "string", f"{call_param}.function.arguments") or ""
        calls.append(ToolCall(call_id, name, parse_arguments(arguments, f"{call_param}.function.arguments")))
    return tuple(calls)


def _message(raw: Any, param: str, names: dict[str, str]) -> Message:
    message = as_object(raw, param)
    role = field(message, "role", "string", f"{param}.role", required=True)
    if role not in _ROLES:
        expected = ", ".join(f"'{name}'" for name in _ROLES)
        raise invalid(f"{param}.role", f"Invalid value '{role}' for '{param}.role': expected one of {expected}.")
    content_param = f"{param}.content"
    if role in _SYSTEM_ROLES or role == "user":
        content = message.get("content")
        if content is None:
            raise invalid(content_param, f"Missing required parameter: '{content_param}'.")
        return Message("user" if role == "user" else "system", text_of(content, content_param, ("text",)))
    if role == "tool":
        call_id = field(message, "tool_call_id", "string", f"{param}.tool_call_id", required=True)
        content = message.get("content")
        text = "" if content is None else text_of(content, content_param, ("text",))
        return Message("tool", text, tool_call_id=call_id, name=names.get(call_id, ""))
    content = message.get("content")
    text = "" if content is None else text_of(content, content_param, ("text", "refusal"))
    reasoning = field(message, "reasoning_content", "string", f"{param}.reasoning_content")
    if reasoning is None:
        reasoning = field(message, "reasoning", "string", f"{param}.reasoning")
    raw_calls = field(message, "tool_calls", "array", f"{param}.tool_calls")
    calls = _tool_calls(raw_calls, f"{param}.tool_calls") if raw_calls else ()
    return Message("assistant", text, reasoning or "", calls)


@dataclass
class _Messages:
    """The conversation so far, as `messages` items are converted."""

    messages: list[Message] = dataclass_field(default_factory=list)
    tool_names: dict[str, str] = dataclass_field(default_factory=dict)  # call id → function name

    def copy(self) -> _Messages:
        return _Messages(list(self.messages), dict(self.tool_names))


def _add_message(state: _Messages, index: int, item: Any) -> None:
    message = _message(item, f"messages[{index}]", state.tool_names)
    state.messages.append(message)
    state.tool_names.update((call.id, call.name) for call in message.tool_calls)


# A session's messages, converted once each: a later call converts only what it adds.
_messages = ConversationFold(_Messages, _add_message, _Messages.copy)


def _conversation(body: Mapping[str, Any]) -> tuple[Message, ...]:
    raw = field(body, "messages", "array", "messages", required=True)
    if not raw:
        raise invalid("messages", "'messages' must contain at least one message.")
    return tuple(_messages(raw).messages)


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    raw = CHECKS.array(value, "tools", optional=True) or []
    tools = []
    for index, item in enumerate(raw):
        param = f"tools[{index}]"
        tool = as_object(item, param)
        kind = field(tool, "type", "string", f"{param}.type", required=True)
        if kind != "function":
            raise invalid(
                f"{param}.type", f"Invalid value '{kind}' for '{param}.type': only 'function' tools are supported."
            )
        function = field(tool, "function", "object", f"{param}.function", required=True)
        name = field(function, "name", "string", f"{param}.function.name", required=True)
        if not name:
            raise invalid(f"{param}.function.name", f"Invalid value for '{param}.function.name': empty.")
        description = field(function, "description", "string", f"{param}.function.description") or ""
        CHECKS.fields(function, {"strict": "boolean"}, f"{param}.function.")
        parameters = function_parameters(function, f"{param}.function.parameters")
        tools.append(ToolSpec(name, description, parameters))
    unique_tool_names(tools)
    return tuple(tools)


# A harness's tools, converted once: the same object in every call that repeats them (BodyDecoder).
_known_tools = ByIdentity(_tools)


def _tool_choice(body: Mapping[str, Any], tools: tuple[ToolSpec, ...]) -> ToolChoice:
    raw = body.get("tool_choice")
    if not isinstance(raw, dict):
        return string_tool_choice(raw, tools)
    forced_function_type(raw)
    function = field(raw, "function", "object", "tool_choice.function", required=True)
    name = field(function, "name", "string", "tool_choice.function.name", required=True)
    return named_tool_choice(name, tools, "tool_choice.function.name")


def string_tool_choice(raw: Any, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """The forms of `tool_choice` both OpenAI APIs share: absent, "auto", "none", "required"."""
    if raw is None or raw == "auto":
        return ToolChoice.auto()
    if raw == "none":
        return ToolChoice.none()
    if raw == "required":
        if not tools:
            raise invalid("tool_choice", "'tool_choice' is 'required' but no function 'tools' were given.")
        return ToolChoice.required()
    raise invalid(
        "tool_choice", "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or a named function."
    )


def forced_function_type(raw: Mapping[str, Any]) -> None:
    """An object `tool_choice` names a function: only functions can be forced."""
    kind = field(raw, "type", "string", "tool_choice.type", required=True)
    if kind != "function":
        raise invalid(
            "tool_choice.type", f"Invalid value '{kind}' for 'tool_choice.type': only 'function' can be forced."
        )


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    raw = body.get("stop")
    stops = [raw] if isinstance(raw, str) else raw
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise invalid("stop", "Invalid type for 'stop': expected a string or an array of strings.")
    if any(not stop for stop in stops):
        raise invalid("stop", "Invalid value for 'stop': stop strings must not be empty.")
    return tuple(stops)


def _sampling(body: Mapping[str, Any]) -> Sampling:
    max_tokens = CHECKS.integer(body.get("max_tokens"), "max_tokens", 1, optional=True)
    max_completion_tokens = CHECKS.integer(body.get("max_completion_tokens"), "max_completion_tokens", 1, optional=True)
    # OpenAI's seed is an int64; the engine's is a uint64, so a negative seed wraps around.
    seed = CHECKS.integer(body.get("seed"), "seed", INT64_MIN, INT64_MAX, optional=True)
    top_k = CHECKS.integer(body.get("top_k"), "top_k", -1, INT32_MAX, optional=True)  # -1 and 0: off
    return Sampling(
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        temperature=CHECKS.number(body.get("temperature"), "temperature", 0, 2, optional=True),
        top_p=CHECKS.number(body.get("top_p"), "top_p", 0, 1, optional=True),
        top_k=top_k if top_k is not None and top_k > 0 else None,
        stop=_stop(body),
        seed=None if seed is None else seed % 2**64,
    )


def output_schema(value: Mapping[str, Any] | None, path: str, *, flat: bool = False) -> dict[str, Any] | None:
    """The reply's JSON schema from Chat's `response_format` ({type, json_schema: {name, schema}}) or, `flat`,
    Responses' `text.format` ({type, name, schema}); None for `text` or none given."""
    if value is None:
        return None
    kind = field(value, "type", "string", f"{path}.type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise invalid(
            f"{path}.type", f"Invalid value for '{path}.type': '{kind}' is not one of text, json_object, json_schema."
        )
    holder, holder_path = (
        (value, path)
        if flat
        else (field(value, "json_schema", "object", f"{path}.json_schema", required=True), f"{path}.json_schema")
    )
    field(holder, "name", "string", f"{holder_path}.name", required=True)
    schema = field(holder, "schema", "object", f"{holder_path}.schema")
    return schema if schema is not None else {"type": "object"}


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = field(body, "n", "integer", "n")
    if n is not None and n != 1:
        raise invalid("n", "Invalid value for 'n': only one choice per request is supported.")
    if field(body, "logprobs", "boolean", "logprobs"):
        raise invalid("logprobs", "'logprobs' is not supported by this gateway.")
    if body.get("functions") is not None or body.get("function_call") is not None:
        param = "functions" if body.get("functions") is not None else "function_call"
        raise invalid(param, f"'{param}' is deprecated and not supported: use 'tools' and 'tool_choice'.")


def _parse(body: Any) -> DialectRequest:
    body = as_object(body, None)
    model = field(body, "model", "string", "model", required=True)
    _refuse_unsupported(body)
    CHECKS.fields(body, _IGNORED_FIELDS)
    messages = _conversation(body)
    tools = _known_tools(body.get("tools"))
    tool_choice = _tool_choice(body, tools)
    stream = bool(field(body, "stream", "boolean", "stream"))
    stream_options = field(body, "stream_options", "object", "stream_options") or {}
    include_usage = bool(field(stream_options, "include_usage", "boolean", "stream_options.include_usage"))
    return DialectRequest(
        model=model,
        conversation=Conversation(messages, tools, tool_choice),
        output_schema=output_schema(field(body, "response_format", "object", "response_format"), "response_format"),
        sampling=_sampling(body),
        stream=stream,
        parse_tool_calls=bool(tools) and tool_choice.mode != "none",
        echo={"include_usage": include_usage},
    )


# ---------------------------------------------------------------------------------------------------
# Response
# ---------------------------------------------------------------------------------------------------

_FINISH_REASONS = {
    FinishKind.STOP: "stop",
    FinishKind.STOP_SEQUENCE: "stop",
    FinishKind.TOOL_CALLS: "tool_calls",
    FinishKind.LENGTH: "length",
    FinishKind.CONTEXT_LENGTH: "length",
    # Aborted calls have no client left; mapped only so the table is total.
    FinishKind.ABORTED: "length",
}


def _finish(result: DialectResult) -> str:
    return _FINISH_REASONS[result.finish]


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _completion_id(call: CallInfo) -> str:
    return f"chatcmpl-{call.call_id}"


def _tool_call(call: ToolCall) -> dict[str, Any]:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _render(request: DialectRequest, result: DialectResult) -> dict[str, Any]:
    output = result.output
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if output.tool_calls and not output.content else output.content,
    }
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [_tool_call(call) for call in output.tool_calls]
    return {
        "id": _completion_id(result.call),
        "object": "chat.completion",
        "created": result.call.created,
        "model": request.model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(result), "logprobs": None}],
        "usage": _usage(result.usage),
    }


# ---------------------------------------------------------------------------------------------------
# Stream
# ---------------------------------------------------------------------------------------------------

_DONE = b"data: [DONE]\n\n"


class _StreamRenderer(StreamRenderer):
    """`chat.completion.chunk` events; every chunk carries `usage: null` when usage was asked for, as
    OpenAI's do, and the usage itself comes in a last chunk with no choices."""

    def __init__(self, request: DialectRequest, call: CallInfo) -> None:
        self._include_usage = bool(request.echo.get("include_usage"))
        self._head = {
            "id": _completion_id(call),
            "object": "chat.completion.chunk",
            "created": call.created,
            "model": request.model,
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk: dict[str, Any] = {
            **self._head,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def events(self, event: ParseEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            return [self._chunk({"content": event.text})]
        if isinstance(event, ReasoningDelta):
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, ToolCallStart):
            call = {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return [self._chunk({"tool_calls": [call]})]
        if isinstance(event, ToolCallArgumentsDelta):
            piece = {"index": event.index, "function": {"arguments": event.arguments}}
            return [self._chunk({"tool_calls": [piece]})]
        if isinstance(event, ToolCallEnd):
            return []
        raise TypeError(f"unknown parse event {event!r}")

    def finish(self, result: DialectResult) -> list[bytes]:
        events = [self._chunk({}, _finish(result))]
        if self._include_usage:
            events.append(sse({**self._head, "choices": [], "usage": _usage(result.usage)}))
        return [*events, _DONE]

    def error(self, error: GatewayError) -> list[bytes]:
        return [sse({"error": error_object(error)}), _DONE]


class OpenAIChatDialect(Dialect):
    name = "openai_chat"
    record_dialect = common_pb2.DIALECT_OPENAI_CHAT

    def parse_request(self, body: Any, route: Route) -> DialectRequest:
        return _parse(body)

    def render_response(self, request: DialectRequest, result: DialectResult) -> dict[str, Any]:
        return _render(request, result)

    def stream_renderer(self, request: DialectRequest, call: CallInfo) -> StreamRenderer:
        return _StreamRenderer(request, call)

    def error_response(self, error: GatewayError) -> tuple[int, dict[str, Any]]:
        return error_response(error)


DIALECT = OpenAIChatDialect()
