"""A constraint never hangs a stream: a grammar that cannot be completed within the cap ends as a
length finish, and a grammar that reaches a dead end or fails mid-stream ends its own stream with an
error at once, while the other sequences of the same batch go on. In the engine (tiny, in process)
and through each dialect's official SDK, streaming.

The grammar library (llguidance's mask executor) is the faked edge for the failures: it gives real
masks until a matcher has had a few, then no allowed token at all, or an exception.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
from collections import Counter

import anthropic
import httpx2
import llguidance
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from polar.inference import constraints
from polar.inference.constraints import OutputConstraint
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.engines.base import FinishReason, GenerationEnd, GenerationRequest, SamplingConfig, TokenChunk
from tests.helpers.gateway_options import GatewayOptions

pytestmark = pytest.mark.anyio

PROMPT = (1, 504, 3570, 28, 9174, 30, 2, 198, 1, 520, 9531, 198)
# At least 16 strings: no reply of 12 tokens or fewer completes it, whatever the model samples.
STORY = {
    "type": "object",
    "properties": {"story": {"type": "array", "items": {"type": "string"}, "minItems": 16}},
    "required": ["story"],
}
FREE_STRING = OutputConstraint("json_schema", json.dumps(STORY))  # cannot end within 12 tokens
HEALTHY_MASKS = 3  # masks a matcher gets before the faked library fails it
BOUND_S = 60.0  # a stream that is not over by then hangs (on two shared cores; it takes about a second)


class FailingMasks:
    """llguidance's LLExecutor, failing each matcher after `healthy` masks once `fail` is set: every
    token refused (a dead end), or with `raises`, an exception from the library."""

    def __init__(self) -> None:
        self._real = llguidance.LLExecutor()
        self._masks: Counter[int] = Counter()  # per matcher: masks computed
        self.fail, self.raises = False, False

    def failing(self, raises: bool) -> None:
        self.fail, self.raises = True, raises
        self._masks.clear()

    def unsafe_compute_mask_ptr(self, pairs, pointer: int, row_bytes: int, rows: int) -> None:
        self._real.unsafe_compute_mask_ptr(pairs, pointer, row_bytes, rows)
        for matcher, row in pairs:
            self._masks[id(matcher)] += 1
            if self.fail and self._masks[id(matcher)] > HEALTHY_MASKS:
                if self.raises:
                    raise RuntimeError("the grammar library failed")
                ctypes.memset(pointer + row * row_bytes, 0, row_bytes)


@pytest.fixture(scope="module")
def masks():
    """The grammar library of the engine below (its grammar is made at its first constrained request)."""
    library = FailingMasks()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constraints, "LLExecutor", lambda: library)
        yield library


@pytest.fixture
def failing(masks):
    """Fail the grammar library from now on, for this test only (raises=True: with an exception)."""
    yield masks.failing
    masks.fail = False


# HTTP clients made by this module's tests: the `gateway` fixture closes them after its last test.
CLIENTS: list[httpx2.AsyncClient] = []


@pytest.fixture(scope="module")
def gateway_options(masks) -> GatewayOptions:
    """The tiny model's torch engine, served, and a gateway over it (the engine tests use the engine)."""
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", max_batch_size=4))
    return GatewayOptions(engine=engine, envoy=False, clients=CLIENTS)


def _http() -> httpx2.AsyncClient:
    client = httpx2.AsyncClient(timeout=BOUND_S)
    CLIENTS.append(client)
    return client


# -- the engine ---------------------------------------------------------------------------------------


async def generated(engine, name: str, config: SamplingConfig) -> tuple[list[int], GenerationEnd]:
    tokens, end = [], None
    async for item in engine.generate(GenerationRequest(name, PROMPT, config)):
        if isinstance(item, TokenChunk):
            tokens += item.token_ids
        else:
            end = item
    return tokens, end


async def constrained_beside_free(engine, constraint: OutputConstraint) -> list[tuple[list[int], GenerationEnd]]:
    """Two constrained streams and a free one, in one batch of the engine."""
    return await asyncio.wait_for(
        asyncio.gather(
            generated(engine, "a", SamplingConfig(max_tokens=12, seed=1, constraint=constraint)),
            generated(engine, "b", SamplingConfig(max_tokens=12, seed=2, constraint=constraint)),
            generated(engine, "free", SamplingConfig(max_tokens=12, seed=3, ignore_eos=True)),
        ),
        BOUND_S,
    )


async def test_a_grammar_that_cannot_end_within_the_cap_is_a_length_finish(gateway):
    for tokens, end in await constrained_beside_free(gateway.engine, FREE_STRING):
        assert end.finish_reason is FinishReason.LENGTH and len(tokens) == 12


@pytest.mark.parametrize("raises", [False, True], ids=["dead end", "library error"])
async def test_a_grammar_failing_mid_stream_ends_its_own_streams_with_an_error(gateway, failing, raises):
    failing(raises)
    *constrained, (free_tokens, free_end) = await constrained_beside_free(gateway.engine, FREE_STRING)
    for tokens, end in constrained:
        assert end.finish_reason is FinishReason.ERROR
        assert len(tokens) == HEALTHY_MASKS  # nothing sampled without a mask
        assert end.error.startswith("constraint: ")
        assert ("mask failed" if raises else "allows no next token") in end.error
    # The free stream of the same batch is untouched.
    assert free_end.finish_reason is FinishReason.LENGTH and len(free_tokens) == 12


# -- each dialect, streaming, through its official SDK --------------------------------------------------


NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
CAP = 6  # tokens: the constrained reply cannot be complete by then


async def chat_stream(gateway, key) -> str:
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, http_client=_http())
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=CAP,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}},
    )
    finish = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish


async def responses_stream(gateway, key) -> str:
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, http_client=_http())
    stream = await client.responses.create(
        model="tiny",
        input="Hi",
        max_output_tokens=CAP,
        stream=True,
        text={"format": {"type": "json_schema", "name": "story", "schema": STORY}},
    )
    status = None
    async for event in stream:
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            status = event.response.status
        elif event.type == "error":
            raise openai.APIError(event.message, None, body=None)
    return status


async def anthropic_stream(gateway, key) -> str:
    client = anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=key, max_retries=0, http_client=_http())
    async with client.messages.stream(
        model="tiny",
        max_tokens=CAP,
        messages=[{"role": "user", "content": "Hi"}],
        tools=[{"name": "note", "input_schema": NOTE}],
        tool_choice={"type": "any"},
    ) as stream:
        message = await stream.get_final_message()
    return message.stop_reason


async def gemini_stream(gateway, key) -> str:
    options = types.HttpOptions(base_url=gateway.base_url, httpx_async_client=_http())
    models = genai.Client(api_key=key, http_options=options).aio.models
    config = types.GenerateContentConfig(
        response_mime_type="application/json", response_json_schema=STORY, max_output_tokens=CAP
    )
    finish = None
    async for chunk in await models.generate_content_stream(model="tiny", contents="Hi", config=config):
        if chunk.candidates and chunk.candidates[0].finish_reason:
            finish = chunk.candidates[0].finish_reason.value
    return finish


STREAMS = {"chat": chat_stream, "responses": responses_stream, "anthropic": anthropic_stream, "gemini": gemini_stream}
LENGTH = {"chat": "length", "responses": "incomplete", "anthropic": "max_tokens", "gemini": "MAX_TOKENS"}
ERRORS = (openai.APIError, anthropic.APIError, genai_errors.APIError)


async def test_each_dialect_streams_a_cut_constrained_reply_as_its_length_finish(gateway):
    key = gateway.open_session(task_id="cut streams")
    finishes = await asyncio.wait_for(asyncio.gather(*(stream(gateway, key) for stream in STREAMS.values())), BOUND_S)
    assert dict(zip(STREAMS, finishes)) == LENGTH
    assert all(record.truncated for record in gateway.records(key))


async def test_each_dialect_ends_a_stream_whose_grammar_fails_with_its_error(gateway, failing):
    failing(False)
    key = gateway.open_session(task_id="dead ends")
    for name, stream in STREAMS.items():
        with pytest.raises(ERRORS) as failure:
            await asyncio.wait_for(stream(gateway, key), BOUND_S)
        assert "allows no next token" in str(failure.value), name
    records = gateway.records(key)
    assert len(records) == len(STREAMS)
    assert all("allows no next token" in record.error and not record.truncated for record in records)
