"""A request's forcing and schema options as the one constraint the engine decodes under.

Every dialect parses its options into the same two records, and this module turns them into a
`SamplingParams.constraint` (common.proto):

- a forced tool call (`ToolChoice` required, with its allowed functions, or one named function:
  OpenAI `tool_choice` required / {function}, Anthropic `any` / `tool`, Gemini `ANY` with
  `allowedFunctionNames`) is kind "tool_call": the model's own tool-call format around one JSON
  object `{"name": N, "arguments": A}`, N one of the allowed functions and A valid against N's
  parameters schema (Hermes: `<tool_call>\\n` ... `\\n</tool_call>`);
- an output schema (`DialectRequest.output_schema`: OpenAI `response_format` / Responses
  `text.format` json_schema, Gemini `responseSchema` / `responseJsonSchema`) is kind "json_schema": the
  reply is one JSON value valid against it.

A forced call wins over an output schema (the reply is then a call, not text). A constrained reply
is constrained whole, so the client's stop strings are not applied to it (gateway/core.py): one
would cut it into invalid JSON presented as complete. The grammar is
compiled here first (cached per constraint, polar/inference/constraints.py), so a schema the compiler
refuses is a 400 in the caller's dialect before anything is generated, naming the tool or field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.chat_format import ChatFormat
from gateway.conversation import Conversation, ToolSpec
from gateway.dialects.base import ErrorKind, GatewayError
from polar.inference.constraints import ConstraintError, OutputConstraint, grammar


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON schema of one call of `tool`: {"name": its name, "arguments": an object valid for it}."""
    parameters = dict(tool.parameters)
    if "type" not in parameters:  # arguments are always an object (gateway.conversation.ToolCall)
        parameters["type"] = "object"
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_tools(conversation: Conversation) -> tuple[ToolSpec, ...]:
    """The tools a forced call may be of, in declaration order; () when no call is forced."""
    choice = conversation.tool_choice
    if not choice.forces_call:
        return ()
    if choice.mode == "function":
        names = {choice.function_name}
    else:
        names = set(choice.allowed) or {tool.name for tool in conversation.tools}
    return tuple(tool for tool in conversation.tools if tool.name in names)


def tool_call_constraint(tools: tuple[ToolSpec, ...], chat_format: ChatFormat) -> OutputConstraint:
    """One call of any of `tools` (at least one), in the chat format's tool-call delimiters; unchecked."""
    schemas = [call_schema(tool) for tool in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    prefix, suffix = chat_format.tool_call_delimiters()
    return OutputConstraint("tool_call", json.dumps(schema, ensure_ascii=False), prefix, suffix)


def output_constraint(
    conversation: Conversation, output_schema: Mapping[str, Any] | None, chat_format: ChatFormat
) -> OutputConstraint | None:
    """The constraint the request asks for, checked; None when it asks for none.

    Raises GatewayError (INVALID_REQUEST) for a schema the grammar compiler refuses."""
    tools = forced_tools(conversation)
    if tools:
        names = ", ".join(repr(tool.name) for tool in tools)
        return _checked(
            tool_call_constraint(tools, chat_format), f"the parameters schema of the forced tool ({names})", "tools"
        )
    if output_schema is not None:
        constraint = OutputConstraint("json_schema", json.dumps(output_schema, ensure_ascii=False))
        return _checked(constraint, "the response's JSON schema", None)
    return None


def _checked(constraint: OutputConstraint, what: str, param: str | None) -> OutputConstraint:
    try:
        grammar(constraint)
    except ConstraintError as exc:
        raise GatewayError(
            ErrorKind.INVALID_REQUEST, f"{what} cannot be enforced by constrained decoding: {exc}", param=param
        ) from exc
    return constraint
