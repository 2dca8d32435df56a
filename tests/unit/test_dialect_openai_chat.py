"""OpenAI Chat Completions dialect: request translation, bad inputs, responses and streams as the real
`openai` SDK reads them (its pydantic types, and its streaming client over a mock transport)."""

import json

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion

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
from gateway.dialects.openai_chat import DIALECT
from gateway.parsers import HermesParser

ROUTE = Route("/v1/chat/completions")
CALL = CallInfo(call_id="c7", created=1_700_000_000, prompt_tokens=11)
TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


def parse(**body):
    return DIALECT.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, ROUTE)


def rejected(body):
    with pytest.raises(GatewayError) as caught:
        DIALECT.parse_request(body, ROUTE)
    return caught.value


# ---------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------


def test_every_message_form_translates():
    request = DIALECT.parse_request(
        {
            "model": "qwen",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "developer", "content": [{"type": "text", "text": "use tools"}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "x",
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "think",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "read", "arguments": '{"path": "a.txt"}'},
                        },
                        {"id": "call_2", "type": "function", "function": {"name": "ls", "arguments": ""}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "A"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "B"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "done"}], "reasoning": "vllm-style"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            ],
        },
        ROUTE,
    )
    assert request.model == "qwen"
    assert not request.stream
    assert request.conversation.messages == (
        Message("system", "be brief"),
        Message("system", "use tools"),
        Message("user", "a\nb"),
        Message(
            "assistant", "", "think", (ToolCall("call_1", "read", {"path": "a.txt"}), ToolCall("call_2", "ls", {}))
        ),
        Message("tool", "A", tool_call_id="call_1", name="read"),
        Message("tool", "B", tool_call_id="call_2", name="ls"),
        Message("assistant", "done", "vllm-style"),
        Message("assistant", "no"),
    )


@pytest.mark.parametrize(
    ("choice", "expected", "parses_calls"),
    [
        (None, ToolChoice.auto(), True),
        ("auto", ToolChoice.auto(), True),
        ("none", ToolChoice.none(), False),
        ("required", ToolChoice.required(), True),
        ({"type": "function", "function": {"name": "read"}}, ToolChoice.function("read"), True),
    ],
)
def test_tools_and_tool_choice(choice, expected, parses_calls):
    request = parse(tools=[TOOL], tool_choice=choice)
    assert request.conversation.tools == (
        ToolSpec("read", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}}),
    )
    assert request.conversation.tool_choice == expected
    assert request.parse_tool_calls is parses_calls


def test_no_tools_means_no_tool_call_parsing_and_default_parameters():
    request = parse(tools=[{"type": "function", "function": {"name": "f"}}])
    assert request.conversation.tools[0].parameters == {"type": "object", "properties": {}}
    assert parse().parse_tool_calls is False


def test_sampling_fields():
    request = parse(
        max_tokens=50,
        max_completion_tokens=20,
        temperature=0.7,
        top_p=0.9,
        stop="END",
        seed=-1,
        top_k=40,
        n=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert request.sampling == Sampling(
        max_tokens=20, temperature=0.7, top_p=0.9, top_k=40, stop=("END",), seed=2**64 - 1
    )
    assert request.stream and request.echo["include_usage"]
    assert parse(max_tokens=5, stop=["a", "b"], top_k=-1).sampling == Sampling(max_tokens=5, stop=("a", "b"))


def test_fields_harnesses_send_are_accepted_and_ignored():
    request = parse(
        parallel_tool_calls=False,
        user="u",
        metadata={"k": "v"},
        store=False,
        reasoning_effort="high",
        response_format={"type": "text"},
        logprobs=False,
        frequency_penalty=0.5,
        presence_penalty=1.5,
        logit_bias={"1": 2},
        service_tier="auto",
        prompt_cache_key="p",
        some_future_field=[1, {"x": 2}],
    )
    assert request.sampling == Sampling()
    assert request.conversation.messages == (Message("user", "hi"),)


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ([1, 2], ErrorKind.INVALID_REQUEST, None),
    ({"messages": BASE["messages"]}, ErrorKind.INVALID_REQUEST, "model"),
    ({**BASE, "model": 3}, ErrorKind.INVALID_REQUEST, "model"),
    ({"model": "m"}, ErrorKind.INVALID_REQUEST, "messages"),
    ({**BASE, "messages": []}, ErrorKind.INVALID_REQUEST, "messages"),
    ({**BASE, "messages": "hi"}, ErrorKind.INVALID_REQUEST, "messages"),
    ({**BASE, "messages": ["hi"]}, ErrorKind.INVALID_REQUEST, "messages[0]"),
    ({**BASE, "messages": [{"content": "x"}]}, ErrorKind.INVALID_REQUEST, "messages[0].role"),
    ({**BASE, "messages": [{"role": "function", "content": "x"}]}, ErrorKind.INVALID_REQUEST, "messages[0].role"),
    ({**BASE, "messages": [{"role": "user"}]}, ErrorKind.INVALID_REQUEST, "messages[0].content"),
    ({**BASE, "messages": [{"role": "user", "content": 5}]}, ErrorKind.INVALID_REQUEST, "messages[0].content"),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        ErrorKind.UNSUPPORTED_CONTENT,
        "messages[0].content[0].type",
    ),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "text"}, {"type": "input_audio"}]}]},
        ErrorKind.INVALID_REQUEST,
        "messages[0].content[0].text",
    ),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
        ErrorKind.UNSUPPORTED_CONTENT,
        "messages[0].content[1].type",
    ),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
        ErrorKind.UNSUPPORTED_CONTENT,
        "messages[0].content[0].type",
    ),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
        ErrorKind.INVALID_REQUEST,
        "messages[0].content[0].type",
    ),
    ({**BASE, "messages": [{"role": "tool", "content": "x"}]}, ErrorKind.INVALID_REQUEST, "messages[0].tool_call_id"),
    (
        {**BASE, "messages": [{"role": "assistant", "tool_calls": {}}]},
        ErrorKind.INVALID_REQUEST,
        "messages[0].tool_calls",
    ),
    (
        {
            **BASE,
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{"}}]}
            ],
        },
        ErrorKind.INVALID_REQUEST,
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        {
            **BASE,
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}
            ],
        },
        ErrorKind.INVALID_REQUEST,
        "messages[0].tool_calls[0].function.arguments",
    ),
    # Nested past the parser's limit (a RecursionError inside json) and past MAX_JSON_DEPTH: a 400 either way.
    *[
        (
            {
                **BASE,
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "a",
                                "function": {"name": "f", "arguments": '{"a":' + "[" * depth + "]" * depth + "}"},
                            }
                        ],
                    }
                ],
            },
            ErrorKind.INVALID_REQUEST,
            "messages[0].tool_calls[0].function.arguments",
        )
        for depth in (200, 100_000)
    ],
    (
        {**BASE, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        ErrorKind.INVALID_REQUEST,
        "messages[0].tool_calls[0].id",
    ),
    (
        {**BASE, "messages": [{"role": "assistant", "reasoning_content": 1}]},
        ErrorKind.INVALID_REQUEST,
        "messages[0].reasoning_content",
    ),
    ({**BASE, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, ErrorKind.INVALID_REQUEST, "tools[0].type"),
    ({**BASE, "tools": [{"type": "function"}]}, ErrorKind.INVALID_REQUEST, "tools[0].function"),
    (
        {**BASE, "tools": [{"type": "function", "function": {"name": ""}}]},
        ErrorKind.INVALID_REQUEST,
        "tools[0].function.name",
    ),
    (
        {**BASE, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        ErrorKind.INVALID_REQUEST,
        "tools[0].function.parameters",
    ),
    ({**BASE, "tools": [TOOL, TOOL]}, ErrorKind.INVALID_REQUEST, "tools[1]"),
    ({**BASE, "tool_choice": "required"}, ErrorKind.INVALID_REQUEST, "tool_choice"),
    ({**BASE, "tool_choice": "always"}, ErrorKind.INVALID_REQUEST, "tool_choice"),
    (
        {**BASE, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "write"}}},
        ErrorKind.INVALID_REQUEST,
        "tool_choice.function.name",
    ),
    ({**BASE, "max_tokens": 0}, ErrorKind.INVALID_REQUEST, "max_tokens"),
    ({**BASE, "max_completion_tokens": "10"}, ErrorKind.INVALID_REQUEST, "max_completion_tokens"),
    ({**BASE, "max_tokens": 1.5}, ErrorKind.INVALID_REQUEST, "max_tokens"),
    ({**BASE, "temperature": 3}, ErrorKind.INVALID_REQUEST, "temperature"),
    ({**BASE, "temperature": True}, ErrorKind.INVALID_REQUEST, "temperature"),
    ({**BASE, "temperature": float("nan")}, ErrorKind.INVALID_REQUEST, "temperature"),
    ({**BASE, "top_p": -0.1}, ErrorKind.INVALID_REQUEST, "top_p"),
    ({**BASE, "top_k": -2}, ErrorKind.INVALID_REQUEST, "top_k"),
    ({**BASE, "stop": ["a", 1]}, ErrorKind.INVALID_REQUEST, "stop"),
    ({**BASE, "stop": ""}, ErrorKind.INVALID_REQUEST, "stop"),
    ({**BASE, "seed": 2**63}, ErrorKind.INVALID_REQUEST, "seed"),
    ({**BASE, "stream": "yes"}, ErrorKind.INVALID_REQUEST, "stream"),
    ({**BASE, "stream_options": {"include_usage": 1}}, ErrorKind.INVALID_REQUEST, "stream_options.include_usage"),
    ({**BASE, "n": 2}, ErrorKind.INVALID_REQUEST, "n"),
    ({**BASE, "logprobs": True}, ErrorKind.INVALID_REQUEST, "logprobs"),
    (
        {**BASE, "response_format": {"type": "json_schema", "json_schema": {}}},
        ErrorKind.INVALID_REQUEST,
        "response_format.json_schema.name",
    ),
    ({**BASE, "response_format": {"type": "xml"}}, ErrorKind.INVALID_REQUEST, "response_format.type"),
    ({**BASE, "functions": [{"name": "f"}]}, ErrorKind.INVALID_REQUEST, "functions"),
    ({**BASE, "parallel_tool_calls": "yes"}, ErrorKind.INVALID_REQUEST, "parallel_tool_calls"),
    ({**BASE, "metadata": []}, ErrorKind.INVALID_REQUEST, "metadata"),
]


@pytest.mark.parametrize(("body", "kind", "param"), BAD)
def test_bad_input_names_the_field(body, kind, param):
    error = rejected(body)
    assert (error.kind, error.param) == (kind, param)
    assert error.message


# Random JSON, and near-valid bodies with random values in the places a body has, reach every check.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
KEYS = [
    "role",
    "content",
    "type",
    "text",
    "tool_calls",
    "tool_call_id",
    "function",
    "name",
    "arguments",
    "id",
    "reasoning_content",
    "refusal",
    "parameters",
]
near_objects = st.recursive(
    st.sampled_from(["user", "assistant", "tool", "system", "text", "function", "image_url", "{}", "[1]"])
    | json_values,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)
near_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m"]) | json_values, "messages": st.lists(near_objects, max_size=4)},
    optional={
        key: near_objects
        for key in [
            "tools",
            "tool_choice",
            "stop",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "seed",
            "stream",
            "stream_options",
            "response_format",
            "logprobs",
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


def result(text, finish=FinishKind.STOP, completion_tokens=5):
    return DialectResult(CALL, parser.parse(text, call_id=CALL.call_id), finish, Usage(11, completion_tokens))


def test_response_with_text_and_reasoning_is_a_valid_chat_completion():
    body = DIALECT.render_response(parse(), result("<think>hmm</think>Hello!"))
    completion = ChatCompletion.model_validate(body)
    assert completion.id == "chatcmpl-c7" and completion.model == "m" and completion.created == CALL.created
    choice = completion.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Hello!", "stop")
    assert body["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert completion.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": 11,
        "completion_tokens": 5,
        "total_tokens": 16,
    }


def test_response_with_tool_calls():
    text = (
        '<tool_call>{"name": "read", "arguments": {"path": "a"}}</tool_call>'
        '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    )
    completion = ChatCompletion.model_validate(
        DIALECT.render_response(parse(tools=[TOOL]), result(text, FinishKind.TOOL_CALLS))
    )
    message = completion.choices[0].message
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    assert [(call.id, call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("call_c7_0", "read", {"path": "a"}),
        ("call_c7_1", "ls", {}),
    ]
    assert "reasoning_content" not in DIALECT.render_response(parse(), result("x"))["choices"][0]["message"]


@pytest.mark.parametrize(
    ("finish", "reason"),
    [(FinishKind.STOP_SEQUENCE, "stop"), (FinishKind.LENGTH, "length"), (FinishKind.CONTEXT_LENGTH, "length")],
)
def test_finish_reasons(finish, reason):
    body = DIALECT.render_response(parse(), result("cut", finish))
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == reason


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        (ErrorKind.INVALID_REQUEST, 400, None),
        (ErrorKind.UNSUPPORTED_CONTENT, 400, "unsupported_content"),
        (ErrorKind.CONTEXT_LENGTH, 400, "context_length_exceeded"),
        (ErrorKind.AUTHENTICATION, 401, "invalid_api_key"),
        (ErrorKind.NOT_FOUND, 404, "not_found"),
        (ErrorKind.OVERLOADED, 503, "overloaded"),
        (ErrorKind.INTERNAL, 500, None),
    ],
)
def test_error_shape(kind, status, code):
    got_status, body = DIALECT.error_response(GatewayError(kind, "it broke", param="messages"))
    assert got_status == status
    assert body == {
        "error": {
            "message": "it broke",
            "type": "server_error" if status >= 500 else "invalid_request_error",
            "param": "messages",
            "code": code,
        }
    }


def test_unknown_model_code():
    _, body = DIALECT.error_response(GatewayError(ErrorKind.NOT_FOUND, "no such model", param="model"))
    assert body["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------------------------------------
# Streams, read by the real SDK
# ---------------------------------------------------------------------------------------------------


def stream_bytes(request, text, finish=FinishKind.STOP, pieces=3, error=None):
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


def test_stream_of_text_and_reasoning():
    payload = stream_bytes(parse(stream=True), "<think>Let me see.</think>\nThe answer is 42.")
    assert payload.endswith(b"data: [DONE]\n\n")
    client = sdk_client(payload)
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "q"}]) as stream:
        completion = stream.get_final_completion()
    assert completion.choices[0].message.content == "The answer is 42."
    assert completion.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="m", messages=[], stream=True))
    assert {chunk.id for chunk in chunks} == {"chatcmpl-c7"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(getattr(chunk.choices[0].delta, "reasoning_content", None) or "" for chunk in chunks) == (
        "Let me see."
    )
    assert chunks[-1].usage is None


def test_stream_of_tool_calls_with_usage():
    text = (
        'Reading.<tool_call>\n{"name": "read", "arguments": {"path": "a b"}}\n</tool_call>\n'
        '<tool_call>{"name": "read", "arguments": {"path": "ü"}}</tool_call>'
    )
    client = sdk_client(
        stream_bytes(
            parse(stream=True, tools=[TOOL], stream_options={"include_usage": True}), text, FinishKind.TOOL_CALLS
        )
    )
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "q"}]) as stream:
        completion = stream.get_final_completion()
    message = completion.choices[0].message
    assert message.content == "Reading."
    assert [(call.id, call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("call_c7_0", "read", {"path": "a b"}),
        ("call_c7_1", "read", {"path": "ü"}),
    ]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 5)


def test_stream_cut_by_the_context_ends_with_length():
    client = sdk_client(stream_bytes(parse(stream=True), "a long answer that", FinishKind.CONTEXT_LENGTH))
    chunks = list(client.chat.completions.create(model="m", messages=[], stream=True))
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"


def test_stream_that_fails_ends_with_an_error_and_done():
    error = GatewayError(ErrorKind.OVERLOADED, "inference server unavailable")
    payload = stream_bytes(parse(stream=True), "partial", error=error)
    assert payload.endswith(b"data: [DONE]\n\n")
    client = sdk_client(payload)
    received = []
    with pytest.raises(openai.APIError, match="inference server unavailable") as caught:
        for chunk in client.chat.completions.create(model="m", messages=[], stream=True):
            received.append(chunk.choices[0].delta.content)
    assert "".join(filter(None, received)) == "partial"
    assert caught.value.body["code"] == "overloaded"
