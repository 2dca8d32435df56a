"""One rule for numbers in all four dialects (gateway/dialects/validation.py): the same values sent to
each dialect's request parser are accepted or refused alike, and each refusal is a 400 in that
dialect's own error shape that names the field."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.dialects import get_dialect
from gateway.dialects.base import DialectRequest, ErrorKind, GatewayError, Route

USER_TURN = {"role": "user", "content": "hi"}


@dataclass(frozen=True)
class Case:
    dialect: str
    route: Route
    body: Callable[[], dict[str, Any]]
    # The dialect's name of each common sampling field, as a path of keys into the body (the last one
    # is the field); its param is that path in the dialect's notation.
    fields: dict[str, tuple[str, ...]]
    message: Callable[[str, dict[str, Any]], str]  # checks the error body's shape, returns its message

    def send(self, field: str, value: Any) -> DialectRequest:
        body = self.body()
        *parents, key = self.fields[field]
        target = body
        for parent in parents:
            target = target.setdefault(parent, {})
        target[key] = value
        return get_dialect(self.dialect).parse_request(body, self.route)

    def param(self, field: str) -> str:
        return ".".join(self.fields[field])


def _openai_message(param: str, body: dict[str, Any]) -> str:
    assert set(body) == {"error"}
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
    return error["message"]


def _anthropic_message(param: str, body: dict[str, Any]) -> str:
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert message.startswith(f"{param}: ")  # Anthropic puts the field first
    return message


def _gemini_message(param: str, body: dict[str, Any]) -> str:
    error = body["error"]
    assert (error["code"], error["status"]) == (400, "INVALID_ARGUMENT")
    [detail] = error["details"]
    assert detail["fieldViolations"] == [{"field": param, "description": error["message"]}]
    return error["message"]


CASES = [
    Case(
        "openai_chat",
        Route("/v1/chat/completions"),
        lambda: {"model": "m", "messages": [USER_TURN]},
        {"max_tokens": ("max_tokens",), "temperature": ("temperature",), "top_p": ("top_p",)},
        _openai_message,
    ),
    Case(
        "openai_responses",
        Route("/v1/responses"),
        lambda: {"model": "m", "input": "hi"},
        {"max_tokens": ("max_output_tokens",), "temperature": ("temperature",), "top_p": ("top_p",)},
        _openai_message,
    ),
    Case(
        "anthropic",
        Route("/v1/messages"),
        lambda: {"model": "m", "max_tokens": 16, "messages": [USER_TURN]},
        {"max_tokens": ("max_tokens",), "temperature": ("temperature",), "top_p": ("top_p",)},
        _anthropic_message,
    ),
    Case(
        "gemini",
        Route("/v1beta/models/m:generateContent", model="m", stream=False),
        lambda: {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
        {
            "max_tokens": ("generationConfig", "maxOutputTokens"),
            "temperature": ("generationConfig", "temperature"),
            "top_p": ("generationConfig", "topP"),
        },
        _gemini_message,
    ),
]
DIALECTS = pytest.mark.parametrize("case", CASES, ids=[case.dialect for case in CASES])

# 10**400: an integer no double holds, which a JSON parser other than Python's reads as Infinity.
NOT_FINITE = [
    pytest.param(math.nan, "NaN", id="NaN"),
    pytest.param(math.inf, "Infinity", id="Infinity"),
    pytest.param(-math.inf, "-Infinity", id="-Infinity"),
    pytest.param(10**400, "Infinity", id="1e400"),
]


def refusal(case: Case, field: str, value: Any) -> str:
    """The message of the 400 the dialect answers, after checking its kind, param, status and shape."""
    with pytest.raises(GatewayError) as caught:
        case.send(field, value)
    error = caught.value
    param = case.param(field)
    assert (error.kind, error.param) == (ErrorKind.INVALID_REQUEST, param)
    status, body = get_dialect(case.dialect).error_response(error)
    assert status == 400
    message = case.message(param, body)
    assert param in message
    return message


@DIALECTS
@pytest.mark.parametrize("value", [5, 5.0, 5e0])
def test_an_integral_number_is_an_integer(case, value):
    max_tokens = case.send("max_tokens", value).sampling.max_tokens
    assert max_tokens == 5 and type(max_tokens) is int


@DIALECTS
def test_an_integer_is_a_number(case):
    temperature = case.send("temperature", 1).sampling.temperature
    assert temperature == 1.0 and type(temperature) is float


@DIALECTS
@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_p"])
@pytest.mark.parametrize(("value", "spelled"), NOT_FINITE)
def test_a_number_that_is_not_finite_is_refused_by_name(case, field, value, spelled):
    message = refusal(case, field, value)
    assert f"must be a finite number, got {spelled}" in message


@DIALECTS
@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_p"])
@pytest.mark.parametrize("value", [True, False, "1", [1], {"value": 1}])
def test_a_boolean_or_a_string_is_never_a_number(case, field, value):
    message = refusal(case, field, value)
    assert "expected" in message and "finite" not in message


@DIALECTS
@pytest.mark.parametrize("value", [5.5, 1e-9])
def test_a_fraction_is_not_an_integer(case, value):
    assert "integer" in refusal(case, "max_tokens", value)


@DIALECTS
@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("max_tokens", -3.0), ("temperature", 3), ("temperature", -0.5), ("top_p", 1.5)],
)
def test_a_number_out_of_range_says_the_range(case, field, value):
    message = refusal(case, field, value)
    assert "must be" in message and f"got {value:g}" in message
