"""The Gemini generateContent dialect: pure translation, checked against the real `google-genai` SDK.

Responses are validated by the SDK's own pydantic types (which forbid unknown fields); streams are read
by the SDK's real streaming client (`generate_content_stream`, chats) over an in-memory httpx2
transport that serves the renderer's bytes, and the SDK's own request bodies are parsed back.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from google import genai
from google.genai import errors, types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.conversation import Message, ToolCall, ToolChoice, ToolSpec, turns_match
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
from gateway.dialects.gemini import DIALECT
from gateway.parsers import HermesParser, ParsedOutput, collect

ROUTE = Route("/v1beta/models/tiny:generateContent", model="tiny", stream=False)
SSE_ROUTE = Route("/v1beta/models/tiny:streamGenerateContent", model="tiny", stream=True, query={"alt": "sse"})
ARRAY_ROUTE = Route("/v1beta/models/tiny:streamGenerateContent", model="tiny", stream=True)
CALL = CallInfo(call_id="c0ffee", created=1_700_000_000, prompt_tokens=42)
HI = [{"role": "user", "parts": [{"text": "hi"}]}]
READ_FILE = {"name": "read_file", "description": "Read a file", "parametersJsonSchema": {"type": "object"}}
TOOLS = [{"functionDeclarations": [READ_FILE, {"name": "ls"}]}]


def body(**fields: Any) -> dict[str, Any]:
    return {"contents": HI} | fields


def parse(route: Route = ROUTE, **fields: Any) -> DialectRequest:
    return DIALECT.parse_request(body(**fields), route)


def bad(fields: dict[str, Any], kind: ErrorKind = ErrorKind.INVALID_REQUEST) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        DIALECT.parse_request(fields, ROUTE)
    assert caught.value.kind is kind
    return caught.value


def model(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "model", "parts": list(parts)}


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "parts": list(parts)}


def call(name: str, args: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"functionCall": {"name": name, "args": args or {}} | extra}


def answer(name: str, response: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"functionResponse": {"name": name, "response": response} | extra}


# --- request: system instruction and contents ---------------------------------------------------------


@pytest.mark.parametrize(
    "system",
    [
        "You are Gemini CLI.",
        {"parts": [{"text": "You are Gemini CLI."}]},
        {"role": "user", "parts": [{"text": "You are "}, {"text": "Gemini CLI."}]},
    ],
)
def test_system_instruction_forms(system):
    request = parse(systemInstruction=system)
    assert request.conversation.messages == (Message("system", "You are Gemini CLI."), Message("user", "hi"))


@pytest.mark.parametrize("system", ["", {"parts": []}, {}])
def test_an_empty_system_instruction_adds_no_turn(system):
    assert parse(systemInstruction=system).conversation.messages == (Message("user", "hi"),)


def test_turns_parts_and_roles():
    contents = [
        user({"text": "Context: linux\n"}, {"text": "List the files."}),
        model({"text": "I should list.", "thought": True}, {"text": "Listing"}, {"text": " now."}, call("ls")),
        {"role": "function", "parts": [answer("ls", {"output": "a.py"}), {"text": "Also: be brief."}]},
        model({"text": "One file.", "thoughtSignature": "c2ln"}),
        {"parts": [{"text": "thanks"}]},
    ]
    messages = parse(contents=contents).conversation.messages
    assert messages == (
        Message("user", "Context: linux\nList the files."),
        Message("assistant", "Listing now.", "I should list.", (ToolCall("call_contents1_0", "ls", {}),)),
        Message("tool", '{"output": "a.py"}', tool_call_id="call_contents1_0", name="ls"),
        Message("user", "Also: be brief."),
        Message("assistant", "One file."),
        Message("user", "thanks"),
    )


def test_consecutive_model_contents_are_one_turn():
    contents = [
        *HI,
        model({"text": "Th", "thought": True}),
        model({"text": "ink.", "thought": True}, {"text": "Li"}),
        model({"text": "st."}, call("ls")),
        model(call("read_file", {"path": "a"}), {"text": ""}),
        user(answer("read_file", {"output": "A"}), answer("ls", {"output": "a"})),
    ]
    messages = parse(contents=contents).conversation.messages
    calls = (ToolCall("call_contents3_0", "ls", {}), ToolCall("call_contents4_0", "read_file", {"path": "a"}))
    assert messages[1] == Message("assistant", "List.", "Think.", calls)
    assert [turn.tool_call_id for turn in messages[2:]] == ["call_contents4_0", "call_contents3_0"]


def test_function_responses_answer_calls_by_id_then_by_name():
    contents = [
        *HI,
        model(
            call("read_file", {"path": "a"}, id="call_c1_0"),
            call("read_file", {"path": "b"}),
            call("ls"),
            call("read_file", {"path": "c"}, id="mine"),
        ),
        user(
            answer("ls", {"output": "x"}),
            answer("read_file", {"output": "C"}, id="mine"),
            answer("read_file", {"output": "A"}),
            answer("read_file", {"error": "B missing"}, id="unknown-id"),
            answer("grep", {"output": "nothing called it"}),
        ),
    ]
    tool_turns = parse(contents=contents).conversation.messages[2:]
    assert [(turn.name, turn.tool_call_id) for turn in tool_turns] == [
        ("ls", "call_contents1_2"),
        ("read_file", "mine"),
        ("read_file", "call_c1_0"),
        ("read_file", "call_contents1_1"),
        ("grep", ""),
    ]
    assert tool_turns[3].content == '{"error": "B missing"}'


def test_a_new_model_turn_drops_unanswered_calls():
    contents = [*HI, model(call("ls")), user({"text": "never mind"}), model(call("ls")), user(answer("ls", {}))]
    assert parse(contents=contents).conversation.messages[-1].tool_call_id == "call_contents3_0"


def test_snake_case_fields_are_accepted():
    request = parse(
        contents=[
            *HI,
            model({"function_call": {"name": "read_file", "args": {"path": "a"}}}),
            user({"function_response": {"name": "read_file", "response": {"output": "A"}}}),
        ],
        system_instruction={"parts": [{"text": "sys"}]},
        tools=[{"function_declarations": [{"name": "read_file", "parameters_json_schema": {"type": "object"}}]}],
        tool_config={"function_calling_config": {"mode": "ANY", "allowed_function_names": ["read_file"]}},
        generation_config={"max_output_tokens": 7, "top_p": 0.5, "stop_sequences": ["END"]},
    )
    assert request.conversation.messages[0] == Message("system", "sys")
    assert request.conversation.messages[2].tool_calls == (ToolCall("call_contents1_0", "read_file", {"path": "a"}),)
    assert request.conversation.messages[3].tool_call_id == "call_contents1_0"
    assert request.conversation.tools == (ToolSpec("read_file", "", {"type": "object"}),)
    assert request.conversation.tool_choice == ToolChoice.function("read_file")
    assert request.sampling == Sampling(max_tokens=7, top_p=0.5, stop=("END",))


# --- request: tools, tool choice, sampling ------------------------------------------------------------


def test_openapi_schemas_become_json_schema_and_json_schemas_pass_through():
    schema = {
        "type": "OBJECT",
        "properties": {
            "type": {"type": "STRING", "enum": ["a", "b"]},
            "max_items": {"type": "ARRAY", "items": {"type": "INTEGER"}, "max_items": 3},
            "either": {"anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN", "nullable": True}]},
        },
        "required": ["type"],
    }
    json_schema = {"type": ["string", "null"], "$defs": {"X": {"type": "OBJECT"}}}
    tools = parse(
        tools=[
            {"functionDeclarations": [{"name": "a", "parameters": schema}]},
            {"functionDeclarations": [{"name": "b", "parametersJsonSchema": json_schema}, {"name": "c"}]},
        ]
    ).conversation.tools
    assert tools[0].parameters == {
        "type": "object",
        "properties": {
            "type": {"type": "string", "enum": ["a", "b"]},
            "max_items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "either": {"anyOf": [{"type": "number"}, {"type": "boolean", "nullable": True}]},
        },
        "required": ["type"],
    }
    assert tools[1].parameters == json_schema
    assert tools[2].parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("config", "choice", "parses_calls"),
    [
        (None, ToolChoice.auto(), True),
        ({"functionCallingConfig": {}}, ToolChoice.auto(), True),
        ({"functionCallingConfig": {"mode": "AUTO"}}, ToolChoice.auto(), True),
        ({"functionCallingConfig": {"mode": "VALIDATED"}}, ToolChoice.auto(), True),
        ({"functionCallingConfig": {"mode": "NONE"}}, ToolChoice.none(), False),
        ({"functionCallingConfig": {"mode": "ANY"}}, ToolChoice.required(), True),
        ({"functionCallingConfig": {"mode": "any", "allowedFunctionNames": ["ls"]}}, ToolChoice.function("ls"), True),
        (
            {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["ls", "read_file"]}},
            ToolChoice.required(("ls", "read_file")),
            True,
        ),
        ({"retrievalConfig": {"languageCode": "en"}}, ToolChoice.auto(), True),
    ],
)
def test_function_calling_modes(config, choice, parses_calls):
    request = parse(tools=TOOLS, toolConfig=config)
    assert request.conversation.tool_choice == choice
    assert request.parse_tool_calls is parses_calls


def test_sampling_and_fields_that_change_nothing():
    request = parse(
        generationConfig={
            "maxOutputTokens": 32000,
            "temperature": 0,
            "topP": 1,
            "topK": 40.0,
            "stopSequences": ["END", "\n\n"],
            "seed": -5,
            "candidateCount": 1,
            "responseMimeType": "application/json",
            "responseJsonSchema": {"type": "object"},
            "responseModalities": ["TEXT"],
            "thinkingConfig": {"thinkingBudget": -1},
            "presencePenalty": 0.5,
        },
        safetySettings=[{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        labels={"team": "rl"},
    )
    assert request.sampling == Sampling(32000, 0.0, 1.0, 40, ("END", "\n\n"), -5)
    assert request.sampling.top_k.__class__ is int
    assert request.echo["include_thoughts"] is False
    assert parse(generationConfig={"thinkingConfig": {"includeThoughts": True}}).echo["include_thoughts"] is True


def test_model_and_streaming_come_from_the_url():
    assert (parse().model, parse().stream) == ("tiny", False)
    streamed = parse(SSE_ROUTE)
    assert streamed.stream and streamed.echo["sse"]
    assert not parse(ARRAY_ROUTE).echo["sse"]
    assert DIALECT.stream_renderer(parse(ARRAY_ROUTE), CALL).media_type == "application/json"
    assert DIALECT.stream_renderer(streamed, CALL).media_type == "text/event-stream"


# --- request: bad input names its field ---------------------------------------------------------------


def turns(*contents: dict[str, Any]) -> dict[str, Any]:
    return {"contents": list(contents)}


def generation(**config: Any) -> dict[str, Any]:
    return {"generationConfig": config}


def calling(mode: str, *allowed: str) -> dict[str, Any]:
    config = {"mode": mode} | ({"allowedFunctionNames": list(allowed)} if allowed else {})
    return {"tools": TOOLS, "toolConfig": {"functionCallingConfig": config}}


ANSWERED = (*HI, model(call("ls")))
UNSUPPORTED_CASES = {  # param → fields
    "contents[0].parts[0].inlineData": turns(user({"inlineData": {"mimeType": "image/png", "data": "AA=="}})),
    "contents[0].parts[1].fileData": turns(user({"text": "see"}, {"file_data": {"fileUri": "gs://x"}})),
    "contents[1].parts[0].executableCode": turns(*HI, model({"executableCode": {"code": "1"}})),
    "contents[2].parts[0].functionResponse.parts": turns(*ANSWERED, user(answer("ls", {}, parts=[{"fileData": {}}]))),
    "systemInstruction.parts[0].inlineData": {"systemInstruction": {"parts": [{"inlineData": {}}]}},
    "tools[0].googleSearch": {"tools": [{"googleSearch": {}}]},
    "tools[0].code_execution": {"tools": [{"functionDeclarations": [READ_FILE], "code_execution": {}}]},
    "generationConfig.responseModalities[1]": generation(responseModalities=["TEXT", "IMAGE"]),
}
INVALID_CASES = [  # (param, fields)
    ("contents", {"contents": []}),
    ("contents", {"contents": None}),
    ("contents", {"contents": {"parts": [{"text": "hi"}]}}),
    ("contents[0]", {"contents": ["hi"]}),
    ("contents[0].parts", turns({"role": "user", "parts": []})),
    ("contents[0].role", turns({"role": "system", "parts": [{"text": "x"}]})),
    ("contents[0].parts[0]", turns(user({}))),
    ("contents[0].parts[0]", turns(user({"text": "a", "functionCall": {"name": "ls"}}))),
    ("contents[0].parts[0].text", turns(user({"text": 5}))),
    ("contents[0].parts[0].thought", turns(user({"text": "a", "thought": "yes"}))),
    ("contents[0].parts[0]", turns(user(call("ls")))),
    ("contents[1].parts[0]", turns(*HI, model(answer("ls", {})))),
    ("contents[1].parts[0].functionCall.name", turns(*HI, model({"functionCall": {"args": {}}}))),
    ("contents[1].parts[0].functionCall.args", turns(*HI, model({"functionCall": {"name": "ls", "args": [1]}}))),
    ("contents[2].parts[0].functionResponse.response", turns(*ANSWERED, user(answer("ls", "ok")))),
    ("systemInstruction.parts[0]", {"systemInstruction": {"parts": [call("ls")]}}),
    ("systemInstruction", {"systemInstruction": 7}),
    ("tools", {"tools": {"functionDeclarations": []}}),
    ("tools[0].functionDeclarations[0].name", {"tools": [{"functionDeclarations": [{"description": "no name"}]}]}),
    ("tools", {"tools": [{"functionDeclarations": [READ_FILE, READ_FILE]}]}),
    (
        "tools[0].functionDeclarations[0].parametersJsonSchema",
        {"tools": [{"functionDeclarations": [READ_FILE | {"parameters": {"type": "OBJECT"}}]}]},
    ),
    ("toolConfig.functionCallingConfig.mode", {"toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}),
    ("toolConfig.functionCallingConfig.mode", calling("SOMETIMES")),
    ("toolConfig.functionCallingConfig.allowedFunctionNames[1]", calling("ANY", "ls", "rm")),
    ("generationConfig.temperature", generation(temperature=2.5)),
    ("generationConfig.temperature", generation(temperature="hot")),
    ("generationConfig.topP", generation(topP=-0.1)),
    ("generationConfig.topK", generation(topK=0.5)),
    ("generationConfig.maxOutputTokens", generation(maxOutputTokens=0)),
    ("generationConfig.maxOutputTokens", generation(maxOutputTokens=True)),
    ("generationConfig.seed", generation(seed=2**40)),
    ("generationConfig.candidateCount", generation(candidateCount=2)),
    ("generationConfig.stopSequences[0]", generation(stopSequences=[""])),
    ("generationConfig.stopSequences", generation(stopSequences="END")),
    ("generationConfig.thinkingConfig.includeThoughts", generation(thinkingConfig={"includeThoughts": 1})),
    ("generationConfig", {"generationConfig": []}),
    ("cachedContent", {"cachedContent": "cachedContents/abc"}),
]


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [(fields, ErrorKind.UNSUPPORTED_CONTENT, param) for param, fields in UNSUPPORTED_CASES.items()]
    + [(fields, ErrorKind.INVALID_REQUEST, param) for param, fields in INVALID_CASES],
)
def test_bad_input_names_its_field(fields, kind, param):
    error = bad(body(**fields), kind)
    assert error.param == param
    status, error_body = DIALECT.error_response(error)
    assert status == 400 and error_body["error"]["status"] == "INVALID_ARGUMENT"
    assert error_body["error"]["details"][0]["fieldViolations"][0]["field"] == param


@pytest.mark.parametrize("raw", [None, [], "hi", 3])
def test_the_body_must_be_an_object(raw):
    assert bad(raw).param is None


def test_the_url_must_name_a_model():
    with pytest.raises(GatewayError) as caught:
        DIALECT.parse_request(body(), Route("/v1beta/models/:generateContent"))
    assert caught.value.kind is ErrorKind.INVALID_REQUEST


# --- responses, validated by the SDK's types ----------------------------------------------------------

OUTPUTS = {
    "text": ("Hello there.", FinishKind.STOP),
    "reasoning": ("<think>Greet them.</think>Hello.", FinishKind.STOP),
    "tool calls": (
        '<think>Read both.</think>Reading.<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'
        '<tool_call>{"name": "ls", "arguments": {}}</tool_call>',
        FinishKind.TOOL_CALLS,
    ),
    "malformed call": ('<tool_call>{"name": "ls", "arguments": </tool_call>', FinishKind.STOP),
    "empty": ("", FinishKind.STOP),
    "length": ("Once upon a", FinishKind.LENGTH),
    "context": ('partial <tool_call>{"name"', FinishKind.CONTEXT_LENGTH),
    "stop sequence": ("Done", FinishKind.STOP_SEQUENCE),
}
THOUGHTS = {"thinkingConfig": {"includeThoughts": True}}
# Gemini ends tool-call turns and stop-sequence cuts with STOP too.
FINISH_REASONS = {
    FinishKind.STOP: "STOP",
    FinishKind.TOOL_CALLS: "STOP",
    FinishKind.STOP_SEQUENCE: "STOP",
    FinishKind.LENGTH: "MAX_TOKENS",
    FinishKind.CONTEXT_LENGTH: "MAX_TOKENS",
}


def result_for(text: str, finish: FinishKind) -> DialectResult:
    output = HermesParser().parse(text, call_id=CALL.call_id)
    stop_sequence = "END" if finish is FinishKind.STOP_SEQUENCE else None
    return DialectResult(CALL, output, finish, Usage(CALL.prompt_tokens, 9), stop_sequence)


def read_parts(parts: list[types.Part]) -> ParsedOutput:
    """SDK parts back into an output: thoughts are reasoning, text is content, function calls are calls."""
    calls = [part.function_call for part in parts if part.function_call]
    return ParsedOutput(
        "".join(part.text for part in parts if part.text and not part.thought),
        "".join(part.text for part in parts if part.text and part.thought),
        tuple(ToolCall(call.id, call.name, call.args) for call in calls),
    )


@pytest.mark.parametrize("name", OUTPUTS)
def test_responses_validate_as_sdk_responses(name):
    text, finish = OUTPUTS[name]
    result = result_for(text, finish)
    response = types.GenerateContentResponse.model_validate(
        DIALECT.render_response(parse(generationConfig=THOUGHTS), result)
    )
    assert (response.model_version, response.response_id) == ("tiny", "c0ffee")
    usage = response.usage_metadata
    assert (usage.prompt_token_count, usage.candidates_token_count, usage.total_token_count) == (42, 9, 51)
    candidate = response.candidates[0]
    assert candidate.content.role == "model" and candidate.index == 0
    assert read_parts(candidate.content.parts) == result.output
    assert candidate.finish_reason == types.FinishReason(FINISH_REASONS[finish])


def test_response_part_shapes_and_hidden_thoughts():
    result = result_for(*OUTPUTS["tool calls"])
    shown = DIALECT.render_response(parse(generationConfig=THOUGHTS), result)["candidates"][0]["content"]["parts"]
    assert shown == [
        {"text": "Read both.", "thought": True},
        {"text": "Reading."},
        {"functionCall": {"id": "call_c0ffee_0", "name": "read_file", "args": {"path": "a.py"}}},
        {"functionCall": {"id": "call_c0ffee_1", "name": "ls", "args": {}}},
    ]
    hidden = DIALECT.render_response(parse(), result)["candidates"][0]["content"]["parts"]
    assert hidden == shown[1:]
    empty = DIALECT.render_response(parse(), result_for("", FinishKind.STOP))
    assert empty["candidates"][0]["content"]["parts"] == [{"text": ""}]


# --- streams, read by the real SDK --------------------------------------------------------------------


def stream_bytes(route: Route, text: str, finish: FinishKind, chunk: int, **fields: Any) -> list[bytes]:
    renderer = DIALECT.stream_renderer(parse(route, **fields), CALL)
    parser = HermesParser().stream(call_id=CALL.call_id)
    out = renderer.start()
    events = []
    for start in range(0, len(text), chunk):
        events += parser.feed(text[start : start + chunk])
    events += parser.finish()
    for event in events:
        out += renderer.events(event)
    return out + renderer.finish(DialectResult(CALL, collect(events), finish, Usage(CALL.prompt_tokens, 9)))


def sdk_client(chunks: list[bytes], seen: list[httpx2.Request], status: int = 200, **options: Any) -> genai.Client:
    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(status, headers={"content-type": "text/event-stream"}, content=b"".join(chunks))

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    return genai.Client(
        api_key="session-key", http_options=types.HttpOptions(base_url="http://gateway", httpx_client=http, **options)
    )


def sdk_stream(chunks: list[bytes], **config: Any) -> tuple[list[types.GenerateContentResponse], httpx2.Request]:
    seen: list[httpx2.Request] = []
    client = sdk_client(chunks, seen, api_version="v1beta")
    responses = list(
        client.models.generate_content_stream(
            model="tiny", contents="hi", config=types.GenerateContentConfig(**config) if config else None
        )
    )
    return responses, seen[0]


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("name", OUTPUTS)
def test_sse_streams_reassemble_in_the_sdk(name, chunk):
    text, finish = OUTPUTS[name]
    chunks = stream_bytes(SSE_ROUTE, text, finish, chunk, generationConfig=THOUGHTS)
    responses, request = sdk_stream(chunks)
    assert request.url.path == "/v1beta/models/tiny:streamGenerateContent" and request.url.params["alt"] == "sse"
    parts = [part for response in responses for part in response.candidates[0].content.parts]
    assert read_parts(parts) == HermesParser().parse(text, call_id=CALL.call_id)
    *middle, last = responses
    assert all(chunk.candidates[0].finish_reason is None and chunk.usage_metadata is None for chunk in middle)
    assert last.candidates[0].finish_reason == types.FinishReason(FINISH_REASONS[finish])
    assert last.usage_metadata.prompt_token_count == 42 and last.usage_metadata.candidates_token_count == 9
    assert all(response.response_id == "c0ffee" and response.model_version == "tiny" for response in responses)


def test_each_event_leaves_as_its_own_chunk():
    text = "<think>Plan.</think>Hi " + '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    chunks = stream_bytes(SSE_ROUTE, text, FinishKind.TOOL_CALLS, 3, generationConfig=THOUGHTS)
    bodies = [json.loads(chunk.decode().removeprefix("data: ")) for chunk in chunks]
    assert all(chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") for chunk in chunks)
    parts = [b["candidates"][0]["content"]["parts"] for b in bodies]
    assert all(len(p) == 1 for p in parts) and parts[0][0]["thought"] is True
    assert "".join(p[0]["text"] for p in parts if p[0].get("thought")) == "Plan."
    assert {"functionCall": {"id": "call_c0ffee_0", "name": "ls", "args": {}}} in [p[0] for p in parts]
    assert parts[-1] == [{"text": ""}] and bodies[-1]["candidates"][0]["finishReason"] == "STOP"
    hidden = stream_bytes(SSE_ROUTE, text, FinishKind.TOOL_CALLS, 3)
    assert b'"thought"' not in b"".join(hidden) and len(hidden) < len(chunks)


@pytest.mark.parametrize("name", ["tool calls", "empty", "text"])
def test_json_array_streams_are_one_array_of_responses(name):
    text, finish = OUTPUTS[name]
    chunks = stream_bytes(ARRAY_ROUTE, text, finish, 2, generationConfig=THOUGHTS)
    assert chunks[0] == b"[" and chunks[-1] == b"]"
    responses = [types.GenerateContentResponse.model_validate(item) for item in json.loads(b"".join(chunks))]
    parts = [part for response in responses for part in response.candidates[0].content.parts]
    assert read_parts(parts) == HermesParser().parse(text, call_id=CALL.call_id)
    assert responses[-1].usage_metadata.total_token_count == 51


def test_an_error_after_the_start_reaches_the_sdk_as_its_error():
    renderer = DIALECT.stream_renderer(parse(SSE_ROUTE), CALL)
    parser = HermesParser().stream(call_id=CALL.call_id)
    chunks = renderer.start()
    for event in parser.feed("Partial answer") + parser.finish():
        chunks += renderer.events(event)
    chunks += renderer.error(GatewayError(ErrorKind.OVERLOADED, "the inference server is unavailable"))
    seen: list[httpx2.Request] = []
    received = []
    with pytest.raises(errors.ServerError) as caught:
        for response in sdk_client(chunks, seen).models.generate_content_stream(model="tiny", contents="hi"):
            received.append(response.text)
    assert "".join(received) == "Partial answer"
    assert (caught.value.code, caught.value.status) == (503, "UNAVAILABLE")


def test_an_error_in_a_json_array_stream_is_its_last_element():
    renderer = DIALECT.stream_renderer(parse(ARRAY_ROUTE), CALL)
    parser = HermesParser().stream(call_id=CALL.call_id)
    chunks = renderer.start()
    for event in parser.feed("Partial") + parser.finish():
        chunks += renderer.events(event)
    chunks += renderer.error(GatewayError(ErrorKind.INTERNAL, "engine failed"))
    *answers, failure = json.loads(b"".join(chunks))
    assert answers[0]["candidates"][0]["content"]["parts"] == [{"text": "Partial"}]
    assert failure == {"error": {"code": 500, "message": "engine failed", "status": "INTERNAL"}}


def test_an_error_before_any_chunk_still_closes_the_array():
    renderer = DIALECT.stream_renderer(parse(ARRAY_ROUTE), CALL)
    chunks = renderer.start() + renderer.error(GatewayError(ErrorKind.OVERLOADED, "down"))
    assert json.loads(b"".join(chunks))[0]["error"]["code"] == 503


# --- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "google_status", "sdk_error"),
    [
        (ErrorKind.INVALID_REQUEST, 400, "INVALID_ARGUMENT", errors.ClientError),
        (ErrorKind.UNSUPPORTED_CONTENT, 400, "INVALID_ARGUMENT", errors.ClientError),
        (ErrorKind.CONTEXT_LENGTH, 400, "INVALID_ARGUMENT", errors.ClientError),
        (ErrorKind.AUTHENTICATION, 401, "UNAUTHENTICATED", errors.ClientError),
        (ErrorKind.NOT_FOUND, 404, "NOT_FOUND", errors.ClientError),
        (ErrorKind.OVERLOADED, 503, "UNAVAILABLE", errors.ServerError),
        (ErrorKind.INTERNAL, 500, "INTERNAL", errors.ServerError),
    ],
)
def test_error_shapes_reach_the_sdk(kind, status, google_status, sdk_error):
    code, error_body = DIALECT.error_response(GatewayError(kind, "it went wrong"))
    assert code == status and set(error_body) == {"error"}
    assert (error_body["error"]["code"], error_body["error"]["status"]) == (status, google_status)
    seen: list[httpx2.Request] = []
    client = sdk_client([json.dumps(error_body).encode()], seen, status=status)
    with pytest.raises(sdk_error) as caught:
        client.models.generate_content(model="tiny", contents="hi")
    assert (caught.value.code, caught.value.status) == (status, google_status)
    assert "it went wrong" in caught.value.message


def test_context_length_reads_like_the_api():
    error = GatewayError(ErrorKind.CONTEXT_LENGTH, "the prompt has 9000 tokens; the context holds 8192")
    message = DIALECT.error_response(error)[1]["error"]["message"]
    assert message.startswith("The input token count exceeds the maximum number of tokens allowed")
    assert "9000" in message


# --- the SDK's own requests, and its echo of our answers ----------------------------------------------


def test_the_sdks_requests_parse():
    seen: list[httpx2.Request] = []
    client = sdk_client(stream_bytes(SSE_ROUTE, "ok", FinishKind.STOP, 10), seen, api_version="v1")
    config = types.GenerateContentConfig(
        system_instruction="Be terse.",
        temperature=0.2,
        top_p=0.9,
        top_k=20,
        max_output_tokens=64,
        stop_sequences=["END"],
        seed=7,
        tools=[
            types.Tool(
                function_declarations=[
                    types.FunctionDeclaration(
                        name="read_file",
                        description="Read a file",
                        parameters=types.Schema(type="OBJECT", properties={"path": types.Schema(type="STRING")}),
                    )
                ]
            )
        ],
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY")),
        thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=1024),
        safety_settings=[types.SafetySetting(category="HARM_CATEGORY_HARASSMENT", threshold="BLOCK_NONE")],
    )
    contents = [
        types.Content(role="user", parts=[types.Part.from_text(text="Read a.py")]),
        types.Content(role="model", parts=[types.Part.from_function_call(name="read_file", args={"path": "a.py"})]),
        types.Content(
            role="user", parts=[types.Part.from_function_response(name="read_file", response={"output": "x = 1"})]
        ),
    ]
    list(client.models.generate_content_stream(model="tiny", contents=contents, config=config))
    request = seen[0]
    assert request.url.path == "/v1/models/tiny:streamGenerateContent"
    route = Route(request.url.path, model="tiny", stream=True, query=dict(request.url.params))
    parsed = DIALECT.parse_request(json.loads(request.content), route)
    assert parsed.conversation.messages == (
        Message("system", "Be terse."),
        Message("user", "Read a.py"),
        Message("assistant", tool_calls=(ToolCall("call_contents1_0", "read_file", {"path": "a.py"}),)),
        Message("tool", '{"output": "x = 1"}', tool_call_id="call_contents1_0", name="read_file"),
    )
    assert parsed.conversation.tools == (
        ToolSpec("read_file", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}}),
    )
    assert parsed.conversation.tool_choice == ToolChoice.required()
    assert parsed.sampling == Sampling(64, 0.2, 0.9, 20, ("END",), 7)
    assert parsed.stream and parsed.echo == {"sse": True, "include_thoughts": True}


@pytest.mark.parametrize("name", ["tool calls", "reasoning", "text"])
def test_a_streamed_turn_echoed_by_an_sdk_chat_matches_its_output(name):
    """The SDK chat keeps the streamed model turn in its history and sends it back on the next call."""
    text, finish = OUTPUTS[name]
    seen: list[httpx2.Request] = []
    client = sdk_client(stream_bytes(SSE_ROUTE, text, finish, 3, generationConfig=THOUGHTS), seen)
    thinking = types.ThinkingConfig(include_thoughts=True)
    chat = client.chats.create(model="tiny", config=types.GenerateContentConfig(thinking_config=thinking))
    list(chat.send_message_stream("hi"))
    output = HermesParser().parse(text, call_id=CALL.call_id)
    reply = [types.Part.from_function_response(name=c.name, response={"output": "done"}) for c in output.tool_calls]
    list(chat.send_message_stream(reply or "thanks"))
    echoed = DIALECT.parse_request(json.loads(seen[1].content), SSE_ROUTE).conversation.messages
    assert echoed[0] == Message("user", "hi")
    assert turns_match(echoed[1], output.message(), strict_reasoning=True)
    assert echoed[1].tool_calls == output.tool_calls  # ids included: the SDK echoes ours
    assert [turn.tool_call_id for turn in echoed[2:] if turn.role == "tool"] == [c.id for c in output.tool_calls]


# --- fuzzing: any body is a request or a client error -------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def maybe(valid: st.SearchStrategy[Any], noise: st.SearchStrategy[Any] = json_values) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes any JSON at all (rarely enough that whole bodies often stay valid)."""
    return st.integers(0, 9).flatmap(lambda draw: noise if draw == 0 else valid)


names = st.sampled_from(["read_file", "ls", "read_file", "ls", ""])
ids = st.sampled_from(["call_c1_0", "mine", ""])
objects = st.dictionaries(st.text(max_size=2), json_values, max_size=2)
text_part = st.fixed_dictionaries(
    {"text": maybe(st.text(max_size=4))}, optional={"thought": maybe(st.booleans()), "thoughtSignature": json_values}
)
call_part = st.fixed_dictionaries(
    {
        "functionCall": maybe(
            st.fixed_dictionaries(
                {"name": maybe(names)},
                optional={"args": maybe(objects), "id": maybe(ids)},
            )
        )
    }
)
response_part = st.builds(
    lambda key, value: {key: value},
    st.sampled_from(["functionResponse", "function_response"]),
    maybe(
        st.fixed_dictionaries(
            {"name": maybe(names)},
            optional={"response": maybe(objects), "id": maybe(ids)},
        )
    ),
)
odd_part = st.fixed_dictionaries(
    {}, optional={key: json_values for key in ("text", "inlineData", "functionCall", "executableCode")}
)
system_content = st.fixed_dictionaries({"parts": st.lists(text_part, max_size=2)})
odd_content = st.fixed_dictionaries(
    {"parts": maybe(st.lists(st.one_of(text_part, call_part, response_part, odd_part), max_size=3))},
    optional={"role": maybe(st.sampled_from(["user", "model", "function", "system"]))},
)
user_content = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "function"]),
        "parts": st.lists(text_part | response_part, min_size=1, max_size=3),
    }
)
model_content = st.fixed_dictionaries(
    {"role": st.just("model"), "parts": st.lists(text_part | call_part, min_size=1, max_size=3)}
)
# Mostly well-formed turns, so that whole bodies often parse and the matching of responses to calls runs.
fuzz_content = st.integers(0, 7).flatmap(
    lambda draw: odd_content if draw == 0 else (user_content if draw % 2 else model_content)
)
schemas = st.dictionaries(st.sampled_from(["type", "properties", "items", "any_of"]), json_values, max_size=2)
fuzz_declaration = maybe(
    st.fixed_dictionaries(
        {"name": maybe(names)},
        optional={
            "parameters": maybe(schemas),
            "parametersJsonSchema": maybe(schemas),
            "description": maybe(st.text(max_size=3)),
        },
    )
)
function_calling = st.fixed_dictionaries(
    {},
    optional={
        "mode": maybe(st.sampled_from(["AUTO", "ANY", "NONE", "VALIDATED"])),
        "allowedFunctionNames": maybe(st.lists(names, max_size=2)),
    },
)
generation = st.fixed_dictionaries(
    {},
    optional={
        "maxOutputTokens": maybe(st.integers(min_value=-5, max_value=2**33)),
        "temperature": maybe(st.floats(min_value=0, max_value=2)),
        "topP": maybe(st.floats(min_value=0, max_value=1)),
        "topK": maybe(st.integers(min_value=0, max_value=100) | st.floats()),
        "seed": maybe(st.integers()),
        "candidateCount": maybe(st.integers(min_value=0, max_value=2)),
        "stopSequences": maybe(st.lists(st.text(max_size=3), max_size=2)),
        "responseModalities": maybe(st.lists(st.sampled_from(["TEXT", "AUDIO"]), max_size=2)),
        "thinkingConfig": maybe(st.fixed_dictionaries({}, optional={"includeThoughts": maybe(st.booleans())})),
    },
)
tool = maybe(st.fixed_dictionaries({"functionDeclarations": maybe(st.lists(fuzz_declaration, max_size=2))}))
valid_body = st.fixed_dictionaries(
    {"contents": maybe(st.lists(fuzz_content, min_size=1, max_size=4))},
    optional={
        "systemInstruction": maybe(st.text(max_size=3) | system_content),
        "tools": maybe(st.lists(maybe(tool, noise=st.fixed_dictionaries({"googleSearch": json_values})), max_size=2)),
        "toolConfig": maybe(st.fixed_dictionaries({"functionCallingConfig": maybe(function_calling)})),
        "generationConfig": maybe(generation),
        "cachedContent": maybe(st.none()),
    },
)
fuzz_body = maybe(valid_body)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzz_body, st.sampled_from([ROUTE, SSE_ROUTE, ARRAY_ROUTE]))
def test_fuzzed_bodies_parse_or_fail_as_client_errors(raw, route):
    try:
        request = DIALECT.parse_request(raw, route)
    except GatewayError as error:
        assert error.kind in (ErrorKind.INVALID_REQUEST, ErrorKind.UNSUPPORTED_CONTENT)
        status, error_body = DIALECT.error_response(error)
        assert status == 400 and error_body["error"]["status"] == "INVALID_ARGUMENT"
        json.dumps(error_body)
    else:
        assert request.model == "tiny" and request.conversation.messages
        assert request.stream is route.stream
        response = DIALECT.render_response(request, result_for("Hi.", FinishKind.STOP))
        types.GenerateContentResponse.model_validate(response)


# ---------------------------------------------------------------------------------------------------
# countTokens
# ---------------------------------------------------------------------------------------------------

COUNT_ROUTE = Route("/v1beta/models/tiny:countTokens", model="tiny")


def test_count_tokens_takes_contents_or_a_whole_generate_request():
    contents = [{"role": "user", "parts": [{"text": "Hi"}]}]
    alone = DIALECT.parse_count_tokens({"contents": contents}, COUNT_ROUTE)
    whole = DIALECT.parse_count_tokens(
        {"generateContentRequest": {"contents": contents, "systemInstruction": {"parts": [{"text": "Be terse."}]}}},
        COUNT_ROUTE,
    )
    assert [m.role for m in alone.conversation.messages] == ["user"]
    assert [m.role for m in whole.conversation.messages] == ["system", "user"]
    assert not alone.stream and not whole.stream
    assert DIALECT.count_tokens_response(12) == {"totalTokens": 12}


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {"contents": [{"role": "user", "parts": [{"text": "a"}]}], "generateContentRequest": {"contents": []}},
            "contents",
        ),
        ({"generateContentRequest": "no"}, "generateContentRequest"),
        ([], None),
    ],
)
def test_count_tokens_bad_bodies(body, field):
    with pytest.raises(GatewayError) as caught:
        DIALECT.parse_count_tokens(body, COUNT_ROUTE)
    assert caught.value.kind is ErrorKind.INVALID_REQUEST and caught.value.param == field
