"""Forced tool calls and JSON-schema output through each official SDK, kept by constrained decoding.

Every test runs twice: on the torch engine with the tiny model (random weights: left alone it never
writes a tool call or JSON), and, in the vLLM tier (.venv-vllm), on the vLLM engine with SmolLM2-135M,
whose structured outputs take the same grammar. Each dialect's forcing option, and each schema option,
50 calls (25 at a time on the torch engine, all at once on vLLM): every reply holds a call the SDK
parses, of an allowed function, with arguments valid for its schema (or JSON valid for the response
schema), and the record says which constraint applied. A constrained reply cut by its max tokens is a
length finish, recorded as truncated; a client's stop string never cuts a constrained reply; a schema
the compiler refuses is a 400 in the caller's dialect.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from polar.inference.constraints import TokenGrammar
from polar.inference.engines import create_engine
from polar.inference.engines.base import EngineOptions
from polar.trajectory.records import views_from_protos
from polar.trajectory.session_file import read_trajectory
from polar.trajectory.verify import check_constraints
from polar.v1 import common_pb2
from tests.helpers.gateway_options import GatewayOptions

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CALLS = 50
# Calls in flight at once, per engine: the torch engine's batch on two busy cores; vLLM takes all 50
# in one batch, which halves its tier's time.
AT_ONCE = {"torch": 25, "vllm": CALLS}
MAX_TOKENS = 64  # every bounded reply below fits in about 35 tokens
PROMPT = "What is the weather like?"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
    "required": ["hour", "loud"],
    "additionalProperties": False,
}
TOOLS = {"get_weather": WEATHER, "set_alarm": ALARM}
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
SESSIONS = Path(__file__).parents[1] / "fixtures" / "sessions"
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}

# HTTP clients made by this module's tests: the `gateway` fixture closes them after its last test.
CLIENTS: list[httpx2.AsyncClient] = []


ENGINES = [
    pytest.param(("torch", "tiny"), id="torch"),
    pytest.param(("vllm", "smollm2-135m"), id="vllm", marks=pytest.mark.vllm),  # vLLM refuses tiny's head size
]


@pytest.fixture(scope="module", params=ENGINES)
def gateway_options(request) -> GatewayOptions:
    kind, model = request.param
    # Without Envoy: on two busy cores, 25 streams of the engine's worker can delay the inference
    # server's answers to Envoy's health checks past their 1 s timeout, and Envoy then takes it out of
    # rotation (503). What is under test here is the gateway and the engine, not Envoy's checks.
    if kind == "vllm":
        # The vLLM tier's engine (tests/integration/conftest.py), which takes 50 sequences at once.
        return GatewayOptions(
            engine=request.getfixturevalue("vllm_engine"), envoy=False, stop_engine=False, clients=CLIENTS
        )
    engine = create_engine(kind, EngineOptions(model=model, max_batch_size=AT_ONCE[kind]))
    return GatewayOptions(engine=engine, envoy=False, clients=CLIENTS)


async def _all(gateway, calls) -> list:
    """The calls' results, at most AT_ONCE of the gateway's engine running at a time."""
    gate = asyncio.Semaphore(AT_ONCE[gateway.engine.description.engine])

    async def gated(call):
        async with gate:
            return await call

    return await asyncio.gather(*(gated(call) for call in calls))


def _model(gateway) -> str:
    return gateway.engine.description.name


def _http() -> httpx2.AsyncClient:
    client = httpx2.AsyncClient(timeout=300)
    CLIENTS.append(client)
    return client


# Each SDK's client of a session key (a test's), made at its first call and shared by the test's
# calls, as an application shares one: a new client loads the system's CA certificates into an SSL
# context of its own (about 50 ms of CPU, Gemini's client twice), which 50 calls paid 50 times.
SDK_CLIENTS: dict[tuple[str, str, str], Any] = {}


def _sdk_client(kind: str, gateway, key: str, make) -> Any:
    made = SDK_CLIENTS.get((kind, gateway.base_url, key))
    if made is None:
        made = SDK_CLIENTS[(kind, gateway.base_url, key)] = make()
    return made


def _openai(gateway, key):
    return _sdk_client(
        "openai",
        gateway,
        key,
        lambda: openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, http_client=_http()),
    )


def _anthropic(gateway, key):
    return _sdk_client(
        "anthropic",
        gateway,
        key,
        lambda: anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=key, max_retries=0, http_client=_http()),
    )


def _gemini(gateway, key):
    def make():
        options = types.HttpOptions(base_url=gateway.base_url, httpx_async_client=_http())
        return genai.Client(api_key=key, http_options=options).aio.models

    return _sdk_client("gemini", gateway, key, make)


# -- one forced call per dialect: returns (function name, arguments) as the SDK parsed them ------------


async def chat_call(gateway, key, allowed: list[str]) -> tuple[str, dict]:
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()]
    choice = "required" if len(allowed) > 1 else {"type": "function", "function": {"name": allowed[0]}}
    completion = await _openai(gateway, key).chat.completions.create(
        model=_model(gateway),
        messages=[{"role": "user", "content": PROMPT}],
        tools=tools,
        tool_choice=choice,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    assert completion.choices[0].finish_reason == "tool_calls"
    (call,) = completion.choices[0].message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


async def responses_call(gateway, key, allowed: list[str]) -> tuple[str, dict]:
    tools = [{"type": "function", "name": n, "parameters": s, "strict": False} for n, s in TOOLS.items()]
    choice = "required" if len(allowed) > 1 else {"type": "function", "name": allowed[0]}
    response = await _openai(gateway, key).responses.create(
        model=_model(gateway),
        input=PROMPT,
        tools=tools,
        tool_choice=choice,
        max_output_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    return call.name, json.loads(call.arguments)


async def anthropic_call(gateway, key, allowed: list[str]) -> tuple[str, dict]:
    tools = [{"name": n, "input_schema": s} for n, s in TOOLS.items()]
    choice = {"type": "any"} if len(allowed) > 1 else {"type": "tool", "name": allowed[0]}
    message = await _anthropic(gateway, key).messages.create(
        model=_model(gateway),
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        tools=tools,
        tool_choice=choice,
    )
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    return call.name, call.input


async def gemini_call(gateway, key, allowed: list[str]) -> tuple[str, dict]:
    declarations = [types.FunctionDeclaration(name=n, parameters_json_schema=s) for n, s in TOOLS.items()]
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=declarations)],
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(mode="ANY", allowed_function_names=allowed)
        ),
        max_output_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    response = await _gemini(gateway, key).generate_content(model=_model(gateway), contents=PROMPT, config=config)
    (call,) = response.function_calls
    return call.name, call.args


FORCING = {"chat": chat_call, "responses": responses_call, "anthropic": anthropic_call, "gemini": gemini_call}


@pytest.mark.parametrize("dialect", FORCING)
async def test_a_forced_call_is_always_a_valid_call_of_an_allowed_function(gateway, dialect):
    key = gateway.open_session(task_id=f"forced {dialect}")
    # Half the calls force one named function, half any of the two (required / any / ANY).
    choices = [["set_alarm"] if index % 2 else list(TOOLS) for index in range(CALLS)]
    calls = await _all(gateway, (FORCING[dialect](gateway, key, allowed) for allowed in choices))
    for allowed, (name, arguments) in zip(choices, calls):
        assert name in allowed
        jsonschema.validate(arguments, TOOLS[name])
    records = gateway.records(key)
    assert len(records) == CALLS
    for record in records:
        assert record.sampling.constraint.kind == "tool_call"
        assert record.finish_reason == common_pb2.FINISH_REASON_STOP and not record.truncated
        assert record.forced_token_count == 0  # the grammar opens the call: every token is sampled


# SmolLM2's 8k-token context cannot hold Claude Code's 20.3k-token request: the torch engine's tiny model only.
@pytest.mark.parametrize("gateway_options", ENGINES[:1], indirect=True)
async def test_claude_codes_own_request_with_a_forced_call_is_decoded_under_its_whole_tool_list(gateway):
    """Claude Code's first recorded request (its 24 tools; TaskCreate and TaskUpdate hold zod records,
    `propertyNames`, which the grammar compiler lacks) with `tool_choice` any, through the Anthropic SDK:
    a reply, not a 400, and every sampled token one the grammar admitted."""
    body = json.loads(read_trajectory(SESSIONS / "claude-code.json.zst").calls[0].request_body)
    key = gateway.open_session(task_id="claude code forced")
    message = await _anthropic(gateway, key).messages.create(
        model=_model(gateway),
        max_tokens=24,
        system=body["system"],
        messages=body["messages"],
        tools=body["tools"],
        tool_choice={"type": "any"},
    )
    (record,) = gateway.records(key)
    assert record.sampling.constraint.kind == "tool_call"
    assert '"TaskCreate"' in record.sampling.constraint.json_schema
    assert check_constraints(views_from_protos([record]), TokenGrammar.for_model(_model(gateway))) == []
    if message.stop_reason == "max_tokens":  # free strings seldom end within 24 tokens
        assert record.truncated
    else:
        assert message.stop_reason == "tool_use" and not record.truncated
        (call,) = [block for block in message.content if block.type == "tool_use"]
        schemas = {tool["name"]: tool["input_schema"] for tool in body["tools"]}
        jsonschema.validate(call.input, schemas[call.name])


# -- JSON-schema output per dialect: returns the reply's text --------------------------------------------


async def chat_json(gateway, key, max_tokens=MAX_TOKENS) -> tuple[str, str]:
    completion = await _openai(gateway, key).chat.completions.create(
        model=_model(gateway),
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}},
    )
    return completion.choices[0].message.content, completion.choices[0].finish_reason


async def responses_json(gateway, key) -> tuple[str, str]:
    response = await _openai(gateway, key).responses.create(
        model=_model(gateway),
        input=PROMPT,
        max_output_tokens=MAX_TOKENS,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
    )
    return response.output_text, response.status


async def gemini_json(gateway, key) -> tuple[str, str]:
    config = types.GenerateContentConfig(
        response_mime_type="application/json",
        response_json_schema=ANSWER,
        max_output_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    response = await _gemini(gateway, key).generate_content(model=_model(gateway), contents=PROMPT, config=config)
    return response.text, response.candidates[0].finish_reason.value


async def gemini_schema_json(gateway, key) -> tuple[str, str]:
    """The API's own Schema (upper-case type names), as the SDK writes a `response_schema`."""
    schema = types.Schema(
        type="OBJECT",
        properties={
            "answer": types.Schema(type="STRING", enum=["yes", "no", "maybe"]),
            "score": types.Schema(type="INTEGER", minimum=0, maximum=10),
        },
        required=["answer", "score"],
    )
    config = types.GenerateContentConfig(
        response_mime_type="application/json", response_schema=schema, max_output_tokens=MAX_TOKENS, temperature=1.0
    )
    response = await _gemini(gateway, key).generate_content(model=_model(gateway), contents=PROMPT, config=config)
    return response.text, response.candidates[0].finish_reason.value


SCHEMA_OUTPUT = {
    "chat": chat_json,
    "responses": responses_json,
    "gemini": gemini_json,
    "gemini_schema": gemini_schema_json,
}
COMPLETE = {"chat": "stop", "responses": "completed", "gemini": "STOP", "gemini_schema": "STOP"}


@pytest.mark.parametrize("dialect", SCHEMA_OUTPUT)
async def test_json_schema_output_always_validates(gateway, dialect):
    key = gateway.open_session(task_id=f"schema {dialect}")
    calls = CALLS if dialect != "gemini_schema" else CALLS // 2  # the same check as gemini's, on another schema form
    replies = await _all(gateway, (SCHEMA_OUTPUT[dialect](gateway, key) for _ in range(calls)))
    for text, finish in replies:
        assert finish == COMPLETE[dialect]
        jsonschema.validate(json.loads(text), ANSWER)
    assert all(record.sampling.constraint.kind == "json_schema" for record in gateway.records(key))


async def test_a_constrained_reply_cut_by_max_tokens_is_a_truncated_length_finish(gateway):
    key = gateway.open_session(task_id="cut")
    # At least 64 characters: no model can finish it in 6 tokens.
    free_text = {"type": "object", "properties": {"story": {"type": "string", "minLength": 64}}, "required": ["story"]}
    completion = await _openai(gateway, key).chat.completions.create(
        model=_model(gateway),
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": free_text}},
    )
    assert completion.choices[0].finish_reason == "length"
    (record,) = gateway.records(key)
    assert record.finish_reason == common_pb2.FINISH_REASON_LENGTH and record.truncated
    assert len(record.sampled_token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.choices[0].message.content)


# -- a client's stop string never cuts a constrained reply ------------------------------------------------
# Each reply below holds the stop string ('"' in every JSON object with a key, "{" in every call): applied,
# it would cut the reply into invalid JSON presented as complete. (Responses has no stop strings.)

STOP_CALLS = 5


async def chat_stopped(gateway, key) -> tuple[Any, str]:
    completion = await _openai(gateway, key).chat.completions.create(
        model=_model(gateway),
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        stop=['"', "no"],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
    )
    return json.loads(completion.choices[0].message.content), completion.choices[0].finish_reason


async def anthropic_stopped(gateway, key) -> tuple[Any, str]:
    message = await _anthropic(gateway, key).messages.create(
        model=_model(gateway),
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
        tool_choice={"type": "any"},
        stop_sequences=["{", '"'],
    )
    assert message.stop_sequence is None
    (call,) = [block for block in message.content if block.type == "tool_use"]
    return call.input, message.stop_reason


async def gemini_stopped(gateway, key) -> tuple[Any, str]:
    config = types.GenerateContentConfig(
        response_mime_type="application/json",
        response_json_schema=ANSWER,
        max_output_tokens=MAX_TOKENS,
        temperature=1.0,
        stop_sequences=['"'],
    )
    response = await _gemini(gateway, key).generate_content(model=_model(gateway), contents=PROMPT, config=config)
    return json.loads(response.text), response.candidates[0].finish_reason.value


STOPPED = {
    "chat": (chat_stopped, ANSWER, "stop"),
    "anthropic": (anthropic_stopped, WEATHER, "tool_use"),
    "gemini": (gemini_stopped, ANSWER, "STOP"),
}


@pytest.mark.parametrize("dialect", STOPPED)
async def test_a_stop_string_does_not_cut_a_constrained_reply(gateway, dialect):
    call, schema, complete = STOPPED[dialect]
    key = gateway.open_session(task_id=f"stop {dialect}")
    for value, finish in await _all(gateway, (call(gateway, key) for _ in range(STOP_CALLS))):
        jsonschema.validate(value, schema)
        assert finish == complete
    for record in gateway.records(key):
        assert record.finish_reason == common_pb2.FINISH_REASON_STOP and not record.truncated


# -- a schema the compiler refuses: 400 in each dialect, naming the problem -------------------------------


async def test_a_schema_the_compiler_refuses_is_a_400_in_each_dialect(gateway):
    key = gateway.open_session(task_id="bad schema")
    problem = "does not exist"  # the compiler's words for the dangling $ref
    with pytest.raises(openai.BadRequestError) as chat_error:
        await _openai(gateway, key).chat.completions.create(
            model=_model(gateway),
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
            tool_choice="required",
        )
    assert problem in str(chat_error.value) and "'f'" in str(chat_error.value)
    with pytest.raises(openai.BadRequestError) as responses_error:
        await _openai(gateway, key).responses.create(
            model=_model(gateway),
            input=PROMPT,
            max_output_tokens=8,
            text={"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}},
        )
    assert problem in str(responses_error.value)
    with pytest.raises(anthropic.BadRequestError) as anthropic_error:
        await _anthropic(gateway, key).messages.create(
            model=_model(gateway),
            max_tokens=8,
            messages=[{"role": "user", "content": PROMPT}],
            tools=[{"name": "f", "input_schema": BAD_SCHEMA}],
            tool_choice={"type": "any"},
        )
    assert problem in str(anthropic_error.value)
    with pytest.raises(genai_errors.ClientError) as gemini_error:
        await _gemini(gateway, key).generate_content(
            model=_model(gateway),
            contents=PROMPT,
            config=types.GenerateContentConfig(response_mime_type="application/json", response_json_schema=BAD_SCHEMA),
        )
    assert gemini_error.value.code == 400 and problem in str(gemini_error.value)
    assert gateway.records(key) == []  # refused before anything was generated
