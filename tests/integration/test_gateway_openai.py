"""The real `openai` SDK against a running gateway (scripted engine): Chat Completions and Responses.

One gateway serves the module; each test opens its own session, so `records()` holds only its calls.
The scripted engine answers by prompt regex, so a test steers the model through what it sends.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest

from polar.testing.gateway import GatewayHandle
from polar.v1 import common_pb2
from tests.helpers.gateway_options import GatewayOptions

pytestmark = pytest.mark.anyio

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STEP_CALL = '<tool_call>\n{"name": "step", "arguments": {"n": 1, "opts": {"deep": [true, 2.5]}}}\n</tool_call>'
SCRIPT = {
    "cycle": True,
    "context_length": 4096,
    "rules": [
        {"prompt_regex": r"<tool_response>\n18C", "text": "<think>Got it.</think>It is 18C in Paris."},
        {"prompt_regex": "weather in Paris", "text": f"<think>\nI should check.\n</think>\n\n{WEATHER_CALL}"},
        {"prompt_regex": "step 9 done", "text": "All ten steps are done."},
        {"prompt_regex": "ten steps", "text": f"<think>Next step.</think>Stepping.\n{STEP_CALL}"},
        {"prompt_regex": "stop here", "text": "one two END three"},
    ],
    "outputs": [{"text": "<think>Greeting.</think>Hello from Polar."}],
}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
STEP = {"name": "step", "description": "Do one step", "parameters": {"type": "object"}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": STEP}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}, {"type": "function", **STEP}]
# What Codex sends besides the conversation; accepted and ignored.
CODEX_FIELDS = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "medium", "summary": "auto"},
    "parallel_tool_calls": False,
    "prompt_cache_key": "polar-test",
    "text": {"verbosity": "medium"},
}


# SDK clients made by this module's tests: the `gateway` fixture closes them after its last test.
CLIENTS: list[openai.AsyncOpenAI] = []


def sdk_client(gateway: GatewayHandle, key: str) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    CLIENTS.append(client)
    return client


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    return GatewayOptions(SCRIPT, clients=CLIENTS)


class Session:
    """One gateway session driven by the real SDK."""

    def __init__(self, gateway: GatewayHandle) -> None:
        self.gateway = gateway
        self.key = gateway.open_session(task_id="openai")
        self.client = sdk_client(gateway, self.key)

    def records(self) -> list[common_pb2.CallRecord]:
        return self.gateway.records(self.key)

    async def chat(self, messages: list[dict[str, Any]], stream: bool, **kwargs: Any):
        """The completion, reassembled by the SDK's stream helper when streaming."""
        if not stream:
            return await self.client.chat.completions.create(model="polar", messages=messages, **kwargs)
        async with self.client.chat.completions.stream(model="polar", messages=messages, **kwargs) as events:
            return await events.get_final_completion()

    async def respond(self, input: Any, stream: bool, **kwargs: Any):
        """The response, accumulated and checked by the SDK's stream helper when streaming."""
        if not stream:
            return await self.client.responses.create(model="polar", input=input, **kwargs)
        async with self.client.responses.stream(model="polar", input=input, **kwargs) as events:
            return await events.get_final_response()


def assert_extends(records: list[common_pb2.CallRecord]) -> None:
    """Each call's prompt starts with the previous call's prompt + sampled ids."""
    for before, after in zip(records, records[1:]):
        previous = list(before.prompt_token_ids) + list(before.sampled_token_ids)
        assert list(after.prompt_token_ids[: len(previous)]) == previous
        assert after.extends_call_id == before.call_id


# ---------------------------------------------------------------------------------------------------
# Chat Completions
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completion(gateway, stream):
    session = Session(gateway)
    completion = await session.chat(
        [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
        stream,
        stream_options={"include_usage": True} if stream else openai.omit,
    )
    message = completion.choices[0].message
    assert (message.content, completion.choices[0].finish_reason) == ("Hello from Polar.", "stop")
    if not stream:
        assert message.model_extra["reasoning_content"] == "Greeting."
    [record] = session.records()
    assert record.dialect == common_pb2.DIALECT_OPENAI_CHAT
    assert completion.usage.prompt_tokens == len(record.prompt_token_ids)
    assert completion.usage.completion_tokens == len(record.sampled_token_ids)


async def test_chat_stream_carries_reasoning_deltas(gateway):
    session = Session(gateway)
    stream = await session.client.chat.completions.create(
        model="polar", messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    chunks = [chunk async for chunk in stream]
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == "Greeting."
    assert "".join(delta.content or "" for delta in deltas) == "Hello from Polar."


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_tool_use_loop(gateway, stream):
    session = Session(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await session.chat(messages, stream, tools=CHAT_TOOLS)
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18C"},
    ]
    second = await session.chat(messages, stream, tools=CHAT_TOOLS)
    assert second.choices[0].message.content == "It is 18C in Paris."
    assert_extends(session.records())


async def test_chat_ten_turn_tool_conversation_is_token_faithful(gateway):
    session = Session(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Take ten steps."}]
    for turn in range(10):
        completion = await session.chat(messages, stream=turn % 2 == 1, tools=CHAT_TOOLS)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"step {turn + 1} done"})
    assert message.content == "All ten steps are done." and not message.tool_calls
    records = session.records()
    assert len(records) == 10
    assert_extends(records)


async def test_chat_stop_strings(gateway):
    session = Session(gateway)
    completion = await session.chat([{"role": "user", "content": "stop here"}], False, stop=["END"])
    assert (completion.choices[0].message.content, completion.choices[0].finish_reason) == ("one two", "stop")


# ---------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_response(gateway, stream):
    session = Session(gateway)
    response = await session.respond("Hi", stream, instructions="Be kind.", **CODEX_FIELDS)
    assert (response.status, response.output_text) == ("completed", "Hello from Polar.")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Greeting."
    [record] = session.records()
    assert record.dialect == common_pb2.DIALECT_OPENAI_RESPONSES
    assert response.usage.input_tokens == len(record.prompt_token_ids)
    assert response.usage.output_tokens == len(record.sampled_token_ids)


async def test_response_stream_events_arrive_in_order(gateway):
    session = Session(gateway)
    stream = await session.client.responses.create(model="polar", input="Hi", stream=True)
    events = [event async for event in stream]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == (
        "Hello from Polar."
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_response_tool_use_loop(gateway, stream):
    session = Session(gateway)
    items: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await session.respond(items, stream, tools=RESPONSES_TOOLS, **CODEX_FIELDS)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Paris"})]
    # Codex echoes every output item back, then the call's output.
    items += [item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in first.output]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"})
    second = await session.respond(items, stream, tools=RESPONSES_TOOLS, **CODEX_FIELDS)
    assert second.output_text == "It is 18C in Paris."
    assert_extends(session.records())


async def test_response_ten_turn_tool_conversation_is_token_faithful(gateway):
    session = Session(gateway)
    items: list[Any] = [{"role": "user", "content": "Take ten steps."}]
    for turn in range(10):
        response = await session.respond(items, stream=turn % 2 == 0, tools=RESPONSES_TOOLS, **CODEX_FIELDS)
        items += [item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in response.output]
        for item in response.output:
            if item.type == "function_call":
                items.append(
                    {"type": "function_call_output", "call_id": item.call_id, "output": f"step {turn + 1} done"}
                )
    assert response.output_text == "All ten steps are done."
    records = session.records()
    assert len(records) == 10
    assert_extends(records)


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


async def post(gateway: GatewayHandle, path: str, content: bytes, key: str | None = None) -> httpx2.Response:
    async with httpx2.AsyncClient() as client:
        return await client.post(
            gateway.base_url + path,
            content=content,
            headers={"authorization": f"Bearer {key or gateway.key}", "content-type": "application/json"},
        )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_malformed_json_is_a_400_in_the_openai_shape(gateway, path):
    response = await post(gateway, path, b'{"model": "polar", "messages": [')
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        error["type"] == "invalid_request_error"
        and error["message"]
        and set(error) == {"message", "type", "param", "code"}
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "polar", "messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"model": "polar", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            "temperature",
        ),
        ("/v1/responses", {"model": "polar", "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
        ("/v1/responses", {"model": "polar", "input": [{"type": "function_call"}]}, "input[0].call_id"),
    ],
)
async def test_wrong_types_are_400_naming_the_field(gateway, path, body, param):
    response = await post(gateway, path, json.dumps(body).encode())
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_sdk_sees_bad_requests_images_and_bad_keys(gateway):
    session = Session(gateway)
    with pytest.raises(openai.BadRequestError) as caught:
        await session.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], True)
    assert caught.value.code == "unsupported_content"
    with pytest.raises(openai.BadRequestError, match="stateless"):
        await session.respond("hi", True, previous_response_id="resp_1")
    intruder = sdk_client(gateway, "not-a-key")
    with pytest.raises(openai.AuthenticationError) as caught:
        await intruder.chat.completions.create(model="polar", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        async with intruder.responses.stream(model="polar", input="hi") as events:
            await events.get_final_response()
    assert session.records() == []


@pytest.mark.parametrize("responses", [False, True])
async def test_a_prompt_over_the_context_is_context_length_exceeded(gateway, responses):
    session = Session(gateway)
    long_text = "word " * 5000
    with pytest.raises(openai.BadRequestError) as caught:
        if responses:
            await session.respond(long_text, False)
        else:
            await session.chat([{"role": "user", "content": long_text}], False)
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded"
