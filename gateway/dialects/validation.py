"""The JSON checks every dialect validates its requests with: one rule per JSON type, the dialect's words.

A dialect makes one `Checks` with its own `Wording` and reads every field through it. Each check
returns the value (converted where the rule says so) or raises `GatewayError(INVALID_REQUEST)` whose
`param` is the field's path in the dialect's notation (`messages.0.role`, `messages[0].role`,
`contents[0].role`); the message is the dialect's, so each error body reads like that API's own.
A value that is None (absent or null) is missing: an error, or None where the check is `optional`.

The rule for numbers, decided once and applied the same way in all four dialects:

- An integer field takes a JSON number with no fractional part: `5` and `5.0` are both the integer 5;
  `5.5` is refused as not an integer. JSON has one number type, JSON Schema (the language of the OpenAI
  and Anthropic API references) counts 5.0 as an integer, and Gemini's proto JSON mapping takes it for
  an int32. OpenAI's own server refuses it, but accepting more than OpenAI breaks no client written
  against it, whereas refusing would break clients of the APIs that accept it.
- A number field takes any finite JSON number and gives a float. NaN and ±Infinity (Python's json
  module reads them, and a number too large for a double is Infinity) are refused, integer fields
  included: `temperature: must be a finite number, got NaN`.
- `true` and `false` are never numbers, although Python's bool is an int; nor is a string of digits.
- A range is checked on the value as sent (a huge integer is compared exactly, never converted first):
  `must be between 0 and 2, got 3`. Ranges belong to each dialect; the kit only says how to check them.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.conversation import ToolSpec
from gateway.dialects.base import ErrorKind, GatewayError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # max_tokens, top_k and Gemini's integers travel as int32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed


# Deepest nesting of a JSON value sent as a string (tool-call arguments) that a request may carry:
# far beyond any tool's arguments, far below Python's recursion limit for what reads it later.
MAX_JSON_DEPTH = 128


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects in `value` nest more than `limit` levels deep (no recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [
            child
            for item in level
            if isinstance(item, (dict, list))
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def json_type(value: Any) -> str:
    """The JSON Schema type name of a decoded JSON value: null, boolean, integer, number, string, array
    or object (a float with an integral value is a number: it is what was sent)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class Wording(abc.ABC):
    """How a dialect words the kit's errors, so that each error reads like that API's own. `expected` is a
    JSON Schema type name; `reason` is the kit's sentence about a value (`must be between 0 and 1, got
    1.5`), for the dialect to frame with the path."""

    @abc.abstractmethod
    def wrong_type(self, path: str, expected: str, value: Any) -> str:
        """`value` is not of the JSON type `expected`."""

    @abc.abstractmethod
    def missing(self, path: str, expected: str) -> str:
        """A required field is absent or null."""

    @abc.abstractmethod
    def bad_value(self, path: str, reason: str) -> str:
        """The type is right, the value is not: out of range, not finite, empty."""

    @abc.abstractmethod
    def duplicate_tool(self, path: str, name: str) -> str:
        """A second tool named `name`."""


class Checks:
    """The checks of one dialect, in its wording."""

    def __init__(self, wording: Wording) -> None:
        self.wording = wording

    def invalid(self, path: str | None, message: str) -> GatewayError:
        return GatewayError(ErrorKind.INVALID_REQUEST, message, param=path)

    # Types ---------------------------------------------------------------------------------------

    def object(self, value: Any, path: str, *, optional: bool = False) -> dict[str, Any] | None:
        return self._typed(value, path, "object", dict, optional)

    def array(self, value: Any, path: str, *, optional: bool = False) -> list[Any] | None:
        return self._typed(value, path, "array", list, optional)

    def boolean(self, value: Any, path: str, *, optional: bool = False) -> bool | None:
        return self._typed(value, path, "boolean", bool, optional)

    def string(self, value: Any, path: str, *, optional: bool = False, nonempty: bool = False) -> str | None:
        text = self._typed(value, path, "string", str, optional)
        if nonempty and text == "":
            raise self.invalid(path, self.wording.bad_value(path, "must not be empty"))
        return text

    def integer(
        self, value: Any, path: str, low: int | None = None, high: int | None = None, *, optional: bool = False
    ) -> int | None:
        """An integer, 5.0 included (see the module docstring)."""
        number = self._finite(value, path, "integer", optional)
        if isinstance(number, float):
            if not number.is_integer():
                raise self.invalid(path, self.wording.wrong_type(path, "integer", value))
            number = int(number)
        return self._within(number, path, low, high)

    def number(
        self, value: Any, path: str, low: float | None = None, high: float | None = None, *, optional: bool = False
    ) -> float | None:
        """A finite number, as a float."""
        number = self._within(self._finite(value, path, "number", optional), path, low, high)
        return None if number is None else float(number)

    def field(
        self, obj: Mapping[str, Any], key: str, kind: str, path: str | None = None, *, required: bool = False
    ) -> Any:
        """`obj[key]` checked as a JSON Schema `kind` (any range is the caller's); None when absent or
        null, unless required. `path` defaults to the key."""
        if kind not in _KINDS:
            raise ValueError(f"no JSON type {kind!r}")
        check = getattr(self, kind)
        return check(obj.get(key), key if path is None else path, optional=not required)

    def fields(self, obj: Mapping[str, Any], kinds: Mapping[str, str], prefix: str = "") -> None:
        """Type-check fields that are accepted but not used, so a wrong type still gets its 400."""
        for key, kind in kinds.items():
            self.field(obj, key, kind, prefix + key)

    # Tools ---------------------------------------------------------------------------------------

    def unique_tool_names(self, tools: Sequence[ToolSpec], paths: Sequence[str]) -> None:
        """Two tools of one name would leave the model's calls ambiguous: the second is refused, at its
        path (`paths[i]` belongs to `tools[i]`)."""
        seen: set[str] = set()
        for tool, path in zip(tools, paths, strict=True):
            if tool.name in seen:
                raise self.invalid(path, self.wording.duplicate_tool(path, tool.name))
            seen.add(tool.name)

    # ---------------------------------------------------------------------------------------------

    def _typed(self, value: Any, path: str, expected: str, kind: type, optional: bool) -> Any:
        if value is None:
            return self._missing(path, expected, optional)
        if not isinstance(value, kind):
            raise self.invalid(path, self.wording.wrong_type(path, expected, value))
        return value

    def _missing(self, path: str, expected: str, optional: bool) -> None:
        if not optional:
            raise self.invalid(path, self.wording.missing(path, expected))
        return None

    def _finite(self, value: Any, path: str, expected: str, optional: bool) -> int | float | None:
        """A JSON number that is finite as a double; None if missing and optional."""
        if value is None:
            return self._missing(path, expected, optional)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.invalid(path, self.wording.wrong_type(path, expected, value))
        try:
            as_double = float(value)
        except OverflowError:  # an integer beyond a double's range: Infinity to a JSON parser
            as_double = math.inf
        if not math.isfinite(as_double):
            reason = f"must be a finite number, got {_spelled(as_double)}"
            raise self.invalid(path, self.wording.bad_value(path, reason))
        return value

    def _within(self, value: Any, path: str, low: float | None, high: float | None) -> Any:
        """The number, if it is None or in [low, high] (None: unbounded); compared exactly, as sent."""
        if value is None or ((low is None or low <= value) and (high is None or value <= high)):
            return value
        if low is not None and high is not None:
            reason = f"must be between {_shown(low)} and {_shown(high)}"
        elif low is not None:
            reason = f"must be at least {_shown(low)}"
        else:
            reason = f"must be at most {_shown(high)}"
        raise self.invalid(path, self.wording.bad_value(path, f"{reason}, got {_shown(value)}"))


_KINDS = frozenset({"object", "array", "boolean", "string", "integer", "number"})  # Checks methods


def _shown(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def _spelled(number: float) -> str:
    """A non-finite number as JSON extensions (and JavaScript) spell it."""
    if math.isnan(number):
        return "NaN"
    return "Infinity" if number > 0 else "-Infinity"
