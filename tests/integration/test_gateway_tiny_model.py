"""The tiny model (real torch engine, random weights) through Envoy and the gateway, driven by each
official SDK, streamed and not: whatever the model samples, the records hold consistent ids and
logprobs, and a second turn that sends the first reply back extends its prompt token for token.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from google import genai
from google.genai import types

from polar.inference.engines import create_engine
from polar.inference.engines.base import EngineOptions
from polar.testing.gateway import GatewayHandle
from polar.v1 import common_pb2
from tests.helpers.gateway_options import GatewayOptions

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MAX_TOKENS = 16
FIRST, SECOND = "Tell me about the sea.", "And the sky?"
# Each SDK's finish reasons for "the model ended its turn" and "max tokens reached".
FINISHES = {
    "chat": {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH},
    "responses": {"completed": common_pb2.FINISH_REASON_STOP, "incomplete": common_pb2.FINISH_REASON_LENGTH},
    "anthropic": {"end_turn": common_pb2.FINISH_REASON_STOP, "max_tokens": common_pb2.FINISH_REASON_LENGTH},
    "gemini": {"STOP": common_pb2.FINISH_REASON_STOP, "MAX_TOKENS": common_pb2.FINISH_REASON_LENGTH},
}


# HTTP clients of this module's SDKs: the `gateway` fixture closes them after its last test.
CLIENTS: list[httpx2.AsyncClient] = []


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    return GatewayOptions(engine=create_engine("torch", EngineOptions(model="tiny")), clients=CLIENTS)


def _http() -> httpx2.AsyncClient:
    client = httpx2.AsyncClient(timeout=120)
    CLIENTS.append(client)
    return client


# Each conversation: two turns through one SDK; returns each turn's finish reason as the SDK parsed it.
Conversation = Callable[[GatewayHandle, str, bool], Awaitable[list[str]]]


async def chat(gateway: GatewayHandle, key: str, stream: bool) -> list[str]:
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, http_client=_http())
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    finishes = []
    for next_turn in (SECOND, None):
        fields = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
        if stream:
            # Raw chunks: the SDK's stream helper raises on finish_reason "length", which 16 tokens reach.
            chunks = [chunk async for chunk in await client.chat.completions.create(**fields, stream=True)]
            content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            finish = next(
                chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason
            )
        else:
            completion = await client.chat.completions.create(**fields)
            content, finish = completion.choices[0].message.content, completion.choices[0].finish_reason
        finishes.append(finish)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": next_turn}]
    return finishes


async def responses(gateway: GatewayHandle, key: str, stream: bool) -> list[str]:
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, http_client=_http())
    items: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    finishes = []
    for next_turn in (SECOND, None):
        fields = {"model": "tiny", "input": items, "max_output_tokens": MAX_TOKENS}
        if stream:
            # Raw events: the SDK's stream helper wants response.completed, and a response cut at
            # max_output_tokens ends with response.incomplete (as OpenAI's does).
            events = [event async for event in await client.responses.create(**fields, stream=True)]
            assert events[-1].type in ("response.completed", "response.incomplete")
            response = events[-1].response
        else:
            response = await client.responses.create(**fields)
        finishes.append(response.status)
        # Codex sends every output item back, then the next user message.
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items.append({"role": "user", "content": next_turn})
    return finishes


async def messages(gateway: GatewayHandle, key: str, stream: bool) -> list[str]:
    client = anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=key, max_retries=0, http_client=_http())
    history: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    finishes = []
    for next_turn in (SECOND, None):
        fields = {"model": "tiny", "max_tokens": MAX_TOKENS, "messages": history}
        if stream:
            async with client.messages.stream(**fields) as events:
                message = await events.get_final_message()
        else:
            message = await client.messages.create(**fields)
        finishes.append(message.stop_reason)
        blocks = [block.model_dump(exclude_none=True) for block in message.content]
        history += [{"role": "assistant", "content": blocks}, {"role": "user", "content": next_turn}]
    return finishes


async def gemini(gateway: GatewayHandle, key: str, stream: bool) -> list[str]:
    options = types.HttpOptions(base_url=gateway.base_url, httpx_async_client=_http())
    models = genai.Client(api_key=key, http_options=options).aio.models
    contents: list[types.Content] = [types.Content(role="user", parts=[types.Part(text=FIRST)])]
    config = types.GenerateContentConfig(max_output_tokens=MAX_TOKENS)
    finishes = []
    for next_turn in (SECOND, None):
        if stream:
            chunks = [
                chunk
                async for chunk in await models.generate_content_stream(model="tiny", contents=contents, config=config)
            ]
            parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts or []]
            finish = chunks[-1].candidates[0].finish_reason
        else:
            response = await models.generate_content(model="tiny", contents=contents, config=config)
            parts, finish = response.candidates[0].content.parts, response.candidates[0].finish_reason
        finishes.append(finish.value)
        # Gemini CLI sends the model's parts back as they came (a stream's chunks joined).
        contents += [
            types.Content(role="model", parts=parts),
            types.Content(role="user", parts=[types.Part(text=next_turn)]),
        ]
    return finishes


CONVERSATIONS: dict[str, Conversation] = {"chat": chat, "responses": responses, "anthropic": messages, "gemini": gemini}


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
@pytest.mark.parametrize("dialect", CONVERSATIONS)
async def test_two_turns_of_the_tiny_model_are_recorded_consistently_and_extend(gateway, dialect, stream):
    key = gateway.open_session(task_id=f"tiny {dialect}")
    finishes = await CONVERSATIONS[dialect](gateway, key, stream)
    first, second = gateway.records(key)
    for record, finish in zip((first, second), finishes):
        sampled = list(record.sampled_token_ids)
        assert 1 <= len(sampled) <= MAX_TOKENS and len(record.sampled_logprobs) == len(sampled)
        assert all(math.isfinite(logprob) and logprob <= 0 for logprob in record.sampled_logprobs)
        assert record.stream == stream and not record.aborted and not record.error
        assert record.finish_reason == FINISHES[dialect][finish]
        # The model stops on its own only by sampling its end-of-turn token; the length limit only at the limit.
        if record.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            assert len(sampled) == MAX_TOKENS
        assert record.usage.completion_tokens == len(sampled)
    previous = list(first.prompt_token_ids) + list(first.sampled_token_ids)
    assert list(second.prompt_token_ids[: len(previous)]) == previous
    assert second.extends_call_id == first.call_id
