"""The Anthropic Messages dialect: pure translation, checked against the real `anthropic` SDK.

Responses are validated by the SDK's own types; streams are read by the SDK's real streaming client
(`messages.stream` → `get_final_message`) over an in-memory transport that serves the renderer's bytes.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from gateway.conversation import Message, ToolCall, ToolChoice, ToolSpec, turns_match
from gateway.dialects.anthropic import DIALECT
from gateway.dialects.base import (
    CallInfo,
    DialectResult,
    ErrorKind,
    FinishKind,
    GatewayError,
    Route,
    Usage,
)
from gateway.parsers import HermesParser, ParsedOutput, TextDelta, collect

UNSUPPORTED = ErrorKind.UNSUPPORTED_CONTENT
ROUTE = Route("/v1/messages", query={"beta": "true"})
CALL = CallInfo(call_id="c0ffee", created=1_700_000_000, prompt_tokens=42)
TOOL = {"name": "read_file", "description": "Read a file", "input_schema": {"type": "object"}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]} | fields


def parse(**fields: Any):
    return DIALECT.parse_request(body(**fields), ROUTE)


def bad(kind: ErrorKind = ErrorKind.INVALID_REQUEST, **fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        parse(**fields)
    assert caught.value.kind is kind
    return caught.value


# --- request: system prompts -----------------------------------------------------------------------


def test_system_string_blocks_and_system_messages_fold_in_order():
    request = parse(
        system=[
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            {"role": "system", "content": "Env: linux"},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "Reminder"}]},
            {"role": "assistant", "content": "hello"},
        ],
    )
    assert request.conversation.messages == (
        Message("system", "You are Claude Code.\nBe brief.\nEnv: linux\nReminder"),
        Message("user", "hi"),
        Message("assistant", "hello"),
    )


@pytest.mark.parametrize("system", [None, "", []])
def test_no_system_prompt_means_no_system_turn(system):
    assert parse(system=system).conversation.messages == (Message("user", "hi"),)


def test_a_system_image_is_unsupported():
    error = bad(ErrorKind.UNSUPPORTED_CONTENT, system=[{"type": "image", "source": {}}])
    assert error.param == "system.0.type"


def test_only_system_messages_is_a_400():
    error = bad(messages=[{"role": "system", "content": "x"}])
    assert error.param == "messages"


# --- request: content blocks -----------------------------------------------------------------------


def test_user_text_blocks_and_tool_results_keep_block_order():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "read it"}, {"type": "text", "text": "now"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should read.", "signature": "sig"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a"}},
                {"type": "tool_use", "id": "toolu_2", "name": "read_file", "input": {"path": "b"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "A", "cache_control": {}},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "no such"}, {"type": "text", "text": "file"}],
                    "is_error": True,
                },
                {"type": "tool_result", "tool_use_id": "toolu_3"},
                {"type": "text", "text": "<system-reminder>go on</system-reminder>"},
            ],
        },
    ]
    request = parse(messages=messages, tools=[TOOL])
    assert request.conversation.messages == (
        Message("user", "read it\nnow"),
        Message(
            "assistant",
            "Reading.",
            "I should read.",
            (
                ToolCall("toolu_1", "read_file", {"path": "a"}),
                ToolCall("toolu_2", "read_file", {"path": "b"}),
            ),
        ),
        Message("tool", "A", tool_call_id="toolu_1", name="read_file"),
        Message("tool", "no such\nfile", tool_call_id="toolu_2", name="read_file"),
        Message("tool", "", tool_call_id="toolu_3"),
        Message("user", "<system-reminder>go on</system-reminder>"),
    )


@pytest.mark.parametrize("counting", [False, True])
def test_a_user_message_without_blocks_is_a_400_as_anthropic_answers(counting):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": []},
    ]
    parse_body = DIALECT.parse_count_tokens if counting else DIALECT.parse_request
    with pytest.raises(GatewayError) as caught:
        parse_body(body(messages=messages), ROUTE)
    assert (caught.value.kind, caught.value.param) == (ErrorKind.INVALID_REQUEST, "messages.2.content")
    status, error_body = DIALECT.error_response(caught.value)
    assert status == 400
    error = ErrorResponse.model_validate(error_body).error
    assert error.type == "invalid_request_error"
    assert error.message.startswith("messages.2.content: ")


def test_assistant_blocks_concatenate_as_streamed_and_redacted_thinking_adds_nothing():
    content = [
        {"type": "thinking", "thinking": "first", "signature": "s"},
        {"type": "text", "text": "Hello"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "thinking", "thinking": "\nsecond", "signature": "s"},
        {"type": "text", "text": "\nworld"},
    ]
    request = parse(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}])
    assert request.conversation.messages[1] == Message("assistant", "Hello\nworld", "first\nsecond")


@pytest.mark.parametrize(
    ("role", "block", "kind", "param"),
    [
        ("user", {"type": "image", "source": {}}, UNSUPPORTED, "messages.0.content.0.type"),
        ("user", {"type": "document", "source": {}}, UNSUPPORTED, "messages.0.content.0.type"),
        ("assistant", {"type": "server_tool_use"}, UNSUPPORTED, "messages.0.content.0.type"),
        ("user", {"type": "tool_use", "id": "x"}, ErrorKind.INVALID_REQUEST, "messages.0.content.0.type"),
        ("assistant", {"type": "tool_result"}, ErrorKind.INVALID_REQUEST, "messages.0.content.0.type"),
        ("user", {"text": "no type"}, ErrorKind.INVALID_REQUEST, "messages.0.content.0.type"),
        ("user", {"type": "text", "text": 3}, ErrorKind.INVALID_REQUEST, "messages.0.content.0.text"),
        ("user", "not a block", ErrorKind.INVALID_REQUEST, "messages.0.content.0"),
        ("user", {"type": "tool_result"}, ErrorKind.INVALID_REQUEST, "messages.0.content.0.tool_use_id"),
        (
            "user",
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]},
            UNSUPPORTED,
            "messages.0.content.0.content.0.type",
        ),
        (
            "user",
            {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"},
            ErrorKind.INVALID_REQUEST,
            "messages.0.content.0.is_error",
        ),
        (
            "assistant",
            {"type": "tool_use", "id": "t", "name": "f", "input": "{}"},
            ErrorKind.INVALID_REQUEST,
            "messages.0.content.0.input",
        ),
        ("assistant", {"type": "thinking"}, ErrorKind.INVALID_REQUEST, "messages.0.content.0.thinking"),
    ],
)
def test_bad_blocks_name_their_field(role, block, kind, param):
    assert bad(kind, messages=[{"role": role, "content": [block]}]).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"messages": None}, "messages"),
        ({"messages": {}}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
        ({"system": 5}, "system"),
        ({"system": [{"text": "no type"}]}, "system.0.type"),
        ({"temperature": 1.5}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 10**400}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 0.5}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stop_sequences": ["END", ""]}, "stop_sequences.1"),
        ({"stream": "yes"}, "stream"),
        ({"tools": {}}, "tools"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"input_schema": {}}]}, "tools.0.name"),
        ({"tools": [{"name": "f", "input_schema": []}]}, "tools.0.input_schema"),
        ({"tools": [{"name": "f", "description": 1, "input_schema": {}}]}, "tools.0.description"),
        ({"tools": [TOOL, TOOL]}, "tools.1.name"),
        ({"tools": [{"type": 3}]}, "tools.0.type"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "required"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice.name"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
            "tool_choice.disable_parallel_tool_use",
        ),
    ],
)
def test_bad_fields_name_themselves(fields, param):
    assert bad(**fields).param == param


def test_body_must_be_an_object():
    with pytest.raises(GatewayError) as caught:
        DIALECT.parse_request([body()], ROUTE)
    assert caught.value.kind is ErrorKind.INVALID_REQUEST


# --- request: tools, tool_choice, sampling, ignored fields -----------------------------------------


def test_custom_tools_reach_the_model_and_anthropic_defined_tools_are_skipped():
    request = parse(
        tools=[
            TOOL | {"cache_control": {"type": "ephemeral"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
            {"type": "custom", "name": "bash", "input_schema": {"type": "object", "properties": {}}},
        ]
    )
    assert request.conversation.tools == (
        ToolSpec("read_file", "Read a file", {"type": "object"}),
        ToolSpec("bash", "", {"type": "object", "properties": {}}),
    )
    assert request.conversation.tool_choice == ToolChoice.auto()
    assert request.parse_tool_calls


@pytest.mark.parametrize(
    ("choice", "expected", "parsed"),
    [
        ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice.auto(), True),
        ({"type": "any"}, ToolChoice.required(), True),
        ({"type": "tool", "name": "read_file"}, ToolChoice.function("read_file"), True),
        ({"type": "none"}, ToolChoice.none(), False),
    ],
)
def test_tool_choice_forms(choice, expected, parsed):
    request = parse(tools=[TOOL], tool_choice=choice)
    assert request.conversation.tool_choice == expected
    assert request.parse_tool_calls is parsed


def test_without_custom_tools_output_is_not_parsed_for_calls():
    assert not parse().parse_tool_calls
    assert not parse(tools=[{"type": "bash_20250124", "name": "bash"}]).parse_tool_calls


def test_sampling_fields():
    request = parse(temperature=0.7, top_p=1, top_k=40, stop_sequences=["END", "\n\nHuman:"], stream=True)
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature) == (32000, 0.7)
    assert (sampling.top_p, sampling.top_k) == (1.0, 40)
    assert sampling.stop == ("END", "\n\nHuman:")
    assert request.stream
    assert not parse().stream and parse().sampling.temperature is None


def test_claude_code_fields_are_accepted_and_change_nothing():
    plain = parse(system="S")
    claude_code = parse(
        system="S",
        thinking={"type": "enabled", "budget_tokens": 31999},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": "u"},
        service_tier="auto",
        betas=["interleaved-thinking-2025-05-14"],
        cache_control={"type": "ephemeral"},
        some_future_field={"x": [1]},
    )
    assert claude_code == plain


def test_count_tokens_takes_no_max_tokens_and_never_streams():
    request = DIALECT.parse_count_tokens(
        {"model": "tiny", "system": "S", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]},
        Route("/v1/messages/count_tokens"),
    )
    assert request.sampling.max_tokens is None and not request.stream
    assert request.conversation.messages == (Message("system", "S"), Message("user", "hi"))
    assert DIALECT.count_tokens_response(17) == {"input_tokens": 17}
    with pytest.raises(GatewayError):
        DIALECT.parse_count_tokens({"model": "tiny"}, Route("/v1/messages/count_tokens"))
    # The route alone says it, so parse_request serves the count_tokens route too.
    counted = DIALECT.parse_request(body(max_tokens=None), Route("/v1/messages/count_tokens"))
    assert counted.sampling.max_tokens is None


# --- responses -------------------------------------------------------------------------------------

OUTPUTS = {
    "text": ("Hello there.", FinishKind.STOP),
    "thinking and text": ("<think>\nLet me see.\n</think>\n\nIt is 4.", FinishKind.STOP),
    "tool calls": (
        '<think>I need files.</think>Reading both.\n<tool_call>\n{"name": "read_file", "arguments": '
        '{"path": "a.py"}}\n</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": '
        '{"path": "b", "opts": {"n": [1, 2.5, null, true]}}}\n</tool_call>',
        FinishKind.TOOL_CALLS,
    ),
    "text around reasoning": ("Hello<think>hmm</think>world<think>again</think>!", FinishKind.STOP),
    "empty": ("", FinishKind.STOP),
    "cut": ("<think>unfinished", FinishKind.LENGTH),
    "context": ('partial <tool_call>{"name"', FinishKind.CONTEXT_LENGTH),
}


def result_for(text: str, finish: FinishKind, stop_sequence: str | None = None) -> DialectResult:
    output = HermesParser().parse(text, call_id=CALL.call_id)
    return DialectResult(CALL, output, finish, Usage(CALL.prompt_tokens, 9), stop_sequence)


@pytest.mark.parametrize("name", OUTPUTS)
def test_responses_validate_as_sdk_messages(name):
    text, finish = OUTPUTS[name]
    result = result_for(text, finish)
    response = DIALECT.render_response(parse(), result)
    message = SdkMessage.model_validate(response)
    assert message.id == "msg_c0ffee" and message.model == "tiny"
    assert message.usage.input_tokens == 42 and message.usage.output_tokens == 9
    assert reassembled(message) == result.output
    expected_reason = {
        FinishKind.STOP: "end_turn",
        FinishKind.TOOL_CALLS: "tool_use",
        FinishKind.LENGTH: "max_tokens",
        FinishKind.CONTEXT_LENGTH: "model_context_window_exceeded",
    }[finish]
    assert message.stop_reason == expected_reason and message.stop_sequence is None


def test_response_block_order_and_shapes():
    response = DIALECT.render_response(parse(), result_for(*OUTPUTS["tool calls"]))
    assert [block["type"] for block in response["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, _, call, _ = response["content"]
    assert thinking["signature"]
    assert call == {"type": "tool_use", "id": "call_c0ffee_0", "name": "read_file", "input": {"path": "a.py"}}


def test_stop_sequence_is_reported():
    response = DIALECT.render_response(parse(), result_for("Done", FinishKind.STOP_SEQUENCE, "END"))
    message = SdkMessage.model_validate(response)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")


def reassembled(message: Any) -> ParsedOutput:
    """A message's blocks read back the way this dialect reads an echoed assistant turn."""
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    echoed = {"role": "assistant", "content": blocks}
    request = parse(messages=[{"role": "user", "content": "hi"}, echoed])
    turn = request.conversation.messages[-1]
    return ParsedOutput(turn.content, turn.reasoning, turn.tool_calls)


# --- streams, read by the real SDK -----------------------------------------------------------------


def stream_bytes(text: str, finish: FinishKind, chunk: int, stop_sequence: str | None = None) -> list[bytes]:
    renderer = DIALECT.stream_renderer(parse(stream=True), CALL)
    parser = HermesParser().stream(call_id=CALL.call_id)
    out = renderer.start()
    events = []
    for start in range(0, len(text), chunk):
        new = parser.feed(text[start : start + chunk])
        events += new
        for event in new:
            out += renderer.events(event)
    for event in parser.finish():
        events.append(event)
        out += renderer.events(event)
    result = DialectResult(CALL, collect(events), finish, Usage(CALL.prompt_tokens, 9), stop_sequence)
    return out + renderer.finish(result)


def sdk_client(chunks: list[bytes]) -> anthropic.Anthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx2.Response(200, headers=headers, content=b"".join(chunks))

    return mock_client(handler)


def mock_client(handler) -> anthropic.Anthropic:
    """The real SDK client, its HTTP answered in memory by `handler`."""
    transport = httpx2.MockTransport(handler)
    http_client = httpx2.Client(transport=transport)
    return anthropic.Anthropic(api_key="k", base_url="http://gateway", max_retries=0, http_client=http_client)


def sdk_stream(chunks: list[bytes]) -> SdkMessage:
    client = sdk_client(chunks)
    messages = [{"role": "user", "content": "hi"}]
    with client.messages.stream(model="tiny", max_tokens=32000, messages=messages) as stream:
        return stream.get_final_message()


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for raw in b"".join(chunks).decode().split("\n\n"):
        if raw:
            head, data = raw.split("\n")
            assert head.startswith("event: ") and data.startswith("data: ")
            events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("name", OUTPUTS)
def test_streams_reassemble_in_the_sdk(name, chunk):
    text, finish = OUTPUTS[name]
    chunks = stream_bytes(text, finish, chunk)
    final = sdk_stream(chunks)
    expected = HermesParser().parse(text, call_id=CALL.call_id)
    assert reassembled(final) == expected
    assert final.id == "msg_c0ffee" and final.usage.input_tokens == 42 and final.usage.output_tokens == 9
    assert final.stop_reason == DIALECT.render_response(parse(), result_for(text, finish))["stop_reason"]
    assert all(call.input == tool.arguments for call, tool in zip(tool_uses(final), expected.tool_calls))


def tool_uses(message: Any) -> list[Any]:
    return [block for block in message.content if block.type == "tool_use"]


def test_stream_event_grammar():
    chunks = stream_bytes(OUTPUTS["tool calls"][0], FinishKind.TOOL_CALLS, 4)
    events = sse_events(chunks)
    adapter = TypeAdapter(RawMessageStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["input_tokens"] == 42
    # Blocks open, take deltas and close one at a time, with consecutive indices.
    open_index = None
    next_index = 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None and next_index == 4
    kinds = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"]
    deltas = [data["delta"]["type"] for name, data in events if name == "content_block_delta"]
    assert "signature_delta" in deltas and "input_json_delta" in deltas
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_stream_stop_sequence():
    final = sdk_stream(stream_bytes("Done", FinishKind.STOP_SEQUENCE, 2, "END"))
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


def test_error_after_start_reaches_the_sdk_as_its_error():
    renderer = DIALECT.stream_renderer(parse(stream=True), CALL)
    chunks = renderer.start() + renderer.events(TextDelta("partial"))
    chunks += renderer.error(GatewayError(ErrorKind.OVERLOADED, "inference server unavailable"))
    assert sse_events(chunks)[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "inference server unavailable"}},
    )
    with pytest.raises(anthropic.APIStatusError) as caught:
        sdk_stream(chunks)
    assert caught.value.body["error"]["type"] == "overloaded_error"


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "error_type", "sdk_error"),
    [
        (ErrorKind.INVALID_REQUEST, 400, "invalid_request_error", anthropic.BadRequestError),
        (ErrorKind.UNSUPPORTED_CONTENT, 400, "invalid_request_error", anthropic.BadRequestError),
        (ErrorKind.CONTEXT_LENGTH, 400, "invalid_request_error", anthropic.BadRequestError),
        (ErrorKind.AUTHENTICATION, 401, "authentication_error", anthropic.AuthenticationError),
        (ErrorKind.NOT_FOUND, 404, "not_found_error", anthropic.NotFoundError),
        (ErrorKind.OVERLOADED, 529, "overloaded_error", anthropic.OverloadedError),
        (ErrorKind.INTERNAL, 500, "api_error", anthropic.InternalServerError),
    ],
)
def test_error_shapes(kind, status, error_type, sdk_error):
    got_status, error_body = DIALECT.error_response(GatewayError(kind, "it went wrong", param="max_tokens"))
    assert (got_status, error_body["error"]["type"]) == (status, error_type)
    ErrorResponse.model_validate(error_body)
    assert error_body["error"]["message"].startswith("max_tokens: ")

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, json=error_body)

    client = mock_client(handler)
    with pytest.raises(sdk_error) as caught:
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == status and caught.value.body == error_body


def test_context_length_message_says_prompt_is_too_long():
    error = GatewayError(ErrorKind.CONTEXT_LENGTH, "9000 tokens > 8192 maximum")
    message = DIALECT.error_response(error)[1]["error"]["message"]
    assert message == "prompt is too long: 9000 tokens > 8192 maximum"
    already = GatewayError(ErrorKind.CONTEXT_LENGTH, "prompt is too long: 9000 tokens > 8192 maximum")
    assert DIALECT.error_response(already)[1]["error"]["message"] == already.message


# --- echoed history matches what was sampled -------------------------------------------------------


@pytest.mark.parametrize("name", OUTPUTS)
def test_a_streamed_turn_echoed_back_matches_its_output(name):
    text, finish = OUTPUTS[name]
    final = sdk_stream(stream_bytes(text, finish, 2))
    echoed = reassembled(final).message()
    sampled = HermesParser().parse(text, call_id=CALL.call_id).message()
    assert turns_match(echoed, sampled, strict_reasoning=True)


# --- fuzzing ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, json_values)


text_block = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)})


def blocks(types: list[str]) -> st.SearchStrategy[Any]:
    block = st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(types))},
        optional={
            "text": maybe(st.text(max_size=4)),
            "thinking": maybe(st.text(max_size=4)),
            "data": maybe(st.text(max_size=4)),
            "id": maybe(st.text(max_size=4)),
            "tool_use_id": maybe(st.text(max_size=4)),
            "name": maybe(st.sampled_from(["read_file", "", "other"])),
            "input": maybe(st.dictionaries(st.text(max_size=3), json_values, max_size=2)),
            "content": maybe(st.text(max_size=4) | st.lists(text_block, max_size=2)),
            "is_error": maybe(st.booleans()),
        },
    )
    return maybe(st.text(max_size=4) | st.lists(block, max_size=3))


ALL_BLOCKS = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
fuzz_message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "assistant", "system"])), "content": blocks(ALL_BLOCKS)}
)
fuzz_tool = maybe(
    st.fixed_dictionaries(
        {
            "name": maybe(st.sampled_from(["read_file", "bash", ""])),
            "input_schema": maybe(st.just({"type": "object"})),
        },
        optional={
            "type": maybe(st.sampled_from(["custom", "web_search_20250305"])),
            "description": maybe(st.text(max_size=3)),
        },
    )
)
fuzz_body = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"model": maybe(st.just("tiny")), "messages": maybe(st.lists(fuzz_message, max_size=4))},
        optional={
            "max_tokens": maybe(st.integers(min_value=-5, max_value=2**33)),
            "system": blocks(["text", "image"]),
            "tools": maybe(st.lists(fuzz_tool, max_size=3)),
            "tool_choice": maybe(
                st.fixed_dictionaries(
                    {"type": maybe(st.sampled_from(["auto", "any", "tool", "none"]))},
                    optional={
                        "name": maybe(st.sampled_from(["read_file", "bash"])),
                        "disable_parallel_tool_use": maybe(st.booleans()),
                    },
                )
            ),
            "temperature": maybe(st.floats(min_value=0, max_value=1)),
            "top_p": maybe(st.floats(min_value=0, max_value=1)),
            "top_k": maybe(st.integers(min_value=0, max_value=100)),
            "stop_sequences": maybe(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
            "stream": maybe(st.booleans()),
            "thinking": json_values,
        },
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzz_body, st.booleans())
def test_fuzzed_bodies_parse_or_fail_as_client_errors(raw, counting):
    parse_body = DIALECT.parse_count_tokens if counting else DIALECT.parse_request
    try:
        request = parse_body(raw, ROUTE)
    except GatewayError as error:
        assert error.kind in (ErrorKind.INVALID_REQUEST, ErrorKind.UNSUPPORTED_CONTENT)
        status, error_body = DIALECT.error_response(error)
        assert status == 400
        ErrorResponse.model_validate(error_body)
    else:
        assert request.model == "tiny" and request.conversation.messages
