"""The gateway's bounds over real servers: a hung engine abandoned after [gateway] token_timeout_s with
an error in the caller's dialect, readiness that follows the inference server, bodies past a
session's cap spilled to disk and served back whole, idle sessions expired by the sweeper.

The engine is the scripted one; `HangingEngine` (tests/integration/gateway_fakes.py) stops sending
mid-generation, as a hung engine does.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import pytest

from gateway.dialects import get_dialect
from gateway.dialects.base import ErrorKind, GatewayError
from polar.testing.gateway import running_gateway
from polar.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.gateway_fakes import HangingEngine, read_sse

pytestmark = pytest.mark.anyio

TOKEN_TIMEOUT_S = 0.5
HANG_AFTER = 2  # tokens sent before the engine goes quiet
HI = [{"role": "user", "content": "hi"}]
STEADY_TOKENS = 20
SCRIPT = {
    "cycle": True,
    "tokens_per_chunk": 1,
    # 20 tokens 50 ms apart: a second in all, twice the token timeout, but never silent for long.
    "rules": [
        {"prompt_regex": "STEADY", "token_ids": [905] * STEADY_TOKENS, "delay_seconds": 0.05},
        # A tool call: its first token makes no event (the call is held until it is whole).
        {"prompt_regex": "HELD", "text": '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'},
    ],
    "outputs": [{"text": "Hello there, this is the reply."}],
}
# dialect -> (path whole, path streamed, body; the streamed body adds "stream": true where the dialect has it)
CALLS = {
    "openai_chat": ("/v1/chat/completions", "/v1/chat/completions", {"model": "m", "messages": HI}),
    "openai_responses": ("/v1/responses", "/v1/responses", {"model": "m", "input": "hi"}),
    "anthropic": ("/v1/messages", "/v1/messages", {"model": "m", "max_tokens": 64, "messages": HI}),
    "gemini": (
        "/v1beta/models/m:generateContent",
        "/v1beta/models/m:streamGenerateContent?alt=sse",
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
    ),
}
TIMEOUT_TEXT = f"sent no token for {TOKEN_TIMEOUT_S:g} s ([gateway] token_timeout_s)"


@pytest.fixture(scope="module")
async def hung():
    engine = HangingEngine.from_script(SCRIPT)
    async with running_gateway(engine=engine, settings={"token_timeout_s": TOKEN_TIMEOUT_S}) as handle:
        yield handle


def _request(dialect: str, stream: bool, content: str = "hi") -> tuple[str, dict]:
    whole_path, stream_path, body = CALLS[dialect]
    body = json.loads(json.dumps(body).replace('"hi"', json.dumps(content)))
    if stream and dialect != "gemini":
        body["stream"] = True
    return (stream_path if stream else whole_path), body


def _without_messages(body):
    if isinstance(body, dict):
        return {k: _without_messages(v) for k, v in body.items() if k not in ("message", "param")}
    return body


def _in_stream_error(dialect: str, events: list) -> dict:
    """The error event that ends a stream in the dialect's own grammar."""
    if dialect == "openai_chat":
        assert events[-1] == "[DONE]"
        return events[-2]["error"]
    if dialect == "openai_responses":
        failed = events[-1]
        assert failed["type"] == "response.failed" and events[-2]["type"] == "error"
        return failed["response"]["error"]
    if dialect == "anthropic":
        assert events[-1]["type"] == "error"
        return events[-1]["error"]
    return events[-1]["error"]  # gemini


async def _settled_record(gw, key: str) -> common_pb2.CallRecord:
    """The session's one record, once the call is recorded (a stream's end reaches the client first)."""
    deadline = time.monotonic() + 5
    while not gw.records(key):
        assert time.monotonic() < deadline, "the call was never recorded"
        await asyncio.sleep(0.01)
    [record] = gw.records(key)
    return record


async def _engine_cancelled(engine: HangingEngine, before: int) -> None:
    deadline = time.monotonic() + 5
    while engine.cancelled == before:
        assert time.monotonic() < deadline, "the hung generation was never cancelled at the engine"
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------------- hung engine


@pytest.mark.parametrize("dialect", sorted(CALLS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_hung_engine_is_abandoned_with_an_overloaded_error_in_the_callers_dialect(hung, http, dialect, stream):
    hung.engine.hang_after = HANG_AFTER
    key, cancelled = hung.open_session(), hung.engine.cancelled
    path, body = _request(dialect, stream)
    started = time.monotonic()
    async with http.post(hung.base_url + path, json=body, headers={"x-api-key": key}) as response:
        status, text = response.status, await response.text()
    waited = time.monotonic() - started
    assert TOKEN_TIMEOUT_S <= waited < TOKEN_TIMEOUT_S + 5  # the 900 s generate timeout is far off
    if stream:
        # The stream was open (tokens had come): it ends with the dialect's error event.
        assert status == 200
        error = _in_stream_error(dialect, read_sse(text))
    else:
        expected_status, expected = get_dialect(dialect).error_response(GatewayError(ErrorKind.OVERLOADED, ""))
        reply = json.loads(text)
        assert status == expected_status and status in (503, 529)
        assert _without_messages(reply) == _without_messages(expected)
        error = reply["error"]
    assert TIMEOUT_TEXT in error["message"]
    record = await _settled_record(hung, key)
    assert record.finish_reason == common_pb2.FINISH_REASON_ERROR and TIMEOUT_TEXT in record.error
    assert len(record.sampled_token_ids) == len(record.sampled_logprobs) == HANG_AFTER and not record.aborted
    await _engine_cancelled(hung.engine, cancelled)


async def test_an_engine_hung_before_its_first_token_gets_a_plain_error_reply_to_a_stream(hung, http):
    hung.engine.hang_after = 0
    key = hung.open_session()
    path, body = _request("openai_chat", stream=True)
    async with http.post(hung.base_url + path, json=body, headers={"x-api-key": key}) as response:
        assert response.status == 503
        assert TIMEOUT_TEXT in (await response.json())["error"]["message"]
    record = await _settled_record(hung, key)
    assert record.finish_reason == common_pb2.FINISH_REASON_ERROR and len(record.sampled_token_ids) == 0


async def test_a_stream_opens_with_the_engines_first_message_even_when_it_makes_no_event(hung, http):
    """Gemini's stream has no opening event, and a tool call's first token makes none: the status and
    headers still reach the client with that first message, not with the next event."""
    hung.engine.hang_after = 1
    key = hung.open_session()
    path, body = _request("gemini", stream=True, content="HELD")
    started = time.monotonic()
    async with http.post(hung.base_url + path, json=body, headers={"x-api-key": key}) as response:
        opened = time.monotonic() - started
        assert response.status == 200
        events = read_sse(await response.text())
    assert opened < TOKEN_TIMEOUT_S / 2
    assert TIMEOUT_TEXT in _in_stream_error("gemini", events)["message"]
    assert events[:-1] == []  # nothing but the error: the first token made no event


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_slow_but_steady_generation_is_not_cut(hung, http, stream):
    hung.engine.hang_after = None
    key = hung.open_session()
    path, body = _request("openai_chat", stream, content="STEADY")
    started = time.monotonic()
    async with http.post(hung.base_url + path, json=body, headers={"x-api-key": key}) as response:
        assert response.status == 200
        await response.read()
    assert time.monotonic() - started > TOKEN_TIMEOUT_S  # longer in all than the token timeout
    record = await _settled_record(hung, key)
    assert not record.error and len(record.sampled_token_ids) == STEADY_TOKENS


# ------------------------------------------------------------------------------------- readiness


async def _readiness(http, gw, path: str) -> tuple[int, dict]:
    async with http.get(gw.base_url + path) as response:
        return response.status, await response.json()


async def _until_readiness(http, gw, path: str, status: int) -> dict:
    deadline = time.monotonic() + 15
    while True:
        got, body = await _readiness(http, gw, path)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"{path} stayed {got}: {body}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_readiness_follows_the_inference_server_down_and_up_again(http):
    async with running_gateway(SCRIPT) as gw:
        inference = gw.running.gateway.inference.address  # Envoy's inference listener, in front of the server
        for path in ("/ready", "/"):
            status, body = await _readiness(http, gw, path)
            assert (status, body) == (200, {"service": "polar gateway", "status": "ok", "inference": inference})
        async with http.head(gw.base_url + "/") as response:
            assert response.status == 200  # liveness: the gateway itself answers

        await gw.stop_inference()
        down = await _until_readiness(http, gw, "/ready", 503)
        assert down["status"] == "unavailable" and down["inference"] == inference
        assert down["error"].startswith(f"the inference service at {inference} does not answer: UNAVAILABLE")
        assert (await _readiness(http, gw, "/"))[0] == 503
        async with http.head(gw.base_url + "/ready") as response:
            assert response.status == 503
        async with http.head(gw.base_url + "/") as response:
            assert response.status == 200

        await gw.restart_inference()
        assert (await _until_readiness(http, gw, "/ready", 200))["status"] == "ok"


@pytest.mark.slow
async def test_readiness_asks_the_inference_server_at_most_once_per_ttl():
    from gateway.app import InferenceReadiness

    async with running_gateway(SCRIPT, envoy=False) as gw:
        now = [0.0]
        readiness = InferenceReadiness(gw.running.gateway.inference, ttl_s=1.0, clock=lambda: now[0])
        assert await readiness.problem() == ""
        await gw.stop_inference()
        now[0] = 0.9
        assert await readiness.problem() == ""  # the answer of a moment ago, not a new question
        now[0] = 1.0
        problems = await asyncio.gather(*(readiness.problem() for _ in range(5)))
        assert len(set(problems)) == 1 and problems[0].startswith(f"the inference service at {gw.inference_address}")
        await gw.restart_inference()
        assert await readiness.problem() == problems[0]  # still within the TTL of that answer
        # Back within the channel's reconnect wait (2 s at most): each TTL passed, it asks again.
        deadline = time.monotonic() + 10
        while await readiness.problem():
            assert time.monotonic() < deadline, "the restarted inference server never answered"
            now[0] += 1.0
            await asyncio.sleep(0.1)


# ---------------------------------------------------------------------------------------- bodies


async def test_bodies_past_the_cap_are_spilled_to_disk_and_served_back_whole(http, tmp_path):
    settings = {"max_session_body_bytes": 0, "body_spill_dir": str(tmp_path)}  # every body to disk
    async with running_gateway(SCRIPT, envoy=False, settings=settings) as gw:
        sent = []
        for index in range(3):
            path, body = _request("openai_chat", stream=index == 1, content=f"question {index}")
            async with http.post(gw.base_url + path, json=body, headers={"x-api-key": gw.key}) as response:
                assert response.status == 200
                await response.read()
            sent.append(body)
        await _settled_calls(gw, 3)
        in_memory = gw.running.store.find(gw.key).records
        assert all(not r.request_body and not r.response_body for r in in_memory)
        assert all(len(r.sampled_token_ids) > 0 for r in in_memory)  # the tokens stay
        [folder] = tmp_path.iterdir()
        assert sum(f.stat().st_size for f in folder.iterdir()) > 0
        async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            calls = (await stub.GetSession(gateway_pb2.GetSessionRequest(key=gw.key))).calls
            watched = []
            gw.close_session()
            async for response in stub.WatchSession(gateway_pb2.WatchSessionRequest(key=gw.key)):
                watched.append(response.call)
        assert [json.loads(c.request_body) for c in calls] == sent
        assert all(json.loads(c.response_body)["object"] == "chat.completion" for c in calls)
        assert not any(c.bodies_dropped for c in calls) and watched == list(calls)
    assert not folder.exists()  # removed when the gateway stopped


async def _settled_calls(gw, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(gw.running.store.find(gw.key).records) < count:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------------------- expiry


async def test_an_idle_session_expires_and_its_key_gets_401_saying_so(http):
    async with running_gateway(SCRIPT, envoy=False, settings={"session_idle_timeout_s": 0.4}) as gw:
        path, body = _request("anthropic", stream=False)
        async with http.post(gw.base_url + path, json=body, headers={"x-api-key": gw.key}) as response:
            assert response.status == 200
        async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            deadline = time.monotonic() + 10
            # The sweeper runs every 0.1 s here (a quarter of the timeout); reading does not renew.
            while not (got := await stub.GetSession(gateway_pb2.GetSessionRequest(key=gw.key))).session.expired:
                assert time.monotonic() < deadline, "the idle session never expired"
                await asyncio.sleep(0.05)
        # What it recorded stays readable until it is forgotten like any closed session.
        assert got.session.closed and len(got.calls) == 1 and got.calls[0].request_body
        async with http.post(gw.base_url + path, json=body, headers={"x-api-key": gw.key}) as response:
            assert response.status == 401
            reply = await response.json()
        _, expected = get_dialect("anthropic").error_response(GatewayError(ErrorKind.AUTHENTICATION, ""))
        assert _without_messages(reply) == _without_messages(expected)
        assert re.search(r"expired: the gateway closed it after \d+\.\d s without a call", reply["error"]["message"])
        assert len(gw.records()) == 1
