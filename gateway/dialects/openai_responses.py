"""OpenAI Responses: `POST /v1/responses` (Codex CLI, which speaks only this, always streaming).

The request's instructions, input items and tools (namespace tools as `NAMESPACE.NAME`) are read into
the conversation; the result is written back as reasoning, message and function_call items, streamed
as the Responses event grammar. What is accepted, ignored and refused, and why:
docs/design/dialects.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
from gateway.dialects.openai_chat import (
    CHECKS,
    as_object,
    error_code,
    error_object,
    error_response,
    field,
    forced_function_type,
    function_parameters,
    invalid,
    named_tool_choice,
    output_schema,
    parse_arguments,
    string_tool_choice,
    text_of,
    unique_tool_names,
)
from gateway.dialects.validation import json_type
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
# Request
# ---------------------------------------------------------------------------------------------------

_IGNORED_FIELDS = {
    "include": "array",
    "reasoning": "object",
    "client_metadata": "object",
    "store": "boolean",
    "parallel_tool_calls": "boolean",
    "prompt_cache_key": "string",
    "prompt_cache_retention": "string",
    "truncation": "string",
    "service_tier": "string",
    "user": "string",
    "safety_identifier": "string",
    "top_logprobs": "integer",
    "max_tool_calls": "integer",
    "stream_options": "object",
}

# Tools OpenAI executes server-side: the client never runs them, so leaving them out is harmless.
_HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
    }
)

_STATEFUL_FIELDS = ("previous_response_id", "conversation", "prompt")
# Joins a namespace tool's name and a member function's name into the name the model sees and calls.
_NAMESPACE_SEPARATOR = "."

_INPUT_ROLES = {"user": "user", "system": "system", "developer": "system"}


def _required_text(item: Mapping[str, Any], key: str, param: str, text_types: tuple[str, ...]) -> str:
    value = item.get(key)
    if value is None:
        raise invalid(f"{param}.{key}", f"Missing required parameter: '{param}.{key}'.")
    return text_of(value, f"{param}.{key}", text_types)


def _reasoning(item: Mapping[str, Any], param: str) -> str:
    CHECKS.fields(item, {"summary": "array", "encrypted_content": "string"}, f"{param}.")
    content = field(item, "content", "array", f"{param}.content") or []
    return text_of(content, f"{param}.content", ("reasoning_text",))


def _join(texts: list[str]) -> str:
    return "\n".join(text for text in texts if text)


class _AssistantTurn:
    """Assistant-side items gathered into one turn, flushed when a user, system or tool item arrives."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def message(self) -> Message | None:
        if not (self.content or self.reasoning or self.calls):
            return None
        return Message("assistant", _join(self.content), _join(self.reasoning), tuple(self.calls))


class _Items:
    """The conversation so far, as `input` items are converted."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.turn = _AssistantTurn()  # assistant items not yet closed by a user, system or tool item
        self.names: dict[str, str] = {}  # function name of each call id, for the tool turns answering them

    def copy(self) -> _Items:
        copied = _Items()
        copied.messages, copied.names = list(self.messages), dict(self.names)
        copied.turn.content, copied.turn.reasoning = list(self.turn.content), list(self.turn.reasoning)
        copied.turn.calls = list(self.turn.calls)
        return copied

    def add(self, message: Message) -> None:
        if (reply := self.turn.message()) is not None:
            self.messages.append(reply)
        self.turn = _AssistantTurn()
        self.messages.append(message)


def _add_item(state: _Items, index: int, value: Any) -> None:
    param = f"input[{index}]"
    item = as_object(value, param)
    kind = field(item, "type", "string", f"{param}.type") or "message"
    turn = state.turn
    if kind == "message":
        role = field(item, "role", "string", f"{param}.role", required=True)
        if role == "assistant":
            text_types = ("output_text", "refusal", "input_text")
            turn.content.append(_required_text(item, "content", param, text_types))
        elif role in _INPUT_ROLES:
            state.add(Message(_INPUT_ROLES[role], _required_text(item, "content", param, ("input_text",))))
        else:
            raise invalid(
                f"{param}.role",
                f"Invalid value '{role}' for '{param}.role': expected 'user', 'system', 'developer' or 'assistant'.",
            )
    elif kind == "reasoning":
        turn.reasoning.append(_reasoning(item, param))
    elif kind == "function_call":
        call_id = field(item, "call_id", "string", f"{param}.call_id", required=True)
        name = field(item, "name", "string", f"{param}.name", required=True)
        if namespace := field(item, "namespace", "string", f"{param}.namespace"):
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
        arguments = field(item, "arguments", "string", f"{param}.arguments", required=True)
        turn.calls.append(ToolCall(call_id, name, parse_arguments(arguments, f"{param}.arguments")))
        state.names[call_id] = name
    elif kind == "function_call_output":
        call_id = field(item, "call_id", "string", f"{param}.call_id", required=True)
        output = _required_text(item, "output", param, ("input_text", "output_text"))
        state.add(Message("tool", output, tool_call_id=call_id, name=state.names.get(call_id, "")))
    elif kind == "item_reference":
        raise invalid(f"{param}.type", "Item references need stored responses; this gateway is stateless.")
    else:
        raise invalid(
            f"{param}.type",
            f"Input items of type '{kind}' are not supported: use message, function_call, "
            "function_call_output and reasoning items.",
        )


# A session's input items, converted once each: a later call converts only what it adds.
_items = ConversationFold(_Items, _add_item, _Items.copy)


def _conversation(body: Mapping[str, Any]) -> tuple[Message, ...]:
    instructions = field(body, "instructions", "string", "instructions")
    system = (Message("system", instructions),) if instructions else ()
    raw = body.get("input")
    if raw is None:
        raise invalid("input", "Missing required parameter: 'input'.")
    if isinstance(raw, str):
        return (*system, Message("user", raw))
    if not isinstance(raw, list):
        raise invalid("input", f"Invalid type for 'input': expected string or array, got {json_type(raw)}.")
    state = _items(raw)
    last = state.turn.message()
    messages = (*system, *state.messages, *((last,) if last is not None else ()))
    if not messages:
        raise invalid("input", "'input' must contain at least one item.")
    return messages


def _tool_name(tool: Mapping[str, Any], param: str) -> str:
    name = field(tool, "name", "string", f"{param}.name", required=True)
    if not name:
        raise invalid(f"{param}.name", f"Invalid value for '{param}.name': empty.")
    return name


def _function_tool(tool: Mapping[str, Any], param: str, namespace: str = "") -> ToolSpec:
    kind = field(tool, "type", "string", f"{param}.type", required=True)
    if kind != "function":
        raise invalid(
            f"{param}.type",
            f"Tools of type '{kind}' are not supported: only 'function' tools reach the model "
            "(server-hosted tools are ignored).",
        )
    name = _tool_name(tool, param)
    description = field(tool, "description", "string", f"{param}.description") or ""
    CHECKS.fields(tool, {"strict": "boolean"}, f"{param}.")
    qualified = f"{namespace}{_NAMESPACE_SEPARATOR}{name}" if namespace else name
    return ToolSpec(qualified, description, function_parameters(tool, f"{param}.parameters"))


def _tools(value: Any) -> tuple[tuple[ToolSpec, ...], list[dict[str, Any]]]:
    """The functions the model gets (namespaced ones qualified) and the tools as responses echo them."""
    tools: list[ToolSpec] = []
    echoed: list[dict[str, Any]] = []
    for index, item in enumerate(CHECKS.array(value, "tools", optional=True) or []):
        param = f"tools[{index}]"
        tool = as_object(item, param)
        kind = field(tool, "type", "string", f"{param}.type", required=True)
        if kind in _HOSTED_TOOLS:
            continue
        if kind != "namespace":
            tools.append(_function_tool(tool, param))
            echoed.append(_echo_tool(tools[-1]))
            continue
        namespace = _tool_name(tool, param)
        members = []
        for member_index, member in enumerate(field(tool, "tools", "array", f"{param}.tools") or []):
            member_param = f"{param}.tools[{member_index}]"
            member = as_object(member, member_param)
            tools.append(_function_tool(member, member_param, namespace))
            members.append({**_echo_tool(tools[-1]), "name": member["name"]})
        description = field(tool, "description", "string", f"{param}.description") or ""
        echoed.append({"type": "namespace", "name": namespace, "description": description, "tools": members})
    unique_tool_names(tools)
    return tuple(tools), echoed


# A harness's tools, converted once: the same object in every call that repeats them (BodyDecoder).
_known_tools = ByIdentity(_tools)


def _namespaced(request: DialectRequest) -> dict[str, tuple[str, str]]:
    """(namespace, name) of each namespaced function by the qualified name the model calls it by; a
    plain function is not here, so its name is never split, even if it holds a dot."""
    return {
        f"{tool['name']}{_NAMESPACE_SEPARATOR}{member['name']}": (tool["name"], member["name"])
        for tool in request.echo["tools"]
        if tool["type"] == "namespace"
        for member in tool["tools"]
    }


def _tool_choice(body: Mapping[str, Any], tools: tuple[ToolSpec, ...]) -> ToolChoice:
    raw = body.get("tool_choice")
    if not isinstance(raw, dict):
        return string_tool_choice(raw, tools)
    forced_function_type(raw)
    name = field(raw, "name", "string", "tool_choice.name", required=True)
    return named_tool_choice(name, tools, "tool_choice.name")


def _sampling(body: Mapping[str, Any]) -> Sampling:
    return Sampling(
        max_tokens=CHECKS.integer(body.get("max_output_tokens"), "max_output_tokens", 1, optional=True),
        temperature=CHECKS.number(body.get("temperature"), "temperature", 0, 2, optional=True),
        top_p=CHECKS.number(body.get("top_p"), "top_p", 0, 1, optional=True),
    )


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for key in _STATEFUL_FIELDS:
        if body.get(key) is not None:
            raise invalid(key, f"'{key}' needs server-side state; this gateway is stateless: send the whole input.")
    if field(body, "background", "boolean", "background"):
        raise invalid("background", "Background responses are not supported: this gateway stores nothing.")
    text = field(body, "text", "object", "text") or {}
    CHECKS.fields(text, {"verbosity": "string"}, "text.")


def _metadata(body: Mapping[str, Any]) -> dict[str, str] | None:
    metadata = field(body, "metadata", "object", "metadata")
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise invalid(f"metadata.{key}", f"Invalid type for 'metadata.{key}': expected string.")
    return metadata


def _echo_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": False,
    }


def _parse(body: Any) -> DialectRequest:
    body = as_object(body, None)
    model = field(body, "model", "string", "model", required=True)
    _refuse_unsupported(body)
    CHECKS.fields(body, _IGNORED_FIELDS)
    messages = _conversation(body)
    tools, echoed_tools = _known_tools(body.get("tools"))
    tool_choice = _tool_choice(body, tools)
    sampling = _sampling(body)
    choice = body.get("tool_choice")
    text = field(body, "text", "object", "text") or {}
    return DialectRequest(
        model=model,
        conversation=Conversation(messages, tools, tool_choice),
        output_schema=output_schema(field(text, "format", "object", "text.format"), "text.format", flat=True),
        sampling=sampling,
        stream=bool(field(body, "stream", "boolean", "stream")),
        parse_tool_calls=bool(tools) and tool_choice.mode != "none",
        echo={
            "instructions": body.get("instructions"),
            "metadata": _metadata(body),
            "tools": echoed_tools,
            "tool_choice": {"type": "function", "name": choice["name"]}
            if isinstance(choice, dict)
            else (choice or "auto"),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_output_tokens": sampling.max_tokens,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
        },
    )


# ---------------------------------------------------------------------------------------------------
# Response
# ---------------------------------------------------------------------------------------------------

_CUT = frozenset({FinishKind.LENGTH, FinishKind.CONTEXT_LENGTH, FinishKind.ABORTED})


def _finish(result: DialectResult) -> tuple[str, dict[str, str] | None]:
    """The response's status and incomplete_details."""
    if result.finish in _CUT:
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _usage(usage: Usage) -> dict[str, Any]:
    # Reasoning and cached tokens are not counted apart; the SDK requires the fields, so they are 0.
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _response(
    request: DialectRequest,
    call: CallInfo,
    status: str,
    output: list[dict[str, Any]],
    *,
    usage: Usage | None = None,
    incomplete_details: dict[str, str] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"resp_{call.call_id}",
        "object": "response",
        "created_at": call.created,
        "status": status,
        "model": request.model,
        "output": output,
        "error": error,
        "incomplete_details": incomplete_details,
        "usage": None if usage is None else _usage(usage),
        "previous_response_id": None,
        "store": False,
        **request.echo,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_output_text(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, namespaced: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    namespace, name = namespaced.get(name, ("", name))
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if namespace:
        item["namespace"] = namespace
    return item


def _item_id(prefix: str, call: CallInfo, output_index: int) -> str:
    return f"{prefix}_{call.call_id}_{output_index}"


def _render(request: DialectRequest, result: DialectResult) -> dict[str, Any]:
    status, incomplete_details = _finish(result)
    output: list[dict[str, Any]] = []
    parsed, call = result.output, result.call
    if parsed.reasoning:
        output.append(_reasoning_item(_item_id("rs", call, len(output)), parsed.reasoning, "completed"))
    if parsed.content or not (parsed.reasoning or parsed.tool_calls):
        output.append(_message_item(_item_id("msg", call, len(output)), parsed.content, "completed"))
    namespaced = _namespaced(request)
    for tool_call in parsed.tool_calls:
        arguments = json.dumps(tool_call.arguments, ensure_ascii=False)
        item_id = _item_id("fc", call, len(output))
        output.append(_function_call_item(item_id, tool_call.id, tool_call.name, arguments, "completed", namespaced))
    if status == "incomplete" and output[-1]["type"] != "function_call":
        output[-1]["status"] = "incomplete"
    return _response(request, call, status, output, usage=result.usage, incomplete_details=incomplete_details)


# ---------------------------------------------------------------------------------------------------
# Stream
# ---------------------------------------------------------------------------------------------------


def _context_words(error: ContextLengthError) -> tuple[str, str]:
    """(message, param) of the Responses API's context-length error, in its words, with the numbers."""
    return (
        f"Your input exceeds the context window of this model ({error.prompt_tokens} tokens; the context "
        f"holds {error.context_length}). Please adjust your input and try again.",
        "input",
    )


# The error codes of a failed response: OpenAI's own where one fits, `context_length_exceeded` as Codex
# matches it.
_FAILED_CODES = {
    ErrorKind.CONTEXT_LENGTH: "context_length_exceeded",
    ErrorKind.INVALID_REQUEST: "invalid_prompt",
    ErrorKind.UNSUPPORTED_CONTENT: "invalid_prompt",
}


class _StreamRenderer(StreamRenderer):
    """The Responses event sequence for one call; one output item is open at a time."""

    def __init__(self, request: DialectRequest, call: CallInfo) -> None:
        self._request = request
        self._call = call
        self._namespaced = _namespaced(request)
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # finished items, in output order
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._open_text = ""  # its text or arguments so far
        self._open_call_index = -1  # the parser's index of the open function call
        self._kinds_seen: set[str] = set()
        self._started = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(data, event=kind)

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return _response(self._request, self._call, status, list(self._output), **fields)

    def start(self) -> list[bytes]:
        # Idempotent, and also run by the first events() call: sequence numbers are handed out as
        # events are made, so the opening events must be made first whatever order the hooks run in
        # (the core renders its first parse events before it asks for the opening).
        if self._started:
            return []
        self._started = True
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    # Items ---------------------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self._output)} if self._open else {}

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        self._open, self._open_text = item, ""
        self._kinds_seen.add(item["type"])
        events = [self._event("response.output_item.added", output_index=len(self._output), item=item)]
        if item["type"] == "message":
            part = _output_text("")
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        else:
            return events
        added = self._event("response.content_part.added", **self._where(), content_index=0, part=part)
        return [*events, added]

    def _open_text_item(self, kind: str, text: str) -> tuple[list[bytes], str]:
        """Open a message or reasoning item unless one is open; drop a later item's leading separator."""
        if self._open is not None and self._open["type"] == kind:
            return [], text
        events = self._close("completed")
        if kind in self._kinds_seen and text.startswith("\n"):
            text = text[1:]
        item_id = _item_id("msg" if kind == "message" else "rs", self._call, len(self._output))
        item = (
            _message_item(item_id, "", "in_progress")
            if kind == "message"
            else {"id": item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        )
        return [*events, *self._open_item(item)], text

    def _close(self, status: str) -> list[bytes]:
        item, text = self._open, self._open_text
        if item is None:
            return []
        where = self._where()
        kind = item["type"]
        if kind == "message":
            part = _output_text(text)
            done = _message_item(item["id"], text, status)
            events = [
                self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif kind == "reasoning":
            done = _reasoning_item(item["id"], text, status)
            events = [
                self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                self._event("response.content_part.done", **where, content_index=0, part=done["content"][0]),
            ]
        else:
            done = {**item, "arguments": text, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", **where, arguments=text)]
        events.append(self._event("response.output_item.done", output_index=len(self._output), item=done))
        self._output.append(done)
        self._open, self._open_text = None, ""
        return events

    # Parse events --------------------------------------------------------------------------------

    def events(self, event: ParseEvent) -> list[bytes]:
        return [*self.start(), *self._translate(event)]

    def _translate(self, event: ParseEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            events, text = self._open_text_item("message", event.text)
            if text:
                self._open_text += text
                delta = {"content_index": 0, "delta": text, "logprobs": []}
                events.append(self._event("response.output_text.delta", **self._where(), **delta))
            return events
        if isinstance(event, ReasoningDelta):
            events, text = self._open_text_item("reasoning", event.text)
            if text:
                self._open_text += text
                delta = {"content_index": 0, "delta": text}
                events.append(self._event("response.reasoning_text.delta", **self._where(), **delta))
            return events
        if isinstance(event, ToolCallStart):
            events = self._close("completed")
            item_id = _item_id("fc", self._call, len(self._output))
            self._open_call_index = event.index
            item = _function_call_item(item_id, event.id, event.name, "", "in_progress", self._namespaced)
            return [*events, *self._open_item(item)]
        if isinstance(event, ToolCallArgumentsDelta):
            self._check_open_call(event.index)
            self._open_text += event.arguments
            where = self._where()
            return [self._event("response.function_call_arguments.delta", **where, delta=event.arguments)]
        if isinstance(event, ToolCallEnd):
            self._check_open_call(event.index)
            return self._close("completed")
        raise TypeError(f"unknown parse event {event!r}")

    def _check_open_call(self, index: int) -> None:
        # Parsers emit each call whole (start, arguments, end) before the next one begins.
        if self._open is None or self._open["type"] != "function_call" or self._open_call_index != index:
            raise ValueError(f"tool call {index} is not the call being streamed")

    def finish(self, result: DialectResult) -> list[bytes]:
        status, incomplete_details = _finish(result)
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = [*self.start(), *self._close(item_status)]
        if not self._output:
            # An empty answer is still one (empty) message, as in the non-streaming response.
            events += self._open_item(_message_item(_item_id("msg", self._call, 0), "", "in_progress"))
            events += self._close(item_status)
        response = self._response(status, usage=result.usage, incomplete_details=incomplete_details)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def error(self, error: GatewayError) -> list[bytes]:
        code = _FAILED_CODES.get(error.kind, "server_error")
        failure = {**error_object(error, _context_words), "code": code}
        return [
            *self.start(),
            self._event("error", code=error_code(error) or code, message=failure["message"], param=failure["param"]),
            self._event("response.failed", response=self._response("failed", error=failure)),
        ]


class OpenAIResponsesDialect(Dialect):
    name = "openai_responses"
    record_dialect = common_pb2.DIALECT_OPENAI_RESPONSES

    def parse_request(self, body: Any, route: Route) -> DialectRequest:
        return _parse(body)

    def render_response(self, request: DialectRequest, result: DialectResult) -> dict[str, Any]:
        return _render(request, result)

    def stream_renderer(self, request: DialectRequest, call: CallInfo) -> StreamRenderer:
        return _StreamRenderer(request, call)

    def error_response(self, error: GatewayError) -> tuple[int, dict[str, Any]]:
        return error_response(error, _context_words)


DIALECT = OpenAIResponsesDialect()
