"""A call's request and response in one shape for the page, whatever the dialect it was made in.

Every dialect comes down to the same pieces: a system text, the tools offered, and turns (a role and
its parts: text, thinking, a tool call, a tool result, or anything else kept as JSON). The page draws
those; it never needs a dialect's own field names. A body that is not JSON, or holds a shape this
module does not know, becomes one "other" part holding its text: nothing the harness sent is lost.
"""

from __future__ import annotations

import json
from typing import Any

TEXT, THINKING, TOOL_CALL, TOOL_RESULT, OTHER = "text", "thinking", "tool_call", "tool_result", "other"


def part(kind: str, text: str = "", *, name: str = "", call_id: str = "") -> dict[str, str]:
    return {"kind": kind, "text": text, "name": name, "id": call_id}


def turn(role: str, parts: list[dict[str, str]]) -> dict[str, Any]:
    return {"role": role, "parts": parts}


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, indent=1)


def _load(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- OpenAI Chat Completions


def _chat_content(content: Any) -> list[dict[str, str]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [part(TEXT, content)] if content else []
    parts = []
    for item in content if isinstance(content, list) else [content]:
        if isinstance(item, dict) and item.get("type") == "text":
            parts.append(part(TEXT, str(item.get("text", ""))))
        else:
            parts.append(part(OTHER, _json_text(item)))
    return parts


def _chat_message(message: dict) -> dict[str, Any]:
    role = str(message.get("role", "?"))
    parts = []
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str) and message[key]:
            parts.append(part(THINKING, message[key]))
    if role == "tool":
        parts.append(
            part(TOOL_RESULT, _json_text(message.get("content", "")), call_id=str(message.get("tool_call_id", "")))
        )
    else:
        parts += _chat_content(message.get("content"))
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        parts.append(
            part(
                TOOL_CALL,
                _json_text(function.get("arguments", "")),
                name=str(function.get("name", "")),
                call_id=str(call.get("id", "")),
            )
        )
    return turn(role, parts)


def _chat_request(body: dict) -> tuple[str, list[dict], list[str]]:
    system, turns = [], []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            turns.append(turn("?", [part(OTHER, _json_text(message))]))
        elif message.get("role") in ("system", "developer") and not turns:
            system += [p["text"] for p in _chat_content(message.get("content"))]
        else:
            turns.append(_chat_message(message))
    tools = [str((t.get("function") or {}).get("name", "")) for t in body.get("tools") or [] if isinstance(t, dict)]
    return "\n\n".join(system), turns, tools


def _chat_response(body: dict) -> list[dict]:
    return [
        _chat_message(choice.get("message") or {}) for choice in body.get("choices") or [] if isinstance(choice, dict)
    ]


# ---------------------------------------------------------------------------------- OpenAI Responses


def _responses_items(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [turn("user", [part(TEXT, items)])]
    turns: list[dict] = []
    for item in items or []:
        if not isinstance(item, dict):
            turns.append(turn("?", [part(OTHER, _json_text(item))]))
            continue
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            parts = (
                [part(TEXT, content)]
                if isinstance(content, str)
                else [
                    part(TEXT, str(c.get("text", "")))
                    if isinstance(c, dict) and "text" in c
                    else part(OTHER, _json_text(c))
                    for c in content or []
                ]
            )
            turns.append(turn(str(item.get("role", "?")), parts))
        elif kind == "function_call":
            turns.append(
                turn(
                    "assistant",
                    [
                        part(
                            TOOL_CALL,
                            _json_text(item.get("arguments", "")),
                            name=str(item.get("name", "")),
                            call_id=str(item.get("call_id", "")),
                        )
                    ],
                )
            )
        elif kind == "function_call_output":
            turns.append(
                turn(
                    "tool",
                    [part(TOOL_RESULT, _json_text(item.get("output", "")), call_id=str(item.get("call_id", "")))],
                )
            )
        elif kind == "reasoning":
            text = "\n".join(str(s.get("text", "")) for s in item.get("summary") or [] if isinstance(s, dict))
            text += "\n".join(str(c.get("text", "")) for c in item.get("content") or [] if isinstance(c, dict))
            turns.append(turn("assistant", [part(THINKING, text)]))
        else:
            turns.append(turn(str(item.get("role", "?")), [part(OTHER, _json_text(item))]))
    return turns


def _responses_request(body: dict) -> tuple[str, list[dict], list[str]]:
    tools = [str(t.get("name", t.get("type", ""))) for t in body.get("tools") or [] if isinstance(t, dict)]
    return str(body.get("instructions") or ""), _responses_items(body.get("input")), tools


def _responses_response(body: dict) -> list[dict]:
    return _responses_items(body.get("output"))


# ------------------------------------------------------------------------------- Anthropic Messages


def _anthropic_blocks(content: Any) -> list[dict[str, str]]:
    if isinstance(content, str):
        return [part(TEXT, content)]
    parts = []
    for block in content or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(part(TEXT, str(block.get("text", ""))))
        elif kind in ("thinking", "redacted_thinking"):
            parts.append(part(THINKING, str(block.get("thinking", block.get("data", "")))))
        elif kind == "tool_use":
            parts.append(
                part(
                    TOOL_CALL,
                    _json_text(block.get("input", {})),
                    name=str(block.get("name", "")),
                    call_id=str(block.get("id", "")),
                )
            )
        elif kind == "tool_result":
            inner = block.get("content", "")
            text = inner if isinstance(inner, str) else "\n".join(p["text"] for p in _anthropic_blocks(inner))
            parts.append(part(TOOL_RESULT, text, call_id=str(block.get("tool_use_id", ""))))
        else:
            parts.append(part(OTHER, _json_text(block)))
    return parts


def _anthropic_request(body: dict) -> tuple[str, list[dict], list[str]]:
    system = body.get("system") or ""
    if not isinstance(system, str):
        system = "\n\n".join(p["text"] for p in _anthropic_blocks(system))
    turns = [
        turn(str(m.get("role", "?")), _anthropic_blocks(m.get("content")))
        if isinstance(m, dict)
        else turn("?", [part(OTHER, _json_text(m))])
        for m in body.get("messages") or []
    ]
    tools = [str(t.get("name", "")) for t in body.get("tools") or [] if isinstance(t, dict)]
    return system, turns, tools


def _anthropic_response(body: dict) -> list[dict]:
    return [turn(str(body.get("role", "assistant")), _anthropic_blocks(body.get("content")))]


# -------------------------------------------------------------------------------- Google Gemini API


def _google_parts(parts: Any) -> list[dict[str, str]]:
    out = []
    for item in parts or []:
        if not isinstance(item, dict):
            out.append(part(OTHER, _json_text(item)))
        elif "text" in item:
            out.append(part(THINKING if item.get("thought") else TEXT, str(item["text"])))
        elif "functionCall" in item:
            call = item["functionCall"] or {}
            out.append(
                part(
                    TOOL_CALL,
                    _json_text(call.get("args", {})),
                    name=str(call.get("name", "")),
                    call_id=str(call.get("id", "")),
                )
            )
        elif "functionResponse" in item:
            response = item["functionResponse"] or {}
            out.append(
                part(
                    TOOL_RESULT,
                    _json_text(response.get("response", {})),
                    name=str(response.get("name", "")),
                    call_id=str(response.get("id", "")),
                )
            )
        else:
            out.append(part(OTHER, _json_text(item)))
    return out


def _google_request(body: dict) -> tuple[str, list[dict], list[str]]:
    instruction = body.get("systemInstruction") or body.get("system_instruction") or {}
    system = "\n\n".join(
        p["text"] for p in _google_parts(instruction.get("parts") if isinstance(instruction, dict) else [])
    )
    turns = [
        turn(str(c.get("role", "user")), _google_parts(c.get("parts")))
        if isinstance(c, dict)
        else turn("?", [part(OTHER, _json_text(c))])
        for c in body.get("contents") or []
    ]
    tools = [
        str(f.get("name", ""))
        for t in body.get("tools") or []
        if isinstance(t, dict)
        for f in t.get("functionDeclarations") or t.get("function_declarations") or []
        if isinstance(f, dict)
    ]
    return system, turns, tools


def _google_response(body: dict) -> list[dict]:
    return [
        turn("model", _google_parts((c.get("content") or {}).get("parts")))
        for c in body.get("candidates") or []
        if isinstance(c, dict)
    ]


_READERS = {
    "openai_chat": (_chat_request, _chat_response),
    "openai_responses": (_responses_request, _responses_response),
    "anthropic_messages": (_anthropic_request, _anthropic_response),
    "google_generate_content": (_google_request, _google_response),
}


def read_request(dialect: str, body: bytes) -> tuple[str, list[dict], list[str]]:
    """(system text, turns, tool names) of a request body in `dialect` (as Dialect's names, lower
    case, without DIALECT_)."""
    data = _load(body)
    if not isinstance(data, dict) or dialect not in _READERS:
        return "", ([turn("?", [part(OTHER, _json_text(data))])] if data is not None else []), []
    try:
        return _READERS[dialect][0](data)
    except (AttributeError, TypeError) as exc:
        return "", [turn("?", [part(OTHER, f"unreadable request ({exc}):\n{_json_text(data)}")])], []


def read_response(dialect: str, body: bytes) -> list[dict]:
    """The turns of a response body in `dialect` ([] when there is none)."""
    data = _load(body)
    if data is None:
        return []
    if not isinstance(data, dict) or dialect not in _READERS:
        return [turn("?", [part(OTHER, _json_text(data))])]
    try:
        return _READERS[dialect][1](data)
    except (AttributeError, TypeError) as exc:
        return [turn("?", [part(OTHER, f"unreadable response ({exc}):\n{_json_text(data)}")])]
