"""Hypothesis fuzzing of request bodies for every gateway route, over real HTTP through the real Envoy
to a running gateway (scripted engine).

Each route gets four kinds of bodies: random JSON values, near-valid bodies (a valid body with
fields mutated, removed or retyped), bytes that are not JSON, and valid bodies under wrong content
types. Whatever arrives, the gateway must answer within a timeout, never with a 5xx (the inference
server is up), with a 4xx body in the route's dialect error shape, without logging an error, and
without recording an error for a call that reached the engine.

Hypothesis runs in a worker thread with a blocking HTTP client, so the module's event loop keeps
serving the gateway and the inference server meanwhile.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.dialects import get_dialect
from gateway.dialects.base import ErrorKind, GatewayError
from polar.testing.gateway import GatewayHandle
from tests.helpers.gateway_options import GatewayOptions

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

EXAMPLES_PER_ROUTE = 40  # per kind of body; ~1,500 requests in all
REQUEST_TIMEOUT_S = 15.0  # an answer (a whole stream included) later than this is a hang
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = {
    "cycle": True,
    "outputs": [
        {"text": "Hello."},
        {"text": f"<think>I should check.</think>\n{WEATHER_CALL}"},
        {"text": "<think>Fine.</think>It is 18C. END of answer."},
        {"text": '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> broken'},
    ],
}

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = {
    "model": "polar",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ],
    "tools": [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}}
    ],
    "tool_choice": "auto",
    "max_tokens": 16,
    "temperature": 0.5,
    "top_p": 0.9,
    "stop": ["END"],
    "seed": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
}
RESPONSES = {
    "model": "polar",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMETERS}],
    "tool_choice": "auto",
    "max_output_tokens": 16,
    "temperature": 0.5,
    "reasoning": {"effort": "low", "summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "store": False,
    "stream": True,
}
MESSAGES = {
    "model": "polar",
    "max_tokens": 16,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should check.", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]}
            ],
        },
    ],
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}],
    "tool_choice": {"type": "auto"},
    "stop_sequences": ["END"],
    "temperature": 0.5,
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "stream": True,
}
COUNT_TOKENS = {key: value for key, value in MESSAGES.items() if key not in ("max_tokens", "stream")}
GEMINI = {
    "systemInstruction": {"parts": [{"text": "Be brief."}]},
    "contents": [
        {"role": "user", "parts": [{"text": "Weather in Paris?"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"temp": "18C"}}}]},
    ],
    "tools": [{"functionDeclarations": [{"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}]}],
    "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
    "generationConfig": {
        "maxOutputTokens": 16,
        "temperature": 0.5,
        "stopSequences": ["END"],
        "thinkingConfig": {"includeThoughts": True},
    },
}


def _unstreamed(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("stream", "stream_options")}


# (dialect whose error shape the route answers in, method, path, valid bodies)
ROUTES = [
    ("openai_chat", "POST", "/v1/chat/completions", [CHAT, _unstreamed(CHAT)]),
    ("openai_responses", "POST", "/v1/responses", [RESPONSES, _unstreamed(RESPONSES)]),
    ("anthropic", "POST", "/v1/messages", [MESSAGES, _unstreamed(MESSAGES)]),
    ("anthropic", "POST", "/v1/messages?beta=true", [MESSAGES]),
    ("anthropic", "POST", "/v1/messages/count_tokens", [COUNT_TOKENS]),
    ("gemini", "POST", "/v1beta/models/polar:generateContent", [GEMINI]),
    ("gemini", "POST", "/v1beta/models/polar:streamGenerateContent?alt=sse", [GEMINI]),
    ("gemini", "POST", "/v1/models/polar:streamGenerateContent", [GEMINI]),
    ("gemini", "POST", "/v1beta/models/polar:countTokens", [GEMINI]),
    ("openai_chat", "GET", "/v1/models", [{}]),
    (None, "HEAD", "/", [{}]),
]

# Field names the dialects read, so that random objects reach past the first type check.
KEYS = sorted(
    {
        "model",
        "messages",
        "role",
        "content",
        "type",
        "text",
        "tools",
        "tool_calls",
        "function",
        "name",
        "arguments",
        "input",
        "parts",
        "contents",
        "system",
        "stream",
        "max_tokens",
        "tool_choice",
        "id",
        "call_id",
        "output",
        "tool_use_id",
        "functionCall",
        "functionResponse",
        "args",
        "response",
        "parameters",
        "input_schema",
        "generationConfig",
        "systemInstruction",
        "instructions",
        "thinking",
        "source",
        "image_url",
        "inlineData",
        "mode",
        "stop",
        "temperature",
        "top_p",
        "top_k",
        "seed",
    }
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["", "user", "assistant", "system", "tool", "model", "text", "function", "auto", "none"])
    | st.sampled_from([float("nan"), float("inf"), "\ud800", "x\udc00"])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=12,
)
NOT_JSON = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"model": ',
            b"null",
            b"[]",
            b'"text"',
            b"1e999999",
            b'{"a": NaN}',
            b'{"a": Infinity}',
            b"[" * 100_000,
            b'{"a":' * 50_000,
            b"\xef\xbb\xbf{}",
            b'{"messages": "\xff\xfe"}',
        ]
    ),
    st.text(max_size=100).map(str.encode),
)
CONTENT_TYPES = [
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=polar",
    "application/json; charset=latin-1",
    "application/octet-stream",
    "application/xml",
    "garbage",
]
# Values of other types for a field: each near-valid body retypes, replaces or removes a few.
DEEP = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]


def _retyped(value: Any) -> st.SearchStrategy:
    options: list[Any] = [
        None,
        True,
        0,
        -1,
        2**70,
        -(2**70),
        1.5,
        1e308,
        "",
        "x" * 300,
        [],
        {},
        [value],
        {"v": value},
        DEEP,
    ]
    # JSON that Python's decoder accepts but that is not what it seems: NaN and Infinity literals,
    # and a \ud800 escape, which decodes to a lone surrogate (no Unicode character).
    options += [float("nan"), float("inf"), -float("inf"), "\ud800", "a\udfffb"]
    if not isinstance(value, str):
        options.append(json.dumps(value))
    # Copies: a later mutation must not change a value another example draws (nor DEEP itself).
    return st.sampled_from(options).map(copy.deepcopy)


@st.composite
def near_valid(draw, bases: list[dict]) -> Any:
    body = draw(st.sampled_from(bases))
    for _ in range(draw(st.integers(1, 3))):
        body = _mutate(draw, body)
    return body


def _mutate(draw, value: Any) -> Any:
    """A copy of value with one field somewhere inside it removed, retyped, replaced or added (the
    copy shares the untouched parts, which nothing changes)."""
    if isinstance(value, dict) and value and draw(st.integers(0, 4)) > 0:
        value = dict(value)
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["descend", "descend", "remove", "add"]))
        if action == "remove":
            del value[key]
        elif action == "add":
            value[draw(st.sampled_from(KEYS) | st.text(max_size=8))] = draw(JSON_VALUES)
        else:
            value[key] = _mutate(draw, value[key])
        return value
    if isinstance(value, list) and value and draw(st.integers(0, 4)) > 0:
        value = list(value)
        index = draw(st.integers(0, len(value) - 1))
        action = draw(st.sampled_from(["descend", "descend", "remove", "duplicate"]))
        if action == "remove":
            del value[index]
        elif action == "duplicate":
            value.insert(index, value[index])
        else:
            value[index] = _mutate(draw, value[index])
        return value
    return draw(_retyped(value) | JSON_VALUES)


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def _skeleton(body: Any) -> Any:
    """An error body without its human-readable parts (message, offending field, details)."""
    if isinstance(body, dict):
        return {k: _skeleton(v) for k, v in body.items() if k not in ("message", "param", "details")}
    return body


def _error_shapes(dialect: str) -> list[tuple[int, Any]]:
    """Every (status, skeleton) the dialect answers a client error with."""
    kinds = (
        ErrorKind.INVALID_REQUEST,
        ErrorKind.UNSUPPORTED_CONTENT,
        ErrorKind.CONTEXT_LENGTH,
        ErrorKind.AUTHENTICATION,
        ErrorKind.NOT_FOUND,
    )
    shapes = []
    for kind in kinds:
        for param in (None, "model", "messages"):
            status, body = get_dialect(dialect).error_response(GatewayError(kind, "m", param=param))
            shapes.append((status, _skeleton(body)))
    return shapes


class _ErrorLog(logging.Handler):
    """Errors the gateway logs (a bug it caught and answered for)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.messages.append(self.format(record))

    def take(self) -> list[str]:
        with self._lock:
            taken, self.messages = self.messages, []
        return taken


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    return GatewayOptions(SCRIPT)


@pytest.fixture
def logged_errors():
    handler = _ErrorLog()
    logger = logging.getLogger("polar.gateway")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _send(
    base_url: str, method: str, path: str, body: bytes, content_type: str | None, key: str
) -> tuple[int, str, bytes]:
    """status, content type and the whole body, or a failure once REQUEST_TIMEOUT_S passes."""
    host_port = base_url.removeprefix("http://")
    connection = http.client.HTTPConnection(host_port, timeout=REQUEST_TIMEOUT_S)
    try:
        headers = {"x-api-key": key, "Content-Length": str(len(body))}
        if content_type is not None:
            headers["Content-Type"] = content_type
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def _check_answer(dialect: str | None, method: str, status: int, content_type: str, body: bytes, shapes) -> None:
    assert status < 500, f"{status}: {body[:500]!r}"
    if method == "HEAD":
        assert status == 200
        return
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        assert (status, _skeleton(json.loads(body))) in shapes, f"{status}: {body[:500]!r}"
    elif content_type.startswith("text/event-stream"):
        assert body.endswith(b"\n\n"), body[-200:]
    else:
        json.loads(body)


def _fuzz(gateway: GatewayHandle, route, kind: str, errors: _ErrorLog) -> Callable[[], None]:
    dialect, method, path, bases = route
    shapes = _error_shapes(dialect) if dialect else []
    key = gateway.open_session(task_id=f"fuzz {path} {kind}")
    bodies = {
        "random_json": JSON_VALUES.map(lambda value: (_encode(value), "application/json")),
        "near_valid": near_valid(bases).map(lambda value: (_encode(value), "application/json")),
        "not_json": NOT_JSON.map(lambda raw: (raw, "application/json")),
        "content_type": st.tuples(st.sampled_from(bases).map(_encode), st.sampled_from(CONTENT_TYPES)),
    }[kind]
    checked = 0
    statuses: list[int] = []

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(bodies)
    def fuzz(request: tuple[bytes, str | None]) -> None:
        nonlocal checked
        raw, content_type = request
        status, answer_type, answer = _send(gateway.base_url, method, path, raw, content_type, key)
        statuses.append(status)
        _check_answer(dialect, method, status, answer_type, answer, shapes)
        assert errors.take() == []
        records = gateway.records(key)
        assert [r.error for r in records[checked:] if r.error] == []
        checked = len(records)

    def run() -> list[int]:
        fuzz()
        return statuses

    return run


@pytest.mark.parametrize("kind", ["random_json", "near_valid", "not_json", "content_type"])
@pytest.mark.parametrize("route", ROUTES, ids=[f"{method} {path}" for _, method, path, _ in ROUTES])
async def test_no_request_body_makes_a_5xx_a_hang_or_a_wrong_error_shape(gateway, route, kind, logged_errors):
    statuses = await asyncio.to_thread(_fuzz(gateway, route, kind, logged_errors))
    if kind == "content_type":  # valid bodies: the content type does not matter
        assert set(statuses) == {200}
    elif kind == "near_valid" and route[1] == "POST":  # some mutations leave a body the route accepts
        assert 200 in statuses and any(400 <= status < 500 for status in statuses), sorted(set(statuses))
