"""The harness-facing HTTP application: routes → dialect → `Gateway.call`.

    POST /v1/chat/completions                          openai_chat
    POST /v1/responses                                 openai_responses
    POST /v1/messages[?beta=true]                      anthropic
    POST /v1/messages/count_tokens                     anthropic (prompt tokens only, no generation)
    POST /{v1,v1beta}/models/{model}:generateContent   gemini
    POST /{v1,v1beta}/models/{model}:streamGenerateContent[?alt=sse]
    POST /{v1,v1beta}/models/{model}:countTokens       gemini (prompt tokens only, no generation)
    GET  /v1/models                                    OpenAI's list shape (with vLLM's max_model_len, the
                                                       context window); Anthropic's with anthropic-version
    HEAD /                                             liveness, without a key (Claude Code probes it): 200
    GET  /, GET /ready (and HEAD /ready)               readiness, without a key: 200 while the inference
                                                       service answers, else 503 with a JSON body naming it

The session key is read from `Authorization: Bearer`, `x-api-key`, `x-goog-api-key` or Gemini's
`?key=`. Handlers stay thin: reading the body and choosing the dialect is all they do; errors come
back in the route's dialect shape, and a route whose dialect is unavailable, an unknown route or a
bug answer JSON in a neutral shape, never a traceback.

Readiness asks the inference service (GetModelInfo, through Envoy in the stack, failing at once when
it cannot be reached) at most once per READINESS_TTL_S, whatever the rate of probes: concurrent
probes share one question, and the answer is reused until it is that old.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import grpc
from aiohttp import web

from gateway.core import ClientGone, Gateway, InferenceClient, Reply, json_bytes
from gateway.dialects import DialectUnavailable, get_dialect
from gateway.dialects.base import Dialect, ErrorKind, GatewayError, Route

log = logging.getLogger("polar.gateway")

GATEWAY = web.AppKey("gateway", Gateway)
# Dialects that replace the registry's for some names (tests serve their own through real routes).
DIALECTS = web.AppKey("dialects", dict)
# Bodies carry whole conversations (a harness's prompt reaches ~100 kB; long sessions far more).
MAX_BODY_BYTES = 64 * 1024 * 1024
CLIENT_CLOSED_REQUEST = 499
GEMINI_METHODS = {"generateContent": False, "streamGenerateContent": True}
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
READINESS_TTL_S = 1.0  # how long a readiness answer is reused
READINESS_TIMEOUT_S = 2.0  # how long the inference service may take to answer a readiness question

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InferenceReadiness:
    """Whether the inference service answers, asked at most once per `ttl_s` (see the module docstring)."""

    def __init__(
        self,
        inference: InferenceClient,
        ttl_s: float = READINESS_TTL_S,
        timeout_s: float = READINESS_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inference = inference
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._answered_at: float | None = None
        self._problem = ""
        self._asking: asyncio.Future[str] | None = None

    async def problem(self) -> str:
        """Why the inference service cannot serve calls now; "" when it answers."""
        if self._answered_at is not None and self._clock() - self._answered_at < self._ttl_s:
            return self._problem
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
        # Shielded: a prober that hangs up does not cancel the question the others wait on.
        return await asyncio.shield(self._asking)

    async def _ask(self) -> str:
        try:
            await self._inference.model_info(self._timeout_s, wait_for_ready=False)
            problem = ""
        except grpc.aio.AioRpcError as exc:
            problem = (
                f"the inference service at {self._inference.address} does not answer: "
                f"{exc.code().name}: {exc.details()}"
            )
        finally:
            self._asking = None
        self._answered_at, self._problem = self._clock(), problem
        return problem


READINESS = web.AppKey("readiness", InferenceReadiness)


def create_app(gateway: Gateway, dialects: Mapping[str, Dialect] | None = None) -> web.Application:
    """The app; `dialects` serve their names' routes instead of the registry's modules."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    app[GATEWAY] = gateway
    app[DIALECTS] = dict(dialects or {})
    app[READINESS] = InferenceReadiness(gateway.inference)
    app.router.add_route("HEAD", "/", _root)
    app.router.add_get("/", _ready, allow_head=False)
    app.router.add_get("/ready", _ready)
    app.router.add_post("/v1/chat/completions", _dialect_route("openai_chat"))
    app.router.add_post("/v1/responses", _dialect_route("openai_responses"))
    app.router.add_post("/v1/messages", _dialect_route("anthropic"))
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    app.router.add_get("/v1/models", _models)
    app.router.add_post(r"/{version:v1|v1beta}/models/{target}", _gemini)
    return app


def session_key(request: web.Request) -> str | None:
    """The key the client presented, in any of the forms the dialects' SDKs use."""
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or request.headers.get("x-goog-api-key") or request.query.get("key")


def _dialect(request: web.Request, name: str) -> Dialect:
    """The dialect serving `name` in this app (DialectUnavailable when none can)."""
    override = request.app[DIALECTS].get(name)
    return override if override is not None else get_dialect(name)


def neutral_error(status: int, kind: str, message: str) -> web.Response:
    """An error for a request no dialect answers (unknown route, missing dialect, a bug)."""
    return web.Response(
        status=status, body=json_bytes({"error": {"type": kind, "message": message}}), content_type="application/json"
    )


def _reply(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, content_type="application/json")


class _StreamResponse(web.StreamResponse):
    """A stream whose status line and headers leave with its first bytes, in one write (as aiohttp's
    Response does): the gateway opens a stream only when it has the first events to send."""

    _send_headers_immediately = False


class _HttpSink:
    """A streamed HTTP response; each send is written to the socket at once (the first with the
    headers), and `end` writes the last bytes with the chunked terminator."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    def connected(self) -> bool:
        transport = self._request.transport
        return transport is not None and not transport.is_closing()

    async def open(self, media_type: str) -> None:
        response = _StreamResponse(status=200, headers=STREAM_HEADERS)
        response.content_type = media_type
        self.response = response
        try:
            await response.prepare(self._request)
        except ConnectionError as exc:
            raise ClientGone from exc

    async def send(self, chunks: Sequence[bytes]) -> None:
        await self._write(chunks, last=False)

    async def end(self, chunks: Sequence[bytes]) -> None:
        await self._write(chunks, last=True)

    async def _write(self, chunks: Sequence[bytes], *, last: bool) -> None:
        if self.response is None:
            raise RuntimeError("write before open")
        data = b"".join(chunks)
        try:
            await (self.response.write_eof(data) if last else self.response.write(data))
        except ConnectionError as exc:
            raise ClientGone from exc


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the request body is over {MAX_BODY_BYTES} bytes") from exc


async def _run(request: web.Request, dialect_name: str, route: Route) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    try:
        dialect = _dialect(request, dialect_name)
    except DialectUnavailable as exc:
        return neutral_error(404, "not_found_error", str(exc))
    key = session_key(request)
    try:
        gateway.authorize(key)  # a request without a valid key is refused before its body is read
        raw = await _read_body(request)
    except GatewayError as exc:
        return _reply(gateway.error_reply(dialect, exc))
    sink = _HttpSink(request)
    reply = await gateway.call(dialect, route, raw, key, sink)
    if reply is not None:
        return _reply(reply)
    if sink.response is None:
        # The client left before anything was sent (the call is recorded as aborted); nobody reads
        # this reply, it only closes the request: 499 as proxies log a client that closed first.
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    try:
        await sink.response.write_eof()  # no-op once the stream's end was sent
    except ConnectionError:
        pass  # the client left after the last event; the call is recorded already
    return sink.response


def _dialect_route(dialect_name: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _run(request, dialect_name, Route(request.path, query=dict(request.query)))

    return handle


async def _gemini(request: web.Request) -> web.StreamResponse:
    model, _, method = request.match_info["target"].rpartition(":")
    if model and method == "countTokens":
        return await _counted(request, "gemini", Route(request.path, model=model, query=dict(request.query)))
    if not model or method not in GEMINI_METHODS:
        return neutral_error(404, "not_found_error", f"no route {request.method} {request.path}")
    route = Route(request.path, model=model, stream=GEMINI_METHODS[method], query=dict(request.query))
    return await _run(request, "gemini", route)


async def _count_tokens(request: web.Request) -> web.StreamResponse:
    return await _counted(request, "anthropic", Route(request.path, query=dict(request.query)))


async def _counted(request: web.Request, dialect_name: str, route: Route) -> web.StreamResponse:
    """The prompt tokens a request would be rendered to now, in the dialect's count shape."""
    gateway = request.app[GATEWAY]
    try:
        dialect = _dialect(request, dialect_name)
    except DialectUnavailable as exc:
        return neutral_error(404, "not_found_error", str(exc))
    key = session_key(request)
    try:
        gateway.authorize(key)  # refused before the body is read, as a call is
        raw = await _read_body(request)
    except GatewayError as exc:
        return _reply(gateway.error_reply(dialect, exc))
    return _reply(gateway.count_tokens(dialect, route, raw, key))


async def _models(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    anthropic = "anthropic-version" in request.headers
    try:
        gateway.authorize(session_key(request))
    except GatewayError as exc:
        return _dialect_error(request, "anthropic" if anthropic else "openai_chat", exc)
    name = gateway.model.name
    if anthropic:
        entry = {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        body = {"data": [entry], "has_more": False, "first_id": name, "last_id": name}
    else:
        # max_model_len: the context window, under the name vLLM's list gives it.
        context = gateway.model.context_length
        body = {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "polar", "max_model_len": context}],
        }
    return web.Response(body=json_bytes(body), content_type="application/json")


def _dialect_error(request: web.Request, dialect_name: str, error: GatewayError) -> web.Response:
    try:
        dialect = _dialect(request, dialect_name)
    except DialectUnavailable:
        status = 401 if error.kind is ErrorKind.AUTHENTICATION else 400
        return neutral_error(status, error.kind.value, error.message)
    return _reply(request.app[GATEWAY].error_reply(dialect, error))


async def _root(request: web.Request) -> web.StreamResponse:
    return web.Response(status=200)


async def _ready(request: web.Request) -> web.StreamResponse:
    inference = request.app[GATEWAY].inference.address
    problem = await request.app[READINESS].problem()
    body = {"service": "polar gateway", "status": "unavailable" if problem else "ok", "inference": inference}
    if problem:
        body["error"] = problem
    return web.Response(status=503 if problem else 200, body=json_bytes(body), content_type="application/json")


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return neutral_error(exc.status, kind, exc.reason)
    except Exception:
        log.exception("gateway: %s %s failed", request.method, request.path)
        return neutral_error(500, "internal_error", "internal error in the gateway; see its log")
