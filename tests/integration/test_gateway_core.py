"""The gateway core over real servers: a scripted inference server, Envoy, the gateway's HTTP app and its
GatewayService on free loopback ports (polar.testing.gateway.running_gateway).

Core behaviour is driven through `FakeDialect` (tests/integration/gateway_fakes.py) on the chat
route, so these tests fail only for the core; what every dialect shares (401, 400, context errors,
overloaded) is checked through the real dialect modules.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.conversation import Conversation, Message, ToolChoice
from gateway.dialects import get_dialect
from gateway.dialects.base import ErrorKind, GatewayError
from polar.app.stack import gateway_spec
from polar.app.stack import running as running_service
from polar.config import GatewayConfig, InferenceConfig
from polar.envoy import admin_get as envoy_admin_get
from polar.sampling_policy import SamplingPolicy
from polar.testing.gateway import running_gateway
from polar.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.gateway_fakes import FakeDialect, read_sse
from tests.helpers.gateway_options import GatewayOptions

pytestmark = pytest.mark.anyio

SLOW_TOKENS = 60
RAMBLE_TOKENS = 40
CALL_A = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "lookup", "arguments": {"q": "b"}}\n</tool_call>'
HI = [{"role": "user", "content": "hi"}]
GEMINI_HI = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
CLAMP_CONTEXT = 512
FAKE_SCRIPT = {
    "cycle": True,
    "rules": [
        {"prompt_regex": "SLOWSTREAM", "token_ids": [905] * SLOW_TOKENS, "delay_seconds": 0.05},
        {"prompt_regex": "SLOWSTART", "token_ids": [905, 905], "delay_seconds": 2.0},
        {"prompt_regex": "EMIT_STOP", "text": "alpha beta STOP gamma delta"},
        {"prompt_regex": "FORCED", "text": 'lookup", "arguments": {"q": "x"}}\n</tool_call>'},
        {"prompt_regex": "LOGPROBS", "token_ids": [19556, 905, 2], "logprobs": [-0.5, -1.25, -0.75]},
        {"prompt_regex": "TURN3", "text": "All done."},
        {"prompt_regex": "TURN2", "text": "<think>one more</think>\n" + CALL_B},
        {"prompt_regex": "TURN1", "text": CALL_A},
        {"prompt_regex": "CONCURRENT", "text": "ok", "delay_seconds": 0.01},
        {"prompt_regex": "RAMBLE", "token_ids": [905] * RAMBLE_TOKENS},  # never stops by itself
    ],
    "outputs": [{"text": "Fine."}],
}
REAL_SCRIPT = {
    "context_length": CLAMP_CONTEXT,
    "cycle": True,
    "rules": [{"prompt_regex": "CLAMP", "token_ids": [905] * CLAMP_CONTEXT}],
    "outputs": [{"text": "Fine."}],
}
# Every dialect route, with a body its dialect accepts.
ROUTES = [
    ("openai_chat", "/v1/chat/completions", {"model": "m", "messages": HI}),
    ("openai_responses", "/v1/responses", {"model": "m", "input": "hi"}),
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 10, "messages": HI}),
    ("anthropic", "/v1/messages?beta=true", {"model": "m", "max_tokens": 10, "messages": HI}),
    ("anthropic", "/v1/messages/count_tokens", {"model": "m", "messages": HI}),
    ("gemini", "/v1beta/models/m:generateContent", GEMINI_HI),
    ("gemini", "/v1/models/m:streamGenerateContent?alt=sse", GEMINI_HI),
]


@pytest.fixture(scope="module")
async def gw():
    async with running_gateway(FAKE_SCRIPT, dialects={"openai_chat": FakeDialect()}) as handle:
        yield handle


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    """`gateway`: the real dialect modules over REAL_SCRIPT."""
    return GatewayOptions(REAL_SCRIPT)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


async def _chat(http, gw, key: str, **body) -> tuple[int, object]:
    async with http.post(gw.base_url + "/v1/chat/completions", json=body, headers={"x-api-key": key}) as response:
        text = await response.text()
        return response.status, read_sse(text) if body.get("stream") else json.loads(text)


def _without_messages(body):
    """The error's shape: every field but the human-readable texts."""
    if isinstance(body, dict):
        return {k: _without_messages(v) for k, v in body.items() if k not in ("message", "param")}
    return body


# ------------------------------------------------------------------------------------------ auth


async def test_head_and_get_root_answer_without_a_key(gateway, http):
    async with http.head(gateway.base_url + "/") as response:
        assert response.status == 200
    async with http.get(gateway.base_url + "/") as response:
        assert response.status == 200 and (await response.json())["status"] == "ok"


@pytest.mark.parametrize("dialect, path, body", ROUTES)
async def test_unknown_and_closed_keys_get_401_in_the_dialects_shape(gateway, http, dialect, path, body):
    closed = gateway.open_session()
    gateway.close_session(closed)
    status, expected = get_dialect(dialect).error_response(GatewayError(ErrorKind.AUTHENTICATION, ""))
    for headers in ({"Authorization": "Bearer polar-unknown"}, {"x-goog-api-key": closed}, {}):
        async with http.post(gateway.base_url + path, json=body, headers=headers) as response:
            assert response.status == status == 401
            assert _without_messages(await response.json()) == _without_messages(expected)
    assert gateway.records(closed) == []


async def _status_without_sending_the_body(base_url: str, path: str, key_header: str) -> bytes:
    """The status of a POST whose headers announce a 50 MB body that never comes."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{key_header}"
            f"Content-Length: {50 * 1024 * 1024}\r\n\r\n".encode()
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
        headers_and_body = await asyncio.wait_for(reader.read(4096), timeout=10)
        return status_line.split()[1] + b" " + headers_and_body.split(b"\r\n\r\n", 1)[-1]
    finally:
        writer.close()


@pytest.mark.parametrize("dialect, path, body", ROUTES)
async def test_a_keyless_request_is_refused_by_envoy_before_its_body_is_read(gateway, dialect, path, body):
    """No key in any form: the 401 comes from Envoy at once, in the dialect's shape, without the body."""
    answer = await _status_without_sending_the_body(gateway.base_url, path, "")
    status, payload = answer.split(b" ", 1)
    _, expected = get_dialect(dialect).error_response(GatewayError(ErrorKind.AUTHENTICATION, ""))
    assert status == b"401"
    reply = json.loads(payload)
    assert _without_messages(reply) == _without_messages(expected)
    assert "no API key" in json.dumps(reply)


async def test_a_request_with_a_wrong_key_is_refused_by_the_gateway_before_its_body_is_read():
    async with running_gateway(REAL_SCRIPT, envoy=False) as gateway:
        answer = await _status_without_sending_the_body(
            gateway.base_url, "/v1/messages", "x-api-key: polar-unknown\r\n"
        )
    assert answer.startswith(b"401 ")


@pytest.mark.parametrize("dialect, path, body", ROUTES)
async def test_malformed_and_non_object_bodies_are_400_in_the_dialects_shape(gateway, http, dialect, path, body):
    status, expected = get_dialect(dialect).error_response(GatewayError(ErrorKind.INVALID_REQUEST, ""))
    key = gateway.open_session()
    for data in (
        b'{"model": ',
        b"[1, 2]",
        b"\xff\xfe",
        b'{"model": "\\ud800", "messages": [{"role": "user", "content": "\\udc00"}]}',
    ):
        async with http.post(gateway.base_url + path, data=data, headers={"x-api-key": key}) as response:
            assert response.status == status == 400
            assert _without_messages(await response.json()) == _without_messages(expected)


async def test_every_key_header_is_accepted(gateway, http):
    _, path, body = ROUTES[0]
    key = gateway.open_session()
    for headers, query in (({"Authorization": f"Bearer {key}"}, ""), ({"x-api-key": key}, ""), ({}, f"?key={key}")):
        async with http.post(gateway.base_url + path + query, json=body, headers=headers) as response:
            assert response.status == 200
    assert len(gateway.records(key)) == 3


async def test_models_lists_the_served_model_in_openai_or_anthropic_shape(gateway, http):
    key = gateway.open_session()
    async with http.get(gateway.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as response:
        listed = (await response.json())["data"][0]
        context = {"max_model_len": CLAMP_CONTEXT}  # the served context length, under vLLM's name for it
        assert listed == {"id": "scripted", "object": "model", "created": 0, "owned_by": "polar", **context}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    async with http.get(gateway.base_url + "/v1/models", headers=headers) as response:
        body = await response.json()
        assert body["data"][0]["type"] == "model" and body["has_more"] is False
    async with http.get(gateway.base_url + "/v1/models") as response:
        assert response.status == 401


async def test_unknown_routes_answer_json_404(gateway, http):
    key = {"x-api-key": "polar-unknown"}  # a keyless request is Envoy's 401
    async with http.post(gateway.base_url + "/v1beta/models/m:embedContent", json={}, headers=key) as response:
        assert response.status == 404 and (await response.json())["error"]["type"] == "not_found_error"
    async with http.get(gateway.base_url + "/nowhere", headers=key) as response:
        assert response.status == 404 and "error" in await response.json()


# ------------------------------------------------------------------------------------- recording


async def test_a_record_holds_exactly_what_the_engine_produced(gw, http):
    key = gw.open_session()
    body = {"model": "m", "messages": [_user("LOGPROBS")]}
    status, reply = await _chat(http, gw, key, **body)
    assert status == 200 and reply["content"] == "Hello world" and reply["finish"] == "stop"

    [record] = gw.records(key)
    prompt = gw.running.gateway.chat_format.render_prompt(Conversation((Message("user", "LOGPROBS"),)))
    assert list(record.prompt_token_ids) == prompt
    assert list(record.sampled_token_ids) == [19556, 905, 2]
    assert list(record.sampled_logprobs) == [-0.5, -1.25, -0.75]
    assert record.finish_reason == common_pb2.FINISH_REASON_STOP and not record.aborted and not record.error
    assert record.call_id == "c0001" and record.dialect == common_pb2.DIALECT_OPENAI_CHAT and record.model == "m"
    assert json.loads(record.request_body) == body and json.loads(record.response_body) == reply
    assert (record.usage.prompt_tokens, record.usage.completion_tokens) == (len(prompt), 3)
    assert reply["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3}
    assert record.timings.received_unix_ns > 0 and record.timings.total_seconds > 0


async def test_a_streamed_call_records_the_aggregated_body_and_streams_each_event(gw, http):
    key = gw.open_session()
    status, events = await _chat(http, gw, key, stream=True, messages=[_user("TURN2")])
    assert status == 200 and events[0] == {"type": "start"} and events[-1] == "[DONE]"
    kinds = [event["type"] for event in events[1:-2]]
    assert kinds[0] == "ReasoningDelta" and kinds[-3:] == ["ToolCallStart", "ToolCallArgumentsDelta", "ToolCallEnd"]
    [record] = gw.records(key)
    final = events[-2]
    assert record.stream and json.loads(record.response_body) == {k: v for k, v in final.items() if k != "type"}
    assert final["finish"] == "tool_calls" and final["reasoning"] == "one more"


async def test_prompts_extend_the_previous_prompt_and_sample_token_for_token(gw, http):
    key = gw.open_session()
    messages = [{"role": "system", "content": "You help."}, _user("TURN1 go")]
    tools = [{"name": "lookup"}]
    for _step, result in enumerate(("TURN2 result", "TURN3 result", None)):
        status, reply = await _chat(http, gw, key, messages=messages, tools=tools)
        assert status == 200
        if result is None:
            assert reply["content"] == "All done."
            break
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in reply["tool_calls"]]
        messages.append({"role": "assistant", "content": reply["content"], "tool_calls": calls})
        messages.append({"role": "tool", "content": result})

    records = gw.records(key)
    assert len(records) == 3 and records[0].extends_call_id == ""
    for previous, record in zip(records, records[1:]):
        before = list(previous.prompt_token_ids) + list(previous.sampled_token_ids)
        assert list(record.prompt_token_ids[: len(before)]) == before
        assert record.extends_call_id == previous.call_id


async def test_a_client_that_leaves_mid_stream_leaves_an_aborted_record_with_its_tokens(gw, http):
    key = gw.open_session()
    body = {"stream": True, "messages": [_user("SLOWSTREAM")]}
    response = await http.post(gw.base_url + "/v1/chat/completions", json=body, headers={"x-api-key": key})
    assert response.status == 200
    received = b""
    while received.count(b"\n\n") < 4:  # the start event and a few tokens
        received += await response.content.readany()
    response.close()

    for _ in range(100):
        if gw.records(key):
            break
        await asyncio.sleep(0.05)
    [record] = gw.records(key)
    assert record.aborted and record.finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert 3 <= len(record.sampled_token_ids) < SLOW_TOKENS
    assert len(record.sampled_logprobs) == len(record.sampled_token_ids)
    assert gw.running.store.calls_in_flight() == 0


async def test_a_client_that_leaves_before_an_unstreamed_reply_cancels_the_generation(gw, http):
    key = gw.open_session()
    body = {"messages": [_user("SLOWSTREAM")]}
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            http.post(gw.base_url + "/v1/chat/completions", json=body, headers={"x-api-key": key}), 0.5
        )
    for _ in range(100):
        if gw.records(key):
            break
        await asyncio.sleep(0.05)
    [record] = gw.records(key)
    assert record.aborted and 1 <= len(record.sampled_token_ids) < SLOW_TOKENS


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_before_the_first_token_is_recorded_without_an_error(gw, http, caplog, stream):
    key = gw.open_session()
    body = {"messages": [_user("SLOWSTART")], "stream": stream}
    request = asyncio.ensure_future(
        http.post(gw.base_url + "/v1/chat/completions", json=body, headers={"x-api-key": key})
    )
    # Gone once the gateway has the call in flight, before the engine's first token (2 s away), so
    # before a stream could open; the gateway finds the client gone when that token comes.
    for _ in range(200):
        if gw.running.store.calls_in_flight():
            break
        await asyncio.sleep(0.05)
    assert gw.running.store.calls_in_flight() == 1 and not request.done()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    for _ in range(100):
        if gw.records(key):
            break
        await asyncio.sleep(0.05)
    [record] = gw.records(key)
    assert record.aborted and not record.error
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_concurrent_calls_in_one_session_are_all_recorded(gw, http):
    key = gw.open_session()
    replies = await asyncio.gather(*(_chat(http, gw, key, messages=[_user(f"CONCURRENT {i}")]) for i in range(8)))
    assert all(status == 200 for status, _ in replies)
    records = gw.records(key)
    assert [r.call_id for r in records] == [f"c{i:04d}" for i in range(1, 9)]
    assert all(list(r.sampled_token_ids) for r in records)


# ---------------------------------------------------------------------------- sampling controls


async def test_a_stop_string_ends_the_output_and_keeps_the_tokens_that_made_it(gw, http):
    key = gw.open_session()
    status, reply = await _chat(http, gw, key, messages=[_user("EMIT_STOP")], stop=["STOP"])
    assert status == 200 and reply["content"] == "alpha beta"
    assert (reply["finish"], reply["stop_sequence"]) == ("stop_sequence", "STOP")
    status, events = await _chat(http, gw, key, stream=True, messages=[_user("EMIT_STOP")], stop=["STOP"])
    streamed = "".join(e["text"] for e in events if isinstance(e, dict) and e["type"] == "TextDelta")
    assert streamed == "alpha beta"

    tokenizer = gw.running.gateway.tokenizer
    for record in gw.records(key):
        assert tokenizer.decode(list(record.sampled_token_ids)).rstrip().endswith("STOP")
        assert record.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_forced_tool_choice_is_recorded_as_prompt_and_parsed_with_the_sample(gw, http):
    key = gw.open_session()
    body = {"messages": [_user("FORCED")], "tools": [{"name": "lookup"}], "tool_choice": "required"}
    status, reply = await _chat(http, gw, key, **body)
    assert status == 200 and reply["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in reply["tool_calls"]] == [("lookup", {"q": "x"})]

    [record] = gw.records(key)
    chat_format = gw.running.gateway.chat_format
    forced = chat_format.encode_text(chat_format.forced_opening_text(ToolChoice.required()))
    assert record.forced_token_count == len(forced) > 0
    assert list(record.prompt_token_ids[-len(forced) :]) == forced
    assert not gw.running.gateway.tokenizer.decode(list(record.sampled_token_ids)).startswith("<tool_call>")
    assert reply["usage"]["prompt_tokens"] == len(record.prompt_token_ids)


async def test_a_prompt_over_the_context_is_a_context_error_in_the_dialects_shape(gateway, http):
    key = gateway.open_session()
    long = "word " * CLAMP_CONTEXT
    body = {"model": "m", "messages": [_user(long)]}
    async with http.post(gateway.base_url + "/v1/chat/completions", json=body, headers={"x-api-key": key}) as response:
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "context_length_exceeded"
    body = {"model": "m", "max_tokens": 10, "messages": [_user(long)]}
    async with http.post(gateway.base_url + "/v1/messages", json=body, headers={"x-api-key": key}) as response:
        assert response.status == 400 and (await response.json())["error"]["type"] == "invalid_request_error"
    # Both refusals are recorded, with the prompt and nothing sampled: what the harness sends next
    # (its compacted history) reads as a new branch of the session.
    records = gateway.records(key)
    assert [r.call_id for r in records] == ["c0001", "c0002"]
    for record in records:
        assert record.prompt_too_long and record.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert (
            not record.sampled_token_ids and len(record.prompt_token_ids) == record.usage.prompt_tokens > CLAMP_CONTEXT
        )
        assert record.error.startswith(f"the prompt is {record.usage.prompt_tokens} tokens")
    assert b"context_length_exceeded" in records[0].response_body and b"prompt is too long" in records[1].response_body


async def test_max_tokens_past_the_context_is_clamped_and_the_finish_says_so(gateway, http):
    key = gateway.open_session()
    body = {"model": "m", "max_tokens": 32000, "messages": [_user("CLAMP " + "word " * 100)]}
    async with http.post(gateway.base_url + "/v1/chat/completions", json=body, headers={"x-api-key": key}) as response:
        assert response.status == 200
        assert (await response.json())["choices"][0]["finish_reason"] == "length"
    [record] = gateway.records(key)
    assert record.finish_reason == common_pb2.FINISH_REASON_CONTEXT_LENGTH
    assert len(record.prompt_token_ids) + len(record.sampled_token_ids) == CLAMP_CONTEXT


async def test_count_tokens_renders_without_generating(gateway, http):
    key = gateway.open_session()
    _, path, body = ROUTES[4]
    async with http.post(gateway.base_url + path, json=body, headers={"x-api-key": key}) as response:
        assert response.status == 200 and (await response.json())["input_tokens"] > 0
    assert gateway.records(key) == []


# ------------------------------------------------------------------------ the task's sampling


async def test_a_task_s_policy_caps_a_harness_that_asks_no_max_tokens_and_the_record_says_truncated(gw, http):
    key = gw.open_session(sampling=SamplingPolicy(temperature=0.7, top_p=0.9, max_tokens_per_call=8))
    body = {"model": "m", "messages": [_user("RAMBLE")]}  # no max_tokens; FakeDialect asks temperature 0
    status, reply = await _chat(http, gw, key, **body)
    assert status == 200 and reply["finish"] == "length" and reply["usage"]["completion_tokens"] == 8
    # A max_tokens the harness asked for below the cap is its own: the call is cut but not truncated.
    status, reply = await _chat(http, gw, key, messages=[_user("RAMBLE again")], max_tokens=5)
    assert status == 200 and reply["finish"] == "length" and reply["usage"]["completion_tokens"] == 5

    capped, asked = gw.records(key)
    assert json.loads(capped.request_body) == body  # the request as the harness sent it
    assert len(capped.sampled_token_ids) == 8 and capped.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert capped.truncated and not asked.truncated
    assert (capped.sampling.max_tokens, asked.sampling.max_tokens) == (8, 5)
    for record in (capped, asked):
        assert record.sampling.temperature == pytest.approx(0.7) and record.sampling.top_p == pytest.approx(0.9)


async def test_without_a_policy_calls_sample_as_the_harness_asks(gw, http):
    key = gw.open_session()
    status, reply = await _chat(http, gw, key, messages=[_user("RAMBLE")])
    assert status == 200 and reply["finish"] == "stop" and reply["usage"]["completion_tokens"] == RAMBLE_TOKENS
    [record] = gw.records(key)
    assert record.sampling.temperature == 0.0 and record.sampling.top_p == 0.0  # FakeDialect's own
    assert record.sampling.max_tokens == 32768 - len(record.prompt_token_ids)  # what the context leaves
    assert not record.truncated and record.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_the_session_budget_cuts_the_last_call_and_refuses_the_next_without_generating(gw, http):
    key = gw.open_session(sampling=SamplingPolicy(max_tokens_per_call=8, max_tokens_per_session=12))
    replies = [await _chat(http, gw, key, messages=[_user(f"RAMBLE {i}")]) for i in range(3)]
    assert [(status, reply.get("usage", {}).get("completion_tokens")) for status, reply in replies[:2]] == [
        (200, 8),
        (200, 4),
    ]
    status, refusal = replies[2]
    assert status == 400 and refusal["error"]["kind"] == "invalid_request"
    assert "token budget is used up" in refusal["error"]["message"]
    records = gw.records(key)
    assert [(len(r.sampled_token_ids), r.sampling.max_tokens, r.truncated) for r in records] == [
        (8, 8, True),
        (4, 4, True),
    ]


@pytest.mark.parametrize("dialect, path, body", [route for route in ROUTES if "count_tokens" not in route[1]])
async def test_a_used_up_budget_is_refused_in_the_dialects_shape(gateway, http, dialect, path, body):
    key = gateway.open_session(sampling=SamplingPolicy(max_tokens_per_session=1))
    async with http.post(gateway.base_url + path, json=body, headers={"x-api-key": key}) as response:
        assert response.status == 200
        await response.read()
    status, expected = get_dialect(dialect).error_response(GatewayError(ErrorKind.INVALID_REQUEST, ""))
    async with http.post(gateway.base_url + path, json=body, headers={"x-api-key": key}) as response:
        assert response.status == status == 400
        refusal = await response.json()
    assert _without_messages(refusal) == _without_messages(expected)
    assert "token budget is used up" in json.dumps(refusal)
    [record] = gateway.records(key)
    assert len(record.sampled_token_ids) == 1 and record.truncated


async def test_open_session_takes_a_sampling_policy_and_refuses_one_out_of_range(gw, http):
    policy = common_pb2.SamplingPolicy(temperature=0.0, max_tokens_per_call=8)
    async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        opened = (await stub.OpenSession(gateway_pb2.OpenSessionRequest(task_id="t2", sampling=policy))).session
        assert opened.sampling == policy and opened.sampling.HasField("temperature")
        assert (await _chat(http, gw, opened.key, messages=[_user("RAMBLE")]))[1]["usage"]["completion_tokens"] == 8
        got = await stub.GetSession(gateway_pb2.GetSessionRequest(key=opened.session_id))
        assert got.session.sampling == policy and got.calls[0].truncated
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.OpenSession(gateway_pb2.OpenSessionRequest(sampling=common_pb2.SamplingPolicy(top_p=0.0)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("sampling.top_p: must be in (0, 1]")


# ---------------------------------------------------------------------------- GatewayService


async def test_gateway_service_opens_watches_reads_and_closes_sessions(gw, http):
    async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        opened = (await stub.OpenSession(gateway_pb2.OpenSessionRequest(task_id="t1", metadata={"a": "b"}))).session
        assert opened.key and opened.history == gateway_pb2.HISTORY_POLICY_FAITHFUL and opened.metadata["a"] == "b"
        watch = stub.WatchSession(gateway_pb2.WatchSessionRequest(key=opened.session_id))
        watched = asyncio.ensure_future(_collect(watch))

        for _ in range(2):
            assert (await _chat(http, gw, opened.key, messages=[_user("hello")]))[0] == 200
        got = await stub.GetSession(gateway_pb2.GetSessionRequest(key=opened.key))
        assert got.session.call_count == 2 and [c.call_id for c in got.calls] == ["c0001", "c0002"]
        status = (await stub.GetNodeStatus(gateway_pb2.GetNodeStatusRequest())).status
        assert status.open_sessions >= 1 and status.calls_total >= 2 and status.base_url == gw.base_url

        closed = (await stub.CloseSession(gateway_pb2.CloseSessionRequest(key=opened.key))).session
        assert closed.closed and closed.call_count == 2
        assert [c.call_id for c in await asyncio.wait_for(watched, 5)] == ["c0001", "c0002"]
        assert (await _chat(http, gw, opened.key, messages=[_user("hello")]))[0] == 401

        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.GetSession(gateway_pb2.GetSessionRequest(key="nope"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="polar.v1.GatewayService")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name async for reply in listing for s in reply.list_services_response.service]
        assert "polar.v1.GatewayService" in names


async def test_the_handle_serves_through_envoy_and_reports_envoys_url(gateway, http):
    assert gateway.envoy is not None and gateway.base_url != gateway.running.http_url
    stats_before = await asyncio.to_thread(_envoy_stats, gateway.envoy.admin)
    key = gateway.open_session()
    url = gateway.base_url + "/v1/chat/completions"
    async with http.post(url, json=ROUTES[0][2], headers={"x-api-key": key}) as response:
        assert response.status == 200
    stats = await asyncio.to_thread(_envoy_stats, gateway.envoy.admin)
    # The harness request entered through Envoy's harness listener, and the gateway's Generate call
    # left through its inference cluster.
    for counter in ("http.harness.downstream_rq_total", "cluster.inference.upstream_rq_total"):
        assert stats[counter] > stats_before[counter], counter
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        status = await gateway_pb2_grpc.GatewayServiceStub(channel).GetNodeStatus(gateway_pb2.GetNodeStatusRequest())
        assert status.status.base_url == gateway.base_url


async def test_without_envoy_the_handle_is_the_gateway_itself(http):
    async with running_gateway({"outputs": [{"text": "direct"}]}, envoy=False) as direct:
        assert direct.envoy is None and direct.base_url == direct.running.http_url
        async with http.post(
            direct.base_url + "/v1/chat/completions", json=ROUTES[0][2], headers={"x-api-key": direct.key}
        ) as response:
            assert (await response.json())["choices"][0]["message"]["content"] == "direct"


def _envoy_stats(admin: str) -> dict[str, int]:
    lines = (envoy_admin_get(admin, "/stats", timeout_s=5) or "").splitlines()
    return {name: int(value) for name, _, value in (line.partition(": ") for line in lines) if value.isdigit()}


async def _collect(stream) -> list[common_pb2.CallRecord]:
    return [response.call async for response in stream]


async def test_inference_down_is_overloaded_and_drain_stops_new_sessions(http):
    async with running_gateway(FAKE_SCRIPT) as down:
        # A stream the inference server drops half-way ends with the dialect's error event and terminator.
        body = {"model": "m", "stream": True, "messages": [_user("SLOWSTREAM")]}
        url, headers = down.base_url + "/v1/chat/completions", {"x-api-key": down.key}
        async with http.post(url, json=body, headers=headers) as response:
            received = b""
            while received.count(b"\n\n") < 3:
                received += await response.content.readany()
            await down.stop_inference()
            events = read_sse((received + await response.content.read()).decode())
        assert "error" in events[-2] and events[-1] == "[DONE]"
        [dropped] = down.records()
        assert dropped.error and not dropped.aborted and len(dropped.sampled_token_ids) >= 1

        for dialect, path, body in ROUTES[:3]:
            status, expected = get_dialect(dialect).error_response(GatewayError(ErrorKind.OVERLOADED, ""))
            async with http.post(down.base_url + path, json=body, headers={"x-api-key": down.key}) as response:
                assert response.status == status and status in (503, 529)
                assert _without_messages(await response.json()) == _without_messages(expected)
        records = down.records()[1:]
        assert len(records) == 3 and all(r.error and r.finish_reason == common_pb2.FINISH_REASON_ERROR for r in records)

        async with grpc.aio.insecure_channel(down.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            assert (await stub.Drain(gateway_pb2.DrainRequest(timeout_seconds=0))).open_sessions == 1
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.OpenSession(gateway_pb2.OpenSessionRequest())
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------------------------- CLI


async def _polar(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "polar", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


@pytest.mark.slow
async def test_polar_serve_gateway_reports_its_base_url(gateway):
    harness_url = "http://harness.example:8080"
    config = GatewayConfig(port=0, grpc_port=0, inference_address=gateway.inference_address)
    spec = gateway_spec(config, InferenceConfig(), harness_url)
    with contextlib.ExitStack() as stack:
        service = await asyncio.to_thread(stack.enter_context, running_service(spec, 60, 10))
        try:
            async with grpc.aio.insecure_channel(service.dial_address) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                status = (await stub.GetNodeStatus(gateway_pb2.GetNodeStatusRequest())).status
        finally:
            await asyncio.to_thread(stack.close)
    assert status.base_url == harness_url


@pytest.mark.slow
async def test_polar_session_open_show_close(gw, http):
    code, out, err = await _polar("session", "open", "--gateway", gw.grpc_address, "--task-id", "cli")
    assert code == 0, err
    key = out.strip()
    assert (await _chat(http, gw, key, messages=[_user("LOGPROBS")]))[0] == 200

    code, out, err = await _polar("session", "show", key, "--json", "--gateway", gw.grpc_address)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["session"]["taskId"] == "cli"
    assert shown["calls"][0]["sampledTokenIds"] == [19556, 905, 2]

    code, out, err = await _polar("session", "close", key, "--gateway", gw.grpc_address)
    assert code == 0 and "1 calls" in out
    code, _, err = await _polar("session", "show", "nope", "--gateway", gw.grpc_address)
    assert code == 1 and err.startswith("polar: error: GetSession") and "NOT_FOUND" in err


@pytest.mark.slow
async def test_polar_session_show_reads_a_session_larger_than_a_grpc_message(gw, http):
    """Five calls whose request bodies (kept whole in their records) total 5 MiB: more than one
    response may carry under gRPC's default 4 MiB receive limit, so `show` streams the records."""
    key = gw.open_session(task_id="big")
    padding = "x" * (1024 * 1024)
    for index in range(5):
        status, _ = await _chat(http, gw, key, messages=[_user(f"LOGPROBS {index}")], padding=padding)
        assert status == 200
    async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as whole:
            await gateway_pb2_grpc.GatewayServiceStub(channel).GetSession(gateway_pb2.GetSessionRequest(key=key))
    assert whole.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    code, out, err = await _polar("session", "show", key, "--json", "--gateway", gw.grpc_address)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["session"]["taskId"] == "big" and shown["session"]["callCount"] == 5
    assert [call["callId"] for call in shown["calls"]] == ["c0001", "c0002", "c0003", "c0004", "c0005"]
    for index, call in enumerate(shown["calls"]):
        body = json.loads(base64.b64decode(call["requestBody"]))
        assert body["messages"][0]["content"] == f"LOGPROBS {index}" and body["padding"] == padding
    code, out, err = await _polar("session", "show", key, "--gateway", gw.grpc_address)
    assert code == 0, err
    assert out.splitlines()[0].endswith("(open), 5 calls") and len(out.splitlines()) == 6


async def test_a_gateway_that_cannot_start_closes_the_socket_it_was_handed():
    from gateway.server import GatewayStartError, start_gateway
    from polar.service_base import listening_socket

    nowhere = GatewayConfig(port=0, grpc_port=0, inference_address="127.0.0.1:1")
    unserved = listening_socket("127.0.0.1")
    with pytest.raises(GatewayStartError, match="no inference service answered on 127.0.0.1:1"):
        await start_gateway(nowhere, http_socket=unserved, startup_timeout_s=0.5)
    assert unserved.fileno() == -1
    misnamed = listening_socket("127.0.0.1")
    with pytest.raises(LookupError, match="no-such-parser"):
        await start_gateway(dataclasses.replace(nowhere, parser="no-such-parser"), http_socket=misnamed)
    assert misnamed.fileno() == -1
