"""The real `google-genai` SDK against a running gateway (scripted engine): the Gemini routes.

generateContent and streamGenerateContent (`alt=sse`) on `/v1` and `/v1beta`, function-calling loops
through the SDK's own chat (which keeps a streamed answer as one content per chunk), token faithfulness
over ten tool turns, and bad input in Google's error shape. One gateway serves the module; each test
opens its own session, so `records()` holds only its calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx2
import pytest
from google import genai
from google.genai import errors, types

from polar.testing.gateway import GatewayHandle, running_gateway
from polar.v1 import common_pb2
from tests.helpers.gateway_options import GatewayOptions

pytestmark = pytest.mark.anyio

MODEL = "polar-policy"
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STEP_CALL = '<tool_call>\n{"name": "step", "arguments": {"n": 1, "opts": {"deep": [true, 2.5]}}}\n</tool_call>'
SCRIPT = {
    "cycle": True,
    "rules": [
        {"prompt_regex": r"You are terse\.", "text": "SYS-OK"},
        {"prompt_regex": r'<tool_response>\n\{"output": "18C"\}', "text": "<think>Got it.</think>It is 18C."},
        {"prompt_regex": "weather in Paris", "text": f"<think>\nI should check.\n</think>\n\n{WEATHER_CALL}"},
        {"prompt_regex": "step 9 done", "text": "All ten steps are done."},
        {"prompt_regex": "ten steps", "text": f"<think>Next step.</think>Stepping.\n{STEP_CALL}"},
        {"prompt_regex": "stop here", "text": "one two END three"},
    ],
    "outputs": [{"text": "Hello from Polar."}],
}
WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="Current weather of a city",
    parameters=types.Schema(type="OBJECT", properties={"city": types.Schema(type="STRING")}, required=["city"]),
)
STEP = types.FunctionDeclaration(name="step", description="Do one step", parameters_json_schema={"type": "object"})
HI = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


# HTTP clients made by this module's tests: the `gateway` fixture closes them after its last test.
CLIENTS: list[httpx2.AsyncClient] = []


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    return GatewayOptions(SCRIPT, clients=CLIENTS)


class Session:
    """One gateway session driven by the real SDK, with the URLs it requested."""

    def __init__(self, gateway: GatewayHandle, api_version: str = "v1beta") -> None:
        self.gateway = gateway
        self.key = gateway.open_session(task_id="gemini")
        self.urls: list[str] = []

        async def remember(request: httpx2.Request) -> None:
            self.urls.append(str(request.url))

        http = httpx2.AsyncClient(event_hooks={"request": [remember]})
        CLIENTS.append(http)
        # Gemini CLI's GOOGLE_GEMINI_BASE_URL is the gateway's root; the SDK adds the API version.
        options = types.HttpOptions(base_url=gateway.base_url, api_version=api_version, httpx_async_client=http)
        self.client = genai.Client(api_key=self.key, http_options=options)

    def records(self) -> list[common_pb2.CallRecord]:
        return self.gateway.records(self.key)

    async def generate(self, contents: Any, *, stream: bool = False, **config: Any) -> types.GenerateContentResponse:
        """One call; a stream is folded into one response (its parts in order, the last chunk's finish)."""
        settings = types.GenerateContentConfig(**config) if config else None
        models = self.client.aio.models
        if not stream:
            return await models.generate_content(model=MODEL, contents=contents, config=settings)
        responses = await models.generate_content_stream(model=MODEL, contents=contents, config=settings)
        chunks = [chunk async for chunk in responses]
        parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
        folded = chunks[-1].model_copy(deep=True)
        folded.candidates[0].content.parts = parts
        return folded


def text_of(response: types.GenerateContentResponse) -> str:
    return "".join(part.text for part in response.candidates[0].content.parts if part.text and not part.thought)


def thoughts_of(response: types.GenerateContentResponse) -> str:
    return "".join(part.text for part in response.candidates[0].content.parts if part.text and part.thought)


def assert_extends(records: list[common_pb2.CallRecord]) -> None:
    """Each call's prompt starts with the previous call's prompt + sampled ids."""
    for before, after in zip(records, records[1:]):
        previous = list(before.prompt_token_ids) + list(before.sampled_token_ids)
        assert list(after.prompt_token_ids[: len(previous)]) == previous
        assert after.extends_call_id == before.call_id


@pytest.mark.parametrize("api_version", ["v1", "v1beta"])
@pytest.mark.parametrize("stream", [False, True])
async def test_generate_content(gateway, stream, api_version):
    session = Session(gateway, api_version)
    response = await session.generate("Say hello.", stream=stream)
    assert text_of(response) == "Hello from Polar."
    assert response.candidates[0].finish_reason == types.FinishReason.STOP
    assert response.model_version == MODEL
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    assert session.urls == [f"{gateway.base_url}/{api_version}/models/{MODEL}:{method}"]
    [record] = session.records()
    assert record.dialect == common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT and record.model == MODEL
    usage = response.usage_metadata
    assert usage.prompt_token_count == len(record.prompt_token_ids)
    assert usage.candidates_token_count == len(record.sampled_token_ids)
    assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count


async def test_system_instruction_and_sampling_reach_the_model(gateway):
    session = Session(gateway)
    response = await session.generate(
        "Hi.", system_instruction="You are terse.", temperature=0, top_p=1, max_output_tokens=32000, seed=3
    )
    assert text_of(response) == "SYS-OK"


@pytest.mark.parametrize("api_version", ["v1", "v1beta"])
async def test_count_tokens_is_the_prompt_a_call_gets(gateway, api_version):
    session = Session(gateway, api_version)
    counted = await session.client.aio.models.count_tokens(model=MODEL, contents="Say hello.")
    assert session.urls == [f"{gateway.base_url}/{api_version}/models/{MODEL}:countTokens"]
    response = await session.generate("Say hello.")
    assert counted.total_tokens == response.usage_metadata.prompt_token_count > 0
    assert len(session.records()) == 1  # counting generates nothing and records nothing


async def test_stop_sequences(gateway):
    session = Session(gateway)
    response = await session.generate("Count, stop here.", stop_sequences=["END"])
    assert text_of(response) == "one two"
    assert response.candidates[0].finish_reason == types.FinishReason.STOP


async def test_a_json_array_stream_without_alt_sse(gateway):
    async with httpx2.AsyncClient() as client:
        url = f"{gateway.base_url}/v1beta/models/{MODEL}:streamGenerateContent"
        response = await client.post(url, json=HI, headers={"x-goog-api-key": gateway.open_session()})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    chunks = [types.GenerateContentResponse.model_validate(chunk) for chunk in response.json()]
    assert "".join(part.text for chunk in chunks for part in chunk.candidates[0].content.parts) == "Hello from Polar."
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP


def chat_config(tools: list[types.FunctionDeclaration], *, thoughts: bool) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=tools)],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        thinking_config=types.ThinkingConfig(include_thoughts=thoughts),
    )


async def send(chat: Any, message: Any, *, stream: bool) -> list[types.Part]:
    """One chat turn; the model's parts, in order (a streamed turn's across its chunks)."""
    if not stream:
        return list((await chat.send_message(message)).candidates[0].content.parts)
    chunks = [chunk async for chunk in await chat.send_message_stream(message)]
    return [part for chunk in chunks for part in chunk.candidates[0].content.parts]


@pytest.mark.parametrize("thoughts", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_function_calling_loop(gateway, stream, thoughts):
    session = Session(gateway)
    chat = session.client.aio.chats.create(model=MODEL, config=chat_config([WEATHER], thoughts=thoughts))
    parts = await send(chat, "What is the weather in Paris?", stream=stream)
    [call] = [part.function_call for part in parts if part.function_call]
    assert (call.name, call.args) == ("get_weather", {"city": "Paris"}) and call.id
    shown = "".join(part.text for part in parts if part.thought)
    assert shown == ("I should check." if thoughts else "")

    answer = types.Part.from_function_response(name=call.name, response={"output": "18C"})
    answer.function_response.id = call.id
    final = await send(chat, answer, stream=stream)
    assert "".join(part.text for part in final if part.text and not part.thought) == "It is 18C."
    records = session.records()
    assert len(records) == 2
    assert_extends(records)


async def test_ten_turn_tool_conversation_is_token_faithful(gateway):
    session = Session(gateway)
    chat = session.client.aio.chats.create(model=MODEL, config=chat_config([STEP], thoughts=True))
    message: Any = "Do ten steps."
    for turn in range(10):
        # Alternate: a streamed turn, echoed by the chat as one content per chunk, must match as well.
        parts = await send(chat, message, stream=turn % 2 == 1)
        text = "".join(part.text for part in parts if part.text and not part.thought)
        if turn == 9:
            assert text == "All ten steps are done."
            break
        [call] = [part.function_call for part in parts if part.function_call]
        assert text == "Stepping." and call.args == {"n": 1, "opts": {"deep": [True, 2.5]}}
        # No id on the answer: the gateway matches it to the call by name, as for Gemini CLI's older turns.
        message = types.Part.from_function_response(name="step", response={"output": f"step {turn + 1} done"})
    records = session.records()
    assert len(records) == 10
    assert_extends(records)


async def post(gateway: GatewayHandle, body: Any, key: str | None, method: str = "generateContent") -> httpx2.Response:
    headers = {} if key is None else {"x-goog-api-key": key}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx2.AsyncClient() as client:
        url = f"{gateway.base_url}/v1beta/models/{MODEL}:{method}"
        return await client.post(url, content=content, headers=headers | {"content-type": "application/json"})


def google_error(response: httpx2.Response, code: int, status: str) -> dict[str, Any]:
    body = response.json()
    assert response.status_code == code and set(body) == {"error"}
    assert (body["error"]["code"], body["error"]["status"]) == (code, status)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", None),
        ({"contents": []}, "contents"),
        (
            {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]},
            "contents[0].parts[0].inlineData",
        ),
        (HI | {"tools": [{"googleSearch": {}}]}, "tools[0].googleSearch"),
        (HI | {"generationConfig": {"temperature": "hot"}}, "generationConfig.temperature"),
        (HI | {"toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}, "toolConfig.functionCallingConfig.mode"),
    ],
)
@pytest.mark.parametrize("method", ["generateContent", "streamGenerateContent?alt=sse"])
async def test_bad_requests_are_400_invalid_argument(gateway, body, field, method):
    response = await post(gateway, body, gateway.open_session(), method)
    error = google_error(response, 400, "INVALID_ARGUMENT")
    if field is not None:
        assert error["details"][0]["fieldViolations"][0]["field"] == field


async def test_images_through_the_sdk_are_a_client_error(gateway):
    session = Session(gateway)
    image = types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")
    with pytest.raises(errors.ClientError) as caught:
        await session.generate(["What is this?", image])
    assert (caught.value.code, caught.value.status) == (400, "INVALID_ARGUMENT")
    assert "text-only" in caught.value.message


@pytest.mark.parametrize("key", [None, "not-a-session"])
async def test_a_bad_key_is_401_unauthenticated(gateway, key):
    google_error(await post(gateway, HI, key), 401, "UNAUTHENTICATED")


async def test_a_closed_session_is_an_sdk_client_error(gateway):
    session = Session(gateway)
    gateway.close_session(session.key)
    for stream in (False, True):
        with pytest.raises(errors.ClientError) as caught:
            await session.generate("hi", stream=stream)
        assert (caught.value.code, caught.value.status) == (401, "UNAUTHENTICATED")


async def test_a_prompt_over_the_context_reads_like_the_api():
    async with running_gateway({"context_length": 64, "outputs": [{"text": "x"}]}) as small:
        session = Session(small)
        for stream in (False, True):
            with pytest.raises(errors.ClientError) as caught:
                await session.generate("word " * 200, stream=stream)
            assert (caught.value.code, caught.value.status) == (400, "INVALID_ARGUMENT")
            assert re.fullmatch(
                r"The input token count \(\d+\) exceeds the maximum number of tokens allowed \(63\)\.",
                caught.value.message,
            )


async def test_inference_down_is_503_unavailable():
    async with running_gateway({"outputs": [{"text": "x"}]}) as lonely:
        await lonely.stop_inference()
        session = Session(lonely)
        with pytest.raises(errors.ServerError) as caught:
            await session.generate("hi")
        assert (caught.value.code, caught.value.status) == (503, "UNAVAILABLE")
