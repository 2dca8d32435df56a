"""A prompt longer than the served model's context, in each dialect, as its official SDK sees it.

The error is made where the gateway makes it (`gateway.core.context_room`), turned into the dialect's
status and body, and served to the real SDK client over an in-memory transport; the SDK must raise its
own typed error for it, streamed calls included (the refusal comes before any stream opens), and the
message must carry the numbers in the API's own words, which harnesses read to compact their history.
"""

from __future__ import annotations

import re
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest
from anthropic.types.shared import ErrorResponse
from google import genai
from google.genai import errors
from google.genai import types as genai_types

from gateway.core import context_room
from gateway.dialects import anthropic as anthropic_dialect
from gateway.dialects import gemini as gemini_dialect
from gateway.dialects import openai_chat, openai_responses
from gateway.dialects.base import ContextLengthError, ErrorKind
from polar.inference.models import TINY_CONTEXT_LENGTH
from polar.trajectory import read_session

PROMPT = 32_819  # Claude Code's first call, started in a git checkout
CONTEXT = 32_768  # what the tiny model held then
SESSIONS = Path(__file__).resolve().parent.parent / "fixtures" / "sessions"


def refusal() -> ContextLengthError:
    with pytest.raises(ContextLengthError) as caught:
        context_room(PROMPT, CONTEXT)
    assert caught.value.kind is ErrorKind.CONTEXT_LENGTH
    return caught.value


def transport(dialect) -> httpx2.Client:
    """An HTTP client whose every request is answered with the dialect's body for the refusal."""
    status, body = dialect.error_response(refusal())
    return httpx2.Client(transport=httpx2.MockTransport(lambda request: httpx2.Response(status, json=body)))


@pytest.mark.parametrize("harness", ["claude-code", "codex", "gemini-cli", "pi", "qwen-code"])
def test_the_default_model_holds_every_harness_s_first_call_with_room_to_spare(harness):
    calls, _ = read_session(SESSIONS / f"{harness}.json.zst")
    first = len(calls[0].prompt_ids)  # recorded with the tiny model's tokenizer
    # Half the context is left for the conversation, even for Claude Code started in a git checkout.
    assert first <= PROMPT < TINY_CONTEXT_LENGTH // 2
    context_room(first, TINY_CONTEXT_LENGTH)


def test_a_prompt_that_fills_the_context_leaves_no_room_and_one_token_less_fits():
    assert context_room(CONTEXT - 1, CONTEXT) == 1
    with pytest.raises(ContextLengthError):
        context_room(CONTEXT, CONTEXT)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_raises_bad_request_prompt_is_too_long(stream):
    status, body = anthropic_dialect.DIALECT.error_response(refusal())
    assert status == 400
    ErrorResponse.model_validate(body)
    client = anthropic.Anthropic(
        api_key="k", base_url="http://gateway", max_retries=0, http_client=transport(anthropic_dialect.DIALECT)
    )
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        if stream:
            with client.messages.stream(model="tiny", max_tokens=1024, messages=messages) as events:
                events.get_final_message()
        else:
            client.messages.create(model="tiny", max_tokens=1024, messages=messages)
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    # The API's wording, numbers included: Claude Code takes the gap between them to compact.
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", caught.value.body["error"]["message"])
    assert found is not None and (int(found[1]), int(found[2])) == (PROMPT, CONTEXT - 1)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_sdk_raises_bad_request_context_length_exceeded(stream):
    client = openai.OpenAI(
        base_url="http://gateway/v1", api_key="k", max_retries=0, http_client=transport(openai_chat.DIALECT)
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=stream)
    error = caught.value
    assert (error.status_code, error.code, error.type, error.param) == (
        400,
        "context_length_exceeded",
        "invalid_request_error",
        "messages",
    )
    assert error.body["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, your messages resulted in "
        f"{PROMPT} tokens. Please reduce the length of the messages."
    )


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_sdk_raises_bad_request_context_length_exceeded(stream):
    client = openai.OpenAI(
        base_url="http://gateway/v1", api_key="k", max_retries=0, http_client=transport(openai_responses.DIALECT)
    )
    with pytest.raises(openai.BadRequestError) as caught:
        if stream:
            with client.responses.stream(model="tiny", input="hi") as events:
                list(events)
        else:
            client.responses.create(model="tiny", input="hi")
    error = caught.value
    assert (error.status_code, error.code, error.type, error.param) == (
        400,
        "context_length_exceeded",
        "invalid_request_error",
        "input",
    )
    message = error.body["message"]  # the SDK's own message puts "Error code: 400 - " before it
    assert message.startswith("Your input exceeds the context window of this model")
    assert str(PROMPT) in message and str(CONTEXT) in message


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_sdk_raises_client_error_invalid_argument(stream):
    client = genai.Client(
        api_key="k",
        http_options=genai_types.HttpOptions(
            base_url="http://gateway", api_version="v1beta", httpx_client=transport(gemini_dialect.DIALECT)
        ),
    )
    with pytest.raises(errors.ClientError) as caught:
        if stream:
            list(client.models.generate_content_stream(model="tiny", contents="hi"))
        else:
            client.models.generate_content(model="tiny", contents="hi")
    assert (caught.value.code, caught.value.status) == (400, "INVALID_ARGUMENT")
    assert caught.value.message == (
        f"The input token count ({PROMPT}) exceeds the maximum number of tokens allowed ({CONTEXT - 1})."
    )
