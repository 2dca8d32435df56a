"""OpenAI Responses dialect: request translation, bad inputs, response objects and the streaming event
sequence as the real `openai` SDK reads them (its pydantic types, its stream accumulator)."""

import json

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from gateway.conversation import Message, ToolCall, ToolChoice, ToolSpec
from gateway.dialects.base import (
    CallInfo,
    DialectRequest,
    DialectResult,
    ErrorKind,
    FinishKind,
    GatewayError,
    Route,
    Sampling,
    Usage,
)
from gateway.dialects.openai_responses import DIALECT
from gateway.parsers import HermesParser

ROUTE = Route("/v1/responses")
CALL = CallInfo(call_id="r9", created=1_700_000_000, prompt_tokens=30)
TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command",
    "strict": False,
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
}


def parse(**body):
    return DIALECT.parse_request({"model": "m", "input": "hi", **body}, ROUTE)


def rejected(body):
    with pytest.raises(GatewayError) as caught:
        DIALECT.parse_request(body, ROUTE)
    return caught.value


# ---------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------


def test_string_input_and_instructions():
    request = parse(instructions="You are Codex.")
    assert request.conversation.messages == (Message("system", "You are Codex."), Message("user", "hi"))
    assert request.sampling == Sampling() and not request.stream


def test_every_input_item_form_translates():
    request = DIALECT.parse_request(
        {
            "model": "m",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                {"role": "system", "content": "sys"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "dropped"}],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                    "encrypted_content": "opaque",
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "shell",
                    "arguments": '{"command": ["ls"]}',
                    "status": "completed",
                },
                {"type": "function_call", "call_id": "call_2", "name": "date", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "Monday"}],
                },
                {"type": "message", "role": "assistant", "content": "Done."},
                {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No more."}]},
                {"role": "user", "content": "thanks"},
            ],
        },
        ROUTE,
    )
    assert request.conversation.messages == (
        Message("system", "rules"),
        Message("system", "sys"),
        Message("user", "a\nb"),
        Message(
            "assistant",
            "Listing.",
            "think",
            (ToolCall("call_1", "shell", {"command": ["ls"]}), ToolCall("call_2", "date", {})),
        ),
        Message("tool", "a.txt", tool_call_id="call_1", name="shell"),
        Message("tool", "Monday", tool_call_id="call_2", name="date"),
        # Consecutive assistant items are one turn, as the parser joins an output's segments.
        Message("assistant", "Done.\nNo more."),
        Message("user", "thanks"),
    )


def test_echoed_output_items_give_back_the_parsed_reply():
    text = '<think>plan</think>Listing.<tool_call>{"name": "shell", "arguments": {"command": ["ls"]}}</tool_call>'
    body = DIALECT.render_response(parse(tools=[TOOL]), result(text, FinishKind.TOOL_CALLS))
    request = DIALECT.parse_request(
        {"model": "m", "input": [{"role": "user", "content": "go"}, *body["output"]]}, ROUTE
    )
    assert request.conversation.messages[-1] == parser.parse(text, call_id=CALL.call_id).message()


@pytest.mark.parametrize(
    ("choice", "expected", "parses_calls"),
    [
        (None, ToolChoice.auto(), True),
        ("none", ToolChoice.none(), False),
        ("required", ToolChoice.required(), True),
        ({"type": "function", "name": "shell"}, ToolChoice.function("shell"), True),
    ],
)
def test_tools_and_tool_choice(choice, expected, parses_calls):
    request = parse(
        tools=[TOOL, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}], tool_choice=choice
    )
    assert request.conversation.tools == (ToolSpec("shell", "Run a command", TOOL["parameters"]),)
    assert request.conversation.tool_choice == expected
    assert request.parse_tool_calls is parses_calls


def test_sampling_and_fields_codex_sends():
    request = parse(
        max_output_tokens=64,
        temperature=0.5,
        top_p=0.95,
        stream=True,
        store=False,
        parallel_tool_calls=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium", "summary": "auto"},
        text={"verbosity": "low", "format": {"type": "text"}},
        prompt_cache_key="k",
        client_metadata={"a": "b"},
        truncation="auto",
        previous_response_id=None,
        metadata={"run": "1"},
        unknown_future_field={"x": [1]},
    )
    assert request.sampling == Sampling(max_tokens=64, temperature=0.5, top_p=0.95)
    assert request.stream
    assert request.echo["metadata"] == {"run": "1"} and request.echo["parallel_tool_calls"] is False


BASE = {"model": "m", "input": "hi"}
BAD = [
    ("text", ErrorKind.INVALID_REQUEST, None),
    ({"input": "hi"}, ErrorKind.INVALID_REQUEST, "model"),
    ({"model": "m"}, ErrorKind.INVALID_REQUEST, "input"),
    ({**BASE, "input": 3}, ErrorKind.INVALID_REQUEST, "input"),
    ({**BASE, "input": []}, ErrorKind.INVALID_REQUEST, "input"),
    ({**BASE, "input": [3]}, ErrorKind.INVALID_REQUEST, "input[0]"),
    ({**BASE, "input": [{"type": "message", "content": "x"}]}, ErrorKind.INVALID_REQUEST, "input[0].role"),
    ({**BASE, "input": [{"role": "tool", "content": "x"}]}, ErrorKind.INVALID_REQUEST, "input[0].role"),
    ({**BASE, "input": [{"role": "user"}]}, ErrorKind.INVALID_REQUEST, "input[0].content"),
    (
        {**BASE, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        ErrorKind.UNSUPPORTED_CONTENT,
        "input[0].content[0].type",
    ),
    (
        {**BASE, "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_file"}]}]},
        ErrorKind.UNSUPPORTED_CONTENT,
        "input[0].content[1].type",
    ),
    (
        {**BASE, "input": [{"role": "user", "content": [{"type": "output_text", "text": "a"}]}]},
        ErrorKind.INVALID_REQUEST,
        "input[0].content[0].type",
    ),
    (
        {**BASE, "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
        ErrorKind.INVALID_REQUEST,
        "input[0].content[0].text",
    ),
    (
        {**BASE, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        ErrorKind.INVALID_REQUEST,
        "input[0].call_id",
    ),
    (
        {**BASE, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        ErrorKind.INVALID_REQUEST,
        "input[0].arguments",
    ),
    (
        {**BASE, "input": [{"type": "function_call_output", "call_id": "c"}]},
        ErrorKind.INVALID_REQUEST,
        "input[0].output",
    ),
    (
        {
            **BASE,
            "input": [
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "x"}]}
            ],
        },
        ErrorKind.UNSUPPORTED_CONTENT,
        "input[0].output[0].type",
    ),
    (
        {**BASE, "input": [{"type": "reasoning", "summary": [], "content": "x"}]},
        ErrorKind.INVALID_REQUEST,
        "input[0].content",
    ),
    ({**BASE, "input": [{"type": "item_reference", "id": "msg_1"}]}, ErrorKind.INVALID_REQUEST, "input[0].type"),
    ({**BASE, "input": [{"type": "local_shell_call"}]}, ErrorKind.INVALID_REQUEST, "input[0].type"),
    ({**BASE, "instructions": ["x"]}, ErrorKind.INVALID_REQUEST, "instructions"),
    ({**BASE, "tools": [{"type": "custom", "name": "apply_patch"}]}, ErrorKind.INVALID_REQUEST, "tools[0].type"),
    ({**BASE, "tools": [{"type": "local_shell"}]}, ErrorKind.INVALID_REQUEST, "tools[0].type"),
    ({**BASE, "tools": [{"type": "function"}]}, ErrorKind.INVALID_REQUEST, "tools[0].name"),
    (
        {**BASE, "tools": [{"type": "function", "name": "f", "strict": "no"}]},
        ErrorKind.INVALID_REQUEST,
        "tools[0].strict",
    ),
    ({**BASE, "tools": [TOOL, TOOL]}, ErrorKind.INVALID_REQUEST, "tools[1]"),
    ({**BASE, "tool_choice": "required"}, ErrorKind.INVALID_REQUEST, "tool_choice"),
    (
        {**BASE, "tools": [TOOL], "tool_choice": {"type": "function", "name": "apply"}},
        ErrorKind.INVALID_REQUEST,
        "tool_choice.name",
    ),
    (
        {**BASE, "tools": [TOOL], "tool_choice": {"type": "web_search_preview"}},
        ErrorKind.INVALID_REQUEST,
        "tool_choice.type",
    ),
    ({**BASE, "max_output_tokens": 0}, ErrorKind.INVALID_REQUEST, "max_output_tokens"),
    ({**BASE, "temperature": "hot"}, ErrorKind.INVALID_REQUEST, "temperature"),
    ({**BASE, "top_p": 2}, ErrorKind.INVALID_REQUEST, "top_p"),
    ({**BASE, "stream": 1}, ErrorKind.INVALID_REQUEST, "stream"),
    ({**BASE, "previous_response_id": "resp_1"}, ErrorKind.INVALID_REQUEST, "previous_response_id"),
    ({**BASE, "conversation": "conv_1"}, ErrorKind.INVALID_REQUEST, "conversation"),
    ({**BASE, "background": True}, ErrorKind.INVALID_REQUEST, "background"),
    (
        {**BASE, "text": {"format": {"type": "json_schema", "schema": {}}}},
        ErrorKind.INVALID_REQUEST,
        "text.format.name",
    ),
    ({**BASE, "text": {"format": {"type": "xml"}}}, ErrorKind.INVALID_REQUEST, "text.format.type"),
    ({**BASE, "include": "all"}, ErrorKind.INVALID_REQUEST, "include"),
    ({**BASE, "reasoning": "high"}, ErrorKind.INVALID_REQUEST, "reasoning"),
    ({**BASE, "metadata": {"k": 1}}, ErrorKind.INVALID_REQUEST, "metadata.k"),
]


@pytest.mark.parametrize(("body", "kind", "param"), BAD)
def test_bad_input_names_the_field(body, kind, param):
    error = rejected(body)
    assert (error.kind, error.param) == (kind, param)
    assert error.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
KEYS = [
    "type",
    "role",
    "content",
    "text",
    "call_id",
    "name",
    "arguments",
    "output",
    "summary",
    "refusal",
    "parameters",
    "format",
]
near_objects = st.recursive(
    st.sampled_from(
        [
            "message",
            "function_call",
            "function_call_output",
            "reasoning",
            "user",
            "assistant",
            "input_text",
            "output_text",
            "reasoning_text",
            "input_image",
            "function",
            "{}",
        ]
    )
    | json_values,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)
near_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m"]) | json_values, "input": st.text(max_size=3) | st.lists(near_objects, max_size=4)},
    optional={
        key: near_objects
        for key in [
            "instructions",
            "tools",
            "tool_choice",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "text",
            "metadata",
            "background",
        ]
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=json_values | near_bodies)
def test_any_json_body_is_a_request_or_a_client_error(body):
    try:
        request = DIALECT.parse_request(body, ROUTE)
    except GatewayError as error:
        assert error.kind in (ErrorKind.INVALID_REQUEST, ErrorKind.UNSUPPORTED_CONTENT)
        assert DIALECT.error_response(error)[0] == 400
    else:
        assert isinstance(request, DialectRequest)


# ---------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------

parser = HermesParser()
CALLS = (
    '<tool_call>{"name": "shell", "arguments": {"command": ["ls", "-a"]}}</tool_call>\n'
    '<tool_call>{"name": "shell", "arguments": {"command": ["pwd"]}}</tool_call>'
)


def result(text, finish=FinishKind.STOP, completion_tokens=7):
    return DialectResult(CALL, parser.parse(text, call_id=CALL.call_id), finish, Usage(30, completion_tokens))


def test_response_with_reasoning_text_and_calls_is_a_valid_response():
    request = parse(tools=[TOOL], instructions="be good", metadata={"k": "v"})
    body = DIALECT.render_response(request, result("<think>plan</think>Looking." + CALLS, FinishKind.TOOL_CALLS))
    response = Response.model_validate(body)
    assert (response.id, response.status, response.model, response.instructions) == (
        "resp_r9",
        "completed",
        "m",
        "be good",
    )
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "plan"
    assert response.output_text == "Looking."
    calls = response.output[2:]
    assert [(call.call_id, call.name, json.loads(call.arguments)) for call in calls] == [
        ("call_r9_0", "shell", {"command": ["ls", "-a"]}),
        ("call_r9_1", "shell", {"command": ["pwd"]}),
    ]
    assert len({item.id for item in response.output}) == 4
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (30, 7, 37)
    assert response.tools[0].name == "shell" and response.metadata == {"k": "v"}


def test_empty_output_is_one_empty_message():
    response = Response.model_validate(DIALECT.render_response(parse(), result("")))
    assert [(item.type, item.content[0].text) for item in response.output] == [("message", "")]


@pytest.mark.parametrize("finish", [FinishKind.LENGTH, FinishKind.CONTEXT_LENGTH])
def test_cut_output_is_incomplete(finish):
    response = Response.model_validate(DIALECT.render_response(parse(), result("half an ans", finish)))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete"


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        (ErrorKind.INVALID_REQUEST, 400, None),
        (ErrorKind.CONTEXT_LENGTH, 400, "context_length_exceeded"),
        (ErrorKind.AUTHENTICATION, 401, "invalid_api_key"),
        (ErrorKind.OVERLOADED, 503, "overloaded"),
        (ErrorKind.INTERNAL, 500, None),
    ],
)
def test_error_shape(kind, status, code):
    got_status, body = DIALECT.error_response(GatewayError(kind, "nope", param="input"))
    assert got_status == status
    assert body["error"]["code"] == code and body["error"]["message"] == "nope" and body["error"]["param"] == "input"


# ---------------------------------------------------------------------------------------------------
# Streams, read by the real SDK
# ---------------------------------------------------------------------------------------------------


def stream_bytes(request, text, finish=FinishKind.STOP, pieces=4, error=None):
    """The renderer's bytes for `text` sampled in `pieces`-character deltas through the real parser."""
    renderer = DIALECT.stream_renderer(request, CALL)
    stream = parser.stream(call_id=CALL.call_id)
    chunks = renderer.start()
    for start in range(0, len(text), pieces):
        for event in stream.feed(text[start : start + pieces]):
            chunks += renderer.events(event)
    for event in stream.finish():
        chunks += renderer.events(event)
    chunks += renderer.error(error) if error else renderer.finish(result(text, finish))
    return b"".join(chunks)


def sdk_client(payload):
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=payload)
    )
    return openai.OpenAI(
        base_url="http://gateway.test/v1", api_key="key", max_retries=0, http_client=httpx2.Client(transport=transport)
    )


def stream_events(payload, **kwargs):
    """The events as the SDK's stream helper accumulates and checks them."""
    with sdk_client(payload).responses.stream(model="m", input="q", **kwargs) as stream:
        return list(stream)


def streamed(payload, **kwargs):
    """(events, final response) of a stream that must complete."""
    with sdk_client(payload).responses.stream(model="m", input="q", **kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def check_grammar(events):
    """Sequence numbers count up from 0; every item is added, then done, with its output_index and id."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    open_item = None
    for event in events:
        if event.type == "response.output_item.added":
            assert open_item is None
            open_item = (event.output_index, event.item.id)
        elif event.type == "response.output_item.done":
            assert (event.output_index, event.item.id) == open_item
            open_item = None
        elif hasattr(event, "item_id"):
            assert (event.output_index, event.item_id) == open_item
    assert open_item is None


def test_stream_of_reasoning_text_and_tool_calls():
    text = "<think>I should list files.</think>\nListing them." + CALLS
    events, response = streamed(
        stream_bytes(parse(stream=True, tools=[TOOL]), text, FinishKind.TOOL_CALLS), tools=[TOOL]
    )
    check_grammar(events)
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.completed"
    for kind in [
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.added",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ]:
        assert kind in kinds
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "I should list files."
    assert response.output_text == "Listing them."
    assert [json.loads(item.arguments) for item in response.output[2:]] == [
        {"command": ["ls", "-a"]},
        {"command": ["pwd"]},
    ]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == "Listing them."
    assert response.usage.output_tokens == 7


def test_streamed_and_whole_responses_agree():
    text = "<think>a</think>b" + CALLS
    request = parse(stream=True, tools=[TOOL])
    _, streamed_response = streamed(stream_bytes(request, text, FinishKind.TOOL_CALLS), tools=[TOOL])
    whole = DIALECT.render_response(request, result(text, FinishKind.TOOL_CALLS))
    assert streamed_response.model_dump(exclude={"output": {"__all__": {"parsed_arguments"}}}, exclude_none=True) == (
        Response.model_validate(whole).model_dump(exclude_none=True)
    )


def test_text_after_a_tool_call_opens_a_new_message_item():
    text = 'First.<tool_call>{"name": "shell", "arguments": {}}</tool_call>Second.'
    events, response = streamed(stream_bytes(parse(stream=True, tools=[TOOL]), text, pieces=1), tools=[TOOL])
    check_grammar(events)
    assert [(item.type, getattr(item, "content", [None])[0] and item.content[0].text) for item in response.output] == [
        ("message", "First."),
        ("function_call", None),
        ("message", "Second."),
    ]
    assert [item.id for item in response.output] == ["msg_r9_0", "fc_r9_1", "msg_r9_2"]


def test_empty_stream_still_has_one_message():
    events, response = streamed(stream_bytes(parse(stream=True), ""))
    check_grammar(events)
    assert [item.type for item in response.output] == ["message"] and response.output_text == ""


def test_stream_cut_short_is_incomplete():
    events = stream_events(stream_bytes(parse(stream=True), "<think>never ends", FinishKind.LENGTH))
    check_grammar(events)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in last.response.output] == [("reasoning", "incomplete")]


def test_stream_that_fails_sends_error_then_response_failed():
    error = GatewayError(ErrorKind.INTERNAL, "engine failed")
    events = stream_events(stream_bytes(parse(stream=True), "partial answer", error=error))
    assert [event.type for event in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "engine failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_events_rendered_before_the_opening_still_follow_it():
    # The core renders the first parse events, then asks for start() and sends its events first.
    renderer = DIALECT.stream_renderer(parse(stream=True), CALL)
    first = renderer.events(parser.stream(call_id=CALL.call_id).feed("Hello")[0])
    payload = b"".join([*renderer.start(), *first, *renderer.finish(result("Hello"))])
    events, response = streamed(payload)
    check_grammar(events)
    assert response.output_text == "Hello"


# ---------------------------------------------------------------------------------------------------
# Namespace tools (Codex sends its subagent tools as one)
# ---------------------------------------------------------------------------------------------------

NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        }
    ],
}
NAMESPACED_CALL = '<tool_call>{"name": "multi_agent_v1.close_agent", "arguments": {"target": "a1"}}</tool_call>'


def test_namespace_members_reach_the_model_qualified_and_are_echoed_as_sent():
    request = parse(tools=[TOOL, NAMESPACE])
    assert request.conversation.tools == (
        ToolSpec("shell", "Run a command", TOOL["parameters"]),
        ToolSpec("multi_agent_v1.close_agent", "Close an agent.", NAMESPACE["tools"][0]["parameters"]),
    )
    assert request.echo["tools"] == [TOOL, NAMESPACE]


def test_a_namespaced_call_goes_back_with_its_namespace_and_parses_back_the_same():
    request = parse(tools=[TOOL, NAMESPACE])
    body = DIALECT.render_response(request, result(NAMESPACED_CALL, FinishKind.TOOL_CALLS))
    [item] = body["output"]
    assert (item["name"], item["namespace"], json.loads(item["arguments"])) == (
        "close_agent",
        "multi_agent_v1",
        {"target": "a1"},
    )
    echoed = DIALECT.parse_request({"model": "m", "input": [{"role": "user", "content": "go"}, item]}, ROUTE)
    assert echoed.conversation.messages[-1] == parser.parse(NAMESPACED_CALL, call_id=CALL.call_id).message()


def test_a_streamed_namespaced_call_carries_its_namespace():
    request = parse(stream=True, tools=[NAMESPACE])
    events, response = streamed(stream_bytes(request, NAMESPACED_CALL, FinishKind.TOOL_CALLS))
    check_grammar(events)
    added = next(event for event in events if event.type == "response.output_item.added")
    assert added.item.to_dict()["namespace"] == "multi_agent_v1"
    assert response.output[0].to_dict()["namespace"] == "multi_agent_v1"
    assert response.output[0].name == "close_agent"


def test_a_plain_function_name_with_a_dot_is_not_split():
    dotted = {**TOOL, "name": "fs.read"}
    body = DIALECT.render_response(
        parse(tools=[dotted]),
        result('<tool_call>{"name": "fs.read", "arguments": {}}</tool_call>', FinishKind.TOOL_CALLS),
    )
    assert body["output"][0]["name"] == "fs.read" and "namespace" not in body["output"][0]


def test_a_namespace_member_must_be_a_function():
    error = rejected(
        {"model": "m", "input": "hi", "tools": [{**NAMESPACE, "tools": [{"type": "custom", "name": "apply_patch"}]}]}
    )
    assert (error.kind, error.param) == (ErrorKind.INVALID_REQUEST, "tools[0].tools[0].type")
