"""The real `anthropic` SDK against a running gateway (scripted engine): the Anthropic Messages routes.

One gateway serves the module; each test opens its own session, so `records()` holds only its calls.
The scripted engine answers by prompt regex, so a test steers the model through what it sends.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types.shared import ErrorResponse

from polar.testing.gateway import GatewayHandle, running_gateway
from tests.helpers.gateway_options import GatewayOptions

pytestmark = pytest.mark.anyio

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STEP_ARGUMENTS = '{"n": 1, "opts": {"deep": [true, 2.5]}}'
STEP_CALL = f'<tool_call>\n{{"name": "step", "arguments": {STEP_ARGUMENTS}}}\n</tool_call>'
SCRIPT = {
    "cycle": True,
    "rules": [
        {"prompt_regex": r"You are terse\.\nEnv: test\nRemember this\.", "text": "SYS-OK"},
        {"prompt_regex": r"<tool_response>\n18C", "text": "<think>Got it.</think>It is 18C in Paris."},
        {"prompt_regex": "weather in Paris", "text": f"<think>\nI should check.\n</think>\n\n{WEATHER_CALL}"},
        {"prompt_regex": "step 9 done", "text": "All ten steps are done."},
        {"prompt_regex": "ten steps", "text": f"<think>Next step.</think>Stepping.\n{STEP_CALL}"},
        {"prompt_regex": "stop here", "text": "one two END three"},
    ],
    "outputs": [{"text": "Hello from Polar."}],
}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
STEP_TOOL = {"name": "step", "description": "Do one step", "input_schema": {"type": "object"}}
# What Claude Code sends besides the conversation; accepted and ignored.
CLAUDE_CODE_FIELDS = {
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "polar-test"},
}


# HTTP clients made by this module's tests: the `gateway` fixture closes them after its last test.
CLIENTS: list[httpx2.AsyncClient] = []


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    return GatewayOptions(SCRIPT, clients=CLIENTS)


class Session:
    """One gateway session driven by the real SDK, with the URLs it requested."""

    def __init__(self, gateway: GatewayHandle) -> None:
        self.gateway = gateway
        self.key = gateway.open_session(task_id="anthropic")
        self.urls: list[str] = []

        async def remember(request: httpx2.Request) -> None:
            self.urls.append(str(request.url))

        http_client = httpx2.AsyncClient(event_hooks={"request": [remember]})
        CLIENTS.append(http_client)
        # Claude Code's ANTHROPIC_BASE_URL is the gateway's root, without /v1. An explicit timeout lets
        # the SDK send max_tokens 32000 without streaming (it refuses that under its default timeout).
        self.client = anthropic.AsyncAnthropic(
            base_url=gateway.base_url, api_key=self.key, max_retries=0, timeout=60, http_client=http_client
        )

    def records(self):
        return self.gateway.records(self.key)

    async def create(self, messages: list[dict[str, Any]], *, stream: bool = False, **fields: Any):
        fields = {"model": "polar-policy", "max_tokens": 32000, "messages": messages} | fields
        # Claude Code calls /v1/messages?beta=true.
        extra = {"extra_body": CLAUDE_CODE_FIELDS, "extra_query": {"beta": "true"}}
        if not stream:
            return await self.client.messages.create(**fields, **extra)
        async with self.client.messages.stream(**fields, **extra) as events:
            return await events.get_final_message()


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def echo(message: Any) -> dict[str, Any]:
    """The assistant turn as a harness sends it back: the blocks it received."""
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    return {"role": "assistant", "content": blocks}


def assert_extends(records: list[Any]) -> None:
    """Each call's prompt starts with the previous call's prompt + sampled ids."""
    for before, after in zip(records, records[1:]):
        previous = list(before.prompt_token_ids) + list(before.sampled_token_ids)
        assert list(after.prompt_token_ids[: len(previous)]) == previous
        assert after.extends_call_id == before.call_id


async def test_head_root_answers_without_a_key(gateway):
    async with httpx2.AsyncClient() as client:
        response = await client.head(gateway.base_url + "/")
    assert response.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_message_with_beta_query(gateway, stream):
    session = Session(gateway)
    message = await session.create([{"role": "user", "content": "Say hello."}], stream=stream)
    assert text_of(message) == "Hello from Polar."
    assert message.stop_reason == "end_turn" and message.model == "polar-policy"
    assert session.urls == [gateway.base_url + "/v1/messages?beta=true"]
    [record] = session.records()
    assert message.usage.input_tokens == len(record.prompt_token_ids)
    assert message.usage.output_tokens == len(record.sampled_token_ids)
    assert json.loads(record.response_body)["content"][0]["text"] == "Hello from Polar."


async def test_system_prompt_and_system_messages_fold_in_order(gateway):
    session = Session(gateway)
    messages = [
        {"role": "system", "content": "Env: test"},
        {"role": "user", "content": "Hi."},
        {"role": "system", "content": [{"type": "text", "text": "Remember this."}]},
    ]
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    message = await session.create(messages, system=system)
    assert text_of(message) == "SYS-OK"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_loop(gateway, stream):
    session = Session(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await session.create(messages, stream=stream, tools=[WEATHER_TOOL])
    assert first.stop_reason == "tool_use"
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    thinking, call = first.content
    assert thinking.thinking == "I should check." and thinking.signature
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})

    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18C"}]}
    messages += [echo(first), {"role": "user", "content": [result]}]
    final = await session.create(messages, stream=stream, tools=[WEATHER_TOOL])
    assert final.stop_reason == "end_turn" and text_of(final) == "It is 18C in Paris."
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert_extends(session.records())


async def test_ten_turn_tool_conversation_is_token_faithful(gateway):
    session = Session(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Do ten steps."}]
    for turn in range(10):
        # Alternate: a streamed turn's blocks must echo back as exactly as a whole response's.
        message = await session.create(messages, stream=turn % 2 == 1, tools=[STEP_TOOL])
        if turn == 9:
            assert message.stop_reason == "end_turn" and text_of(message) == "All ten steps are done."
            break
        assert message.stop_reason == "tool_use" and text_of(message) == "Stepping."
        [call] = [block for block in message.content if block.type == "tool_use"]
        assert call.input == {"n": 1, "opts": {"deep": [True, 2.5]}}
        result = {"type": "tool_result", "tool_use_id": call.id, "content": f"step {turn + 1} done"}
        messages += [echo(message), {"role": "user", "content": [result]}]
    records = session.records()
    assert len(records) == 10
    assert_extends(records)


async def test_stop_sequences(gateway):
    session = Session(gateway)
    message = await session.create([{"role": "user", "content": "Count, stop here."}], stop_sequences=["END"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert text_of(message) == "one two"


async def test_count_tokens_is_the_prompt_a_call_gets(gateway):
    session = Session(gateway)
    body = {"model": "polar-policy", "system": "Be brief.", "tools": [WEATHER_TOOL]}
    messages = [{"role": "user", "content": "Say hello."}]
    counted = await session.client.messages.count_tokens(**body, messages=messages)
    message = await session.create(messages, **body)
    assert counted.input_tokens == message.usage.input_tokens > 0


async def post(gateway: GatewayHandle, content: bytes, key: str | None) -> httpx2.Response:
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    if key is not None:
        headers["x-api-key"] = key
    async with httpx2.AsyncClient() as client:
        url = gateway.base_url + "/v1/messages?beta=true"
        return await client.post(url, content=content, headers=headers)


VALID = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("content", "message_start"),
    [
        (b"{not json", ""),
        (json.dumps({"model": "m", "messages": VALID["messages"]}).encode(), "max_tokens: "),
        (json.dumps(VALID | {"temperature": "hot"}).encode(), "temperature: "),
        (
            json.dumps(VALID | {"messages": [{"role": "user", "content": [{"type": "image"}]}]}).encode(),
            "messages.0.content.0.type: ",
        ),
        (json.dumps(VALID | {"tool_choice": {"type": "any"}}).encode(), "tool_choice: "),
    ],
)
async def test_bad_requests_are_400_invalid_request_errors(gateway, content, message_start):
    response = await post(gateway, content, gateway.open_session())
    assert response.status_code == 400
    error = ErrorResponse.model_validate(response.json())
    assert error.error.type == "invalid_request_error"
    assert error.error.message.startswith(message_start)


@pytest.mark.parametrize("key", [None, "not-a-session"])
async def test_a_bad_key_is_401(gateway, key):
    response = await post(gateway, json.dumps(VALID).encode(), key)
    assert response.status_code == 401
    assert ErrorResponse.model_validate(response.json()).error.type == "authentication_error"


async def test_a_closed_session_is_an_sdk_authentication_error(gateway):
    session = Session(gateway)
    gateway.close_session(session.key)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await session.create([{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"


async def test_a_prompt_over_the_context_says_it_is_too_long():
    async with running_gateway({"context_length": 64, "outputs": [{"text": "x"}]}) as small:
        session = Session(small)
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as caught:
                await session.create([{"role": "user", "content": "word " * 200}], stream=stream)
            assert caught.value.body["error"]["type"] == "invalid_request_error"
            assert re.fullmatch(r"prompt is too long: \d+ tokens > 63 maximum", caught.value.body["error"]["message"])
