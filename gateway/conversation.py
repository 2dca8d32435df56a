"""The dialect-neutral conversation every API dialect translates into and out of.

Dialects build these records from request bodies; the chat format renders them to token ids; the output
parser turns sampled text back into an assistant `Message`. The records are frozen so a recorded call's
conversation can never change under the session log.

History matching (`turns_match`) compares what reaches the model, not how the dialect spelled it:

- tool-call arguments are compared as parsed JSON (`json_equal`: key order ignored, 1 == 1.0, but
  true != 1), because harnesses re-serialise the arguments they echo;
- tool-call ids, `tool_call_id` and tool `name` are ignored: the chat formats never render them, and
  some dialects (Gemini) regenerate or drop ids, so comparing them would break chains for nothing;
- an echoed assistant turn without reasoning matches a recorded one with reasoning, because several
  dialects (Chat Completions among them) never send reasoning back; when the echo carries reasoning it
  must be the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call."""

    name: str
    description: str = ""
    # JSON schema of the arguments object.
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (or a harness echoed back)."""

    id: str
    name: str
    # The arguments as parsed JSON: always an object.
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Message:
    """One turn. `reasoning` and `tool_calls` only on assistant turns, `tool_call_id` only on tool turns."""

    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    # The call a tool turn answers.
    tool_call_id: str = ""
    # The function that produced a tool turn's content, where the dialect says it.
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        if self.role != "assistant" and (self.tool_calls or self.reasoning):
            raise ValueError(f"a {self.role} message cannot carry tool calls or reasoning")


@dataclass(frozen=True)
class ToolChoice:
    """Whether and which tool the model must call: auto, none, required, or one named function."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    # The function a `function` choice forces; empty otherwise.
    function_name: str = ""
    # A `required` choice among these functions only (Gemini's allowedFunctionNames); empty: any tool.
    allowed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.mode == "function") != bool(self.function_name):
            raise ValueError("a function name is given exactly when mode is 'function'")
        if self.allowed and self.mode != "required":
            raise ValueError("allowed functions are given only when mode is 'required'")

    @classmethod
    def auto(cls) -> ToolChoice:
        return cls("auto")

    @classmethod
    def none(cls) -> ToolChoice:
        return cls("none")

    @classmethod
    def required(cls, allowed: tuple[str, ...] = ()) -> ToolChoice:
        return cls("required", allowed=allowed)

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")

    @classmethod
    def function(cls, name: str) -> ToolChoice:
        return cls("function", name)


@dataclass(frozen=True)
class Conversation:
    """What one request asks the model to continue."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()


def json_equal(a: Any, b: Any) -> bool:
    """Equality of parsed JSON: objects ignore key order, numbers compare by value, bools are not numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def tool_calls_match(incoming: tuple[ToolCall, ...], recorded: tuple[ToolCall, ...]) -> bool:
    """Same calls in the same order, by name and parsed arguments; ids ignored."""
    return len(incoming) == len(recorded) and all(
        a.name == b.name and json_equal(a.arguments, b.arguments) for a, b in zip(incoming, recorded)
    )


def turns_match(incoming: Message, recorded: Message, *, strict_reasoning: bool = False) -> bool:
    """Whether a turn a harness sent is the turn recorded earlier (see the module docstring).

    With `strict_reasoning` the reasoning must be identical, empty included: used where the prompt is
    what the template renders from the harness's messages, so a missing reasoning changes the tokens.
    """
    reasoning_ok = incoming.reasoning == recorded.reasoning or (not strict_reasoning and not incoming.reasoning)
    return (
        incoming.role == recorded.role
        and incoming.content == recorded.content
        and reasoning_ok
        and tool_calls_match(incoming.tool_calls, recorded.tool_calls)
    )
