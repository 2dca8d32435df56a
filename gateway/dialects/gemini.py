"""Google generateContent and streamGenerateContent (`/v1` and `/v1beta`): Gemini CLI, the google-genai SDKs.

The request's contents, tools and generationConfig are read into the conversation, and the result is
written back as one candidate (streamed as SSE chunks with `alt=sse`, else one JSON array). What is
accepted, ignored and refused, and why: docs/design/dialects.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
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
    json_bytes,
    sse,
)
from gateway.dialects.validation import INT32_MAX, INT32_MIN, Checks, Wording, json_type
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

# Part fields that carry data: a part holds exactly one of them (the proto's `data` oneof).
_PART_DATA = (
    "text",
    "functionCall",
    "functionResponse",
    "inlineData",
    "fileData",
    "executableCode",
    "codeExecutionResult",
)
_MEDIA_PARTS = frozenset({"inlineData", "fileData"})
_CODE_EXECUTION_PARTS = frozenset({"executableCode", "codeExecutionResult"})
_FUNCTION_CALLING_MODES = frozenset({"MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"})
# Schema fields that hold schemas, so that a Schema's type names are lowered all the way down.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_ONE = frozenset({"items", "additionalProperties", "not"})

_ERROR_STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "INVALID_ARGUMENT"),
    ErrorKind.UNSUPPORTED_CONTENT: (400, "INVALID_ARGUMENT"),
    ErrorKind.CONTEXT_LENGTH: (400, "INVALID_ARGUMENT"),
    ErrorKind.AUTHENTICATION: (401, "UNAUTHENTICATED"),
    ErrorKind.NOT_FOUND: (404, "NOT_FOUND"),
    ErrorKind.OVERLOADED: (503, "UNAVAILABLE"),
    ErrorKind.INTERNAL: (500, "INTERNAL"),
}
# The API's wording, so that clients matching on it (Gemini CLI does, to compress its history) react.
_CONTEXT_MESSAGE = "The input token count exceeds the maximum number of tokens allowed"


# ---------------------------------------------------------------------------------------------------
# JSON field access and checks: each raises GatewayError naming the field as a JSON path
# ---------------------------------------------------------------------------------------------------


@functools.cache
def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@functools.cache
def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def _get(obj: Mapping[str, Any], name: str) -> Any:
    """A field by its JSON name (lowerCamel) or its proto name (snake_case); None when absent."""
    value = obj.get(name)
    return obj.get(_snake(name)) if value is None else value


class _Wording(Wording):
    """The API's own phrasing: `Invalid value at 'generationConfig.topK': expected an integer, got a string.`"""

    def wrong_type(self, path: str, expected: str, value: Any) -> str:
        got = json_type(value)
        got = "number" if got == "integer" else got
        return f"Invalid value at '{path}': expected {_TYPE_NAMES[expected]}, got {_TYPE_NAMES[got]}."

    def missing(self, path: str, expected: str) -> str:
        return self.wrong_type(path, expected, None)

    def bad_value(self, path: str, reason: str) -> str:
        return f"Invalid value at '{path}': {reason}."

    def duplicate_tool(self, path: str, name: str) -> str:
        return f"Duplicate function declaration found: {name}"


_TYPE_NAMES = {
    "null": "null",
    "boolean": "a boolean",
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "array": "a list",
    "object": "an object",
}
_check = Checks(_Wording())
_invalid = _check.invalid


# Absent fields read as the proto's defaults: "", {}, [], false.


def _object(value: Any, path: str, *, required: bool = False) -> dict[str, Any]:
    return _check.object(value, path, optional=not required) or {}


def _array(value: Any, path: str) -> list[Any]:
    return _check.array(value, path, optional=True) or []


def _string(value: Any, path: str, *, required: bool = False) -> str:
    return _check.string(value, path, optional=not required) or ""


def _boolean(value: Any, path: str) -> bool:
    return bool(_check.boolean(value, path, optional=True))


def _integer(value: Any, path: str, *, minimum: int = INT32_MIN) -> int | None:
    """An int32 field (every integer this dialect reads is one); None when absent."""
    return _check.integer(value, path, minimum, INT32_MAX, optional=True)


# ---------------------------------------------------------------------------------------------------
# Request → conversation
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Turns:
    """The conversation so far, as `contents` are converted."""

    messages: list[Message] = field(default_factory=list)
    # Calls of the latest model turn not answered yet, in order: what a functionResponse can answer.
    pending: list[ToolCall] = field(default_factory=list)

    def copy(self) -> _Turns:
        return _Turns(list(self.messages), list(self.pending))


def _add_content(state: _Turns, index: int, content: Any) -> None:
    path = f"contents[{index}]"
    content = _object(content, path, required=True)
    role = _string(_get(content, "role"), f"{path}.role") or "user"
    parts = _array(_get(content, "parts"), f"{path}.parts")
    if not parts:
        raise _invalid(f"{path}.parts", "contents.parts must not be empty.")
    messages = state.messages
    if role == "model":
        message = _model_turn(parts, path, index)
        if messages and messages[-1].role == "assistant":
            # One turn the client split: the SDK's chat keeps each streamed chunk as its own content.
            state.pending += message.tool_calls
            message = _joined(messages.pop(), message)
        else:
            state.pending = list(message.tool_calls)
        messages.append(message)
    elif role in ("user", "function"):
        messages.extend(_user_turn(parts, path, state.pending))
    else:
        raise _invalid(f"{path}.role", f"Please use a valid role: user, model (not {role!r}).")


# A session's contents, converted once each: a later call converts only what it adds.
_contents = ConversationFold(_Turns, _add_content, _Turns.copy)


def _conversation(contents: Any, system: Any) -> tuple[Message, ...]:
    instruction = _system_text(system) if system is not None else ""
    head = (Message("system", instruction),) if instruction else ()
    turns = _array(contents, "contents")
    if not turns:
        raise _invalid("contents", "contents is not specified")
    return (*head, *_contents(turns).messages)


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    content = _object(system, "systemInstruction", required=True)
    texts = []
    for index, part in enumerate(_array(_get(content, "parts"), "systemInstruction.parts")):
        kind, value = _part(part, f"systemInstruction.parts[{index}]")
        if kind not in ("text", "thought"):
            raise _invalid(f"systemInstruction.parts[{index}]", "A system instruction holds text parts only.")
        texts.append(value)
    return "".join(texts)


def _model_turn(parts: list[Any], path: str, turn: int) -> Message:
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for index, part in enumerate(parts):
        part_path = f"{path}.parts[{index}]"
        kind, value = _part(part, part_path)
        if kind == "text":
            content.append(value)
        elif kind == "thought":
            reasoning.append(value)
        elif kind == "functionCall":
            call_id, name, arguments = value
            calls.append(ToolCall(call_id or f"call_contents{turn}_{len(calls)}", name, arguments))
        else:
            raise _invalid(part_path, "functionResponse parts belong in user turns.")
    return Message("assistant", "".join(content), "".join(reasoning), tuple(calls))


def _joined(first: Message, second: Message) -> Message:
    return Message(
        "assistant",
        first.content + second.content,
        first.reasoning + second.reasoning,
        first.tool_calls + second.tool_calls,
    )


def _user_turn(parts: list[Any], path: str, pending: list[ToolCall]) -> list[Message]:
    messages: list[Message] = []
    texts: list[str] = []
    for index, part in enumerate(parts):
        part_path = f"{path}.parts[{index}]"
        kind, value = _part(part, part_path)
        if kind in ("text", "thought"):
            texts.append(value)
        elif kind == "functionResponse":
            if texts:
                messages.append(Message("user", "".join(texts)))
                texts = []
            response_id, name, response = value
            answered = _answered_call(pending, response_id, name)
            content = json.dumps(response, ensure_ascii=False)
            messages.append(Message("tool", content, tool_call_id=answered, name=name))
        else:
            raise _invalid(part_path, "functionCall parts belong in model turns.")
    if texts:
        messages.append(Message("user", "".join(texts)))
    return messages


def _answered_call(pending: list[ToolCall], response_id: str, name: str) -> str:
    """The id of the pending call a functionResponse answers (removed from `pending`), else its own id.

    By id first; then by name, since a client may drop or replace the ids of the calls it echoes."""
    position = next((i for i, call in enumerate(pending) if response_id and call.id == response_id), None)
    if position is None:
        position = next((i for i, call in enumerate(pending) if call.name == name), None)
    return response_id if position is None else pending.pop(position).id


def _part(part: Any, path: str) -> tuple[str, Any]:
    """(kind, value): ("text" | "thought", str), ("functionCall", (id, name, args)) or
    ("functionResponse", (id, name, response))."""
    part = _object(part, path, required=True)
    present = [key for key in _PART_DATA if _get(part, key) is not None]
    if len(present) != 1:
        raise _invalid(
            path,
            "A part must hold exactly one of: " + ", ".join(_PART_DATA) + f" (found {len(present)}).",
        )
    key = present[0]
    value = _get(part, key)
    field = f"{path}.{key}"
    if key in _MEDIA_PARTS:
        raise GatewayError(
            ErrorKind.UNSUPPORTED_CONTENT,
            f"{key} parts are not supported: this gateway serves text-only models.",
            param=field,
        )
    if key in _CODE_EXECUTION_PARTS:
        raise GatewayError(
            ErrorKind.UNSUPPORTED_CONTENT, f"{key} parts are not supported: this gateway runs no code.", param=field
        )
    if key == "text":
        text = _string(value, field, required=True)
        return ("thought" if _boolean(_get(part, "thought"), f"{path}.thought") else "text"), text
    call = _object(value, field)
    name = _string(_get(call, "name"), f"{field}.name", required=True)
    if not name:
        raise _invalid(f"{field}.name", "A function name is required.")
    call_id = _string(_get(call, "id"), f"{field}.id")
    if key == "functionCall":
        return key, (call_id, name, _object(_get(call, "args"), f"{field}.args"))
    if _array(_get(call, "parts"), f"{field}.parts"):
        raise GatewayError(
            ErrorKind.UNSUPPORTED_CONTENT,
            "Function responses with media parts are not supported: this gateway serves text-only models.",
            param=f"{field}.parts",
        )
    return key, (call_id, name, _object(_get(call, "response"), f"{field}.response"))


# ---------------------------------------------------------------------------------------------------
# Request → tools, tool choice, sampling
# ---------------------------------------------------------------------------------------------------


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    for index, tool in enumerate(_array(value, "tools")):
        path = f"tools[{index}]"
        tool = _object(tool, path, required=True)
        for key, declarations in tool.items():
            if declarations is None:
                continue
            if _camel(key) != "functionDeclarations":
                raise GatewayError(
                    ErrorKind.UNSUPPORTED_CONTENT,
                    f"The built-in tool {key} is not supported: this gateway serves function declarations only.",
                    param=f"{path}.{key}",
                )
            for position, declaration in enumerate(_array(declarations, f"{path}.functionDeclarations")):
                specs.append(_declaration(declaration, f"{path}.functionDeclarations[{position}]"))
    _check.unique_tool_names(specs, ["tools"] * len(specs))
    return tuple(specs)


# A harness's tools, converted once: the same object in every call that repeats them (BodyDecoder).
_known_tools = ByIdentity(_tools)


def _declaration(declaration: Any, path: str) -> ToolSpec:
    declaration = _object(declaration, path, required=True)
    name = _string(_get(declaration, "name"), f"{path}.name", required=True)
    if not name:
        raise _invalid(f"{path}.name", "A function declaration needs a name.")
    description = _string(_get(declaration, "description"), f"{path}.description")
    schema, json_schema = _get(declaration, "parameters"), _get(declaration, "parametersJsonSchema")
    if schema is not None and json_schema is not None:
        raise _invalid(f"{path}.parametersJsonSchema", "parameters and parametersJsonSchema are mutually exclusive.")
    if json_schema is not None:
        parameters = _object(json_schema, f"{path}.parametersJsonSchema")
    elif schema is not None:
        parameters = _json_schema(_object(schema, f"{path}.parameters"))
    else:
        parameters = {"type": "object", "properties": {}}
    return ToolSpec(name, description, parameters)


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The API's Schema (OpenAPI subset, type names like "OBJECT") as the JSON Schema chat templates show."""
    converted: dict[str, Any] = {}
    for key, value in schema.items():
        key = _camel(key)
        if key == "type" and isinstance(value, str):
            value = value.lower()
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _json_schema(sub) if isinstance(sub, dict) else sub for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_json_schema(sub) if isinstance(sub, dict) else sub for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            value = _json_schema(value)
        converted[key] = value
    return converted


def _output_schema(generation: dict[str, Any]) -> dict[str, Any] | None:
    json_schema = _get(generation, "responseJsonSchema")
    if json_schema is not None:
        return _object(json_schema, "generationConfig.responseJsonSchema")
    schema = _get(generation, "responseSchema")
    if schema is not None:
        return _closed(_json_schema(_object(schema, "generationConfig.responseSchema")))
    return None


def _closed(schema: Any) -> Any:
    """The API's Schema answers with the properties it lists and no others: as JSON Schema, every object
    that lists properties gets `additionalProperties: false`."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _tool_choice(value: Any, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    path = "toolConfig.functionCallingConfig"
    config = _object(_get(_object(value, "toolConfig"), "functionCallingConfig"), path)
    mode = (_string(_get(config, "mode"), f"{path}.mode") or "AUTO").upper()
    if mode not in _FUNCTION_CALLING_MODES:
        raise _invalid(f"{path}.mode", f"Invalid function calling mode {mode!r}: use AUTO, ANY, NONE or VALIDATED.")
    allowed = _array(_get(config, "allowedFunctionNames"), f"{path}.allowedFunctionNames")
    declared = {spec.name for spec in tools}
    for index, name in enumerate(allowed):
        if _string(name, f"{path}.allowedFunctionNames[{index}]", required=True) not in declared:
            raise _invalid(
                f"{path}.allowedFunctionNames[{index}]", f"Function {name!r} is not among the function declarations."
            )
    if mode == "NONE":
        return ToolChoice.none()
    if mode != "ANY":
        return ToolChoice.auto()
    if not tools:
        raise _invalid(f"{path}.mode", "Function calling mode ANY needs function declarations in tools.")
    return ToolChoice.function(allowed[0]) if len(allowed) == 1 else ToolChoice.required(tuple(allowed))


def _sampling(generation: dict[str, Any]) -> Sampling:
    path = "generationConfig"
    candidates = _integer(_get(generation, "candidateCount"), f"{path}.candidateCount", minimum=1)
    if candidates not in (None, 1):
        raise _invalid(f"{path}.candidateCount", "Only one candidate can be generated (candidateCount 1).")
    for index, modality in enumerate(_array(_get(generation, "responseModalities"), f"{path}.responseModalities")):
        if _string(modality, f"{path}.responseModalities[{index}]", required=True).upper() != "TEXT":
            raise GatewayError(
                ErrorKind.UNSUPPORTED_CONTENT,
                f"Response modality {modality} is not supported: this gateway serves text-only models.",
                param=f"{path}.responseModalities[{index}]",
            )
    stop = _array(_get(generation, "stopSequences"), f"{path}.stopSequences")
    for index, sequence in enumerate(stop):
        if not _string(sequence, f"{path}.stopSequences[{index}]", required=True):
            raise _invalid(f"{path}.stopSequences[{index}]", "A stop sequence must not be empty.")
    return Sampling(
        max_tokens=_integer(_get(generation, "maxOutputTokens"), f"{path}.maxOutputTokens", minimum=1),
        temperature=_check.number(_get(generation, "temperature"), f"{path}.temperature", 0, 2, optional=True),
        top_p=_check.number(_get(generation, "topP"), f"{path}.topP", 0, 1, optional=True),
        top_k=_integer(_get(generation, "topK"), f"{path}.topK", minimum=1),
        stop=tuple(stop),
        seed=_integer(_get(generation, "seed"), f"{path}.seed"),
    )


# ---------------------------------------------------------------------------------------------------
# Result → response, streaming, errors
# ---------------------------------------------------------------------------------------------------


def _parts(output: ParsedOutput, *, include_thoughts: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if include_thoughts and output.reasoning:
        parts.append({"text": output.reasoning, "thought": True})
    if output.content:
        parts.append({"text": output.content})
    parts.extend(_function_call(call.id, call.name, call.arguments) for call in output.tool_calls)
    return parts


def _function_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": arguments}}


def _chunk(
    request: DialectRequest,
    call: CallInfo,
    parts: list[dict[str, Any]],
    finish: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A GenerateContentResponse: the whole response, or one streamed chunk of it."""
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    body: dict[str, Any] = {"candidates": [candidate]}
    if usage is not None:
        body["usageMetadata"] = usage
    body["modelVersion"] = request.model
    body["responseId"] = call.call_id
    return body


def _finish(finish: FinishKind) -> str:
    # Gemini ends a turn of function calls, and a turn cut by a stop sequence, with STOP as well.
    if finish in (FinishKind.LENGTH, FinishKind.CONTEXT_LENGTH):
        return "MAX_TOKENS"
    if finish is FinishKind.ABORTED:
        return "OTHER"
    return "STOP"


def _usage(usage: Usage) -> dict[str, int]:
    # Reasoning tokens are not counted apart, so they are inside candidatesTokenCount.
    return {
        "promptTokenCount": usage.prompt_tokens,
        "candidatesTokenCount": usage.completion_tokens,
        "totalTokenCount": usage.prompt_tokens + usage.completion_tokens,
    }


def _error_body(error: GatewayError) -> tuple[int, dict[str, Any]]:
    code, status = _ERROR_STATUS[error.kind]
    message = error.message
    if isinstance(error, ContextLengthError):
        message = (
            f"The input token count ({error.prompt_tokens}) exceeds the maximum number of tokens allowed "
            f"({error.max_prompt_tokens})."
        )
    elif error.kind is ErrorKind.CONTEXT_LENGTH and not message.startswith(_CONTEXT_MESSAGE):
        message = f"{_CONTEXT_MESSAGE}: {message}"
    body: dict[str, Any] = {"code": code, "message": message, "status": status}
    if error.param is not None and code == 400:
        body["details"] = [
            {
                "@type": "type.googleapis.com/google.rpc.BadRequest",
                "fieldViolations": [{"field": error.param, "description": message}],
            }
        ]
    return code, {"error": body}


class _StreamRenderer(StreamRenderer):
    """Chunks as SSE events (`alt=sse`) or as the elements of one JSON array (the REST default)."""

    def __init__(self, request: DialectRequest, call: CallInfo) -> None:
        self._request = request
        self._call = call
        self._sse = bool(request.echo["sse"])
        self._include_thoughts = bool(request.echo["include_thoughts"])
        self.media_type = "text/event-stream" if self._sse else "application/json"
        self._chunks_sent = 0
        # Function calls being streamed: index → (id, name, argument JSON so far); each is sent whole.
        self._calls: dict[int, tuple[str, str, str]] = {}

    def start(self) -> list[bytes]:
        return [] if self._sse else [b"["]

    def events(self, event: ParseEvent) -> list[bytes]:
        if isinstance(event, TextDelta) and event.text:
            return [self._send(_chunk(self._request, self._call, [{"text": event.text}]))]
        if isinstance(event, ReasoningDelta) and event.text and self._include_thoughts:
            return [self._send(_chunk(self._request, self._call, [{"text": event.text, "thought": True}]))]
        if isinstance(event, ToolCallStart):
            self._calls[event.index] = (event.id, event.name, "")
        elif isinstance(event, ToolCallArgumentsDelta):
            call_id, name, arguments = self._calls[event.index]
            self._calls[event.index] = (call_id, name, arguments + event.arguments)
        elif isinstance(event, ToolCallEnd):
            call_id, name, arguments = self._calls.pop(event.index)
            part = _function_call(call_id, name, json.loads(arguments))
            return [self._send(_chunk(self._request, self._call, [part]))]
        return []

    def finish(self, result: DialectResult) -> list[bytes]:
        # The API's closing chunk: an empty text part carrying the finish reason and the final usage.
        body = _chunk(self._request, self._call, [{"text": ""}], _finish(result.finish), _usage(result.usage))
        return self._close(self._send(body))

    def error(self, error: GatewayError) -> list[bytes]:
        return self._close(self._send(_error_body(error)[1]))

    def _send(self, body: dict[str, Any]) -> bytes:
        self._chunks_sent += 1
        if self._sse:
            return sse(body)
        separator = ",\r\n" if self._chunks_sent > 1 else ""
        return separator.encode() + json_bytes(body)

    def _close(self, last: bytes) -> list[bytes]:
        return [last] if self._sse else [last, b"]"]


# ---------------------------------------------------------------------------------------------------
# The dialect
# ---------------------------------------------------------------------------------------------------


class GeminiDialect(Dialect):
    name = "gemini"
    record_dialect = common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT

    def parse_request(self, body: Any, route: Route) -> DialectRequest:
        if not isinstance(body, dict):
            raise _invalid(None, "Invalid JSON payload received: the body must be a JSON object.")
        if not route.model:
            raise _invalid(None, "The URL names no model: use /v1beta/models/MODEL:generateContent.")
        if _get(body, "cachedContent") not in (None, ""):
            raise _invalid(
                "cachedContent", "Cached contents are not supported by this gateway: send the full contents."
            )
        generation = _object(_get(body, "generationConfig"), "generationConfig")
        tools = _known_tools(_get(body, "tools"))
        tool_choice = _tool_choice(_get(body, "toolConfig"), tools)
        messages = _conversation(_get(body, "contents"), _get(body, "systemInstruction"))
        sampling = _sampling(generation)
        thinking = _object(_get(generation, "thinkingConfig"), "generationConfig.thinkingConfig")
        include_thoughts = _boolean(
            _get(thinking, "includeThoughts"), "generationConfig.thinkingConfig.includeThoughts"
        )
        alt = route.query.get("alt", route.query.get("$alt", ""))
        return DialectRequest(
            output_schema=_output_schema(generation),
            model=route.model,
            conversation=Conversation(messages, tools, tool_choice),
            sampling=sampling,
            stream=bool(route.stream),
            parse_tool_calls=tool_choice.mode != "none",
            echo={"sse": alt == "sse", "include_thoughts": include_thoughts},
        )

    def parse_count_tokens(self, body: Any, route: Route) -> DialectRequest:
        """A `:countTokens` body: `contents` alone, or a whole `generateContentRequest`."""
        if not isinstance(body, dict):
            raise _invalid(None, "Invalid JSON payload received: the body must be a JSON object.")
        whole = _get(body, "generateContentRequest")
        if whole is not None and _get(body, "contents") is not None:
            raise _invalid("contents", "Give either contents or generateContentRequest, not both.")
        request = _object(whole, "generateContentRequest") if whole is not None else body
        return self.parse_request(request, dataclasses.replace(route, stream=False))

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        return {"totalTokens": input_tokens}

    def render_response(self, request: DialectRequest, result: DialectResult) -> dict[str, Any]:
        parts = _parts(result.output, include_thoughts=request.echo["include_thoughts"])
        return _chunk(request, result.call, parts or [{"text": ""}], _finish(result.finish), _usage(result.usage))

    def stream_renderer(self, request: DialectRequest, call: CallInfo) -> StreamRenderer:
        return _StreamRenderer(request, call)

    def error_response(self, error: GatewayError) -> tuple[int, dict[str, Any]]:
        return _error_body(error)


DIALECT = GeminiDialect()
