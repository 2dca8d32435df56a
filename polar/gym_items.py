"""NeMo Gym's view of a Polar session: Responses-API items, with the token fields NeMo RL trains on.

A NeMo Gym agent server answers a rollout (`POST /run`) with a Responses-API response whose output
carries, on the last item of each model call, `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs`. NeMo RL accepts the row only if every call's prompt ids begin with all the
ids seen before it (earlier prompts and generations: "Non-contiguous messages found!" otherwise),
and trains on the generations. One trace of a prefix-merged trajectory is exactly such a chain: the
call whose sample starts at position s of the trace had the trace's first s tokens as its prompt.

A session with forks (compaction, sub-agents, edits) has several traces, and one row holds one
chain, so `gym_response` answers the main trace: the one holding the session's last sampled call,
the chain that reached the end the evaluator graded. The other traces are counted, never mixed in.

The same items are what a NeMo Gym resources server's /verify reads as the session's final response
(`final_response`, for the "gym" evaluator). Torch-free (the stubs and the standard library only):
NeMo Gym's own environment imports it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from polar.v1 import common_pb2


@dataclass(frozen=True)
class SampledCall:
    """One model call of a trace as NeMo RL reads it."""

    call_id: str
    prompt_token_ids: list[int]  # the trace's tokens before this call's sample
    generation_token_ids: list[int]
    generation_log_probs: list[float]  # one per generated token


@dataclass(frozen=True)
class GymResponse:
    """A session as one NeMo Gym response: `response` is the Responses-API object (JSON-ready)."""

    response: dict[str, Any]
    trace_id: str  # the main trace's id ("" when the session sampled nothing)
    calls: list[SampledCall]
    other_traces: int  # traces of the session left out of this row


def trace_calls(trace: common_pb2.Trace) -> list[SampledCall]:
    """The trace's sampled calls in order, each with the prefix of the trace that was its prompt."""
    token_ids = list(trace.token_ids)
    logprobs = list(trace.behaviour_logprobs)
    return [
        SampledCall(
            segment.call_id,
            token_ids[: segment.start],
            token_ids[segment.start : segment.end],
            logprobs[segment.start : segment.end],
        )
        for segment in trace.segments
        if segment.kind == common_pb2.TraceSegment.KIND_SAMPLED
    ]


def main_trace(trajectory: common_pb2.Trajectory) -> common_pb2.Trace | None:
    """The trace holding the session's last sampled call; None when no trace samples anything."""
    sampled_in = {
        segment.call_id: trace
        for trace in trajectory.traces
        for segment in trace.segments
        if segment.kind == common_pb2.TraceSegment.KIND_SAMPLED
    }
    for record in reversed(trajectory.calls):
        if record.call_id in sampled_in:
            return sampled_in[record.call_id]
    return None


def gym_response(trajectory: common_pb2.Trajectory) -> GymResponse:
    """The session's main trace as a Responses-API response: each sampled call's reply as output
    items, the token fields on the last item of each call."""
    trace = main_trace(trajectory)
    records = {record.call_id: record for record in trajectory.calls}
    calls = trace_calls(trace) if trace is not None else []
    output: list[dict[str, Any]] = []
    for call in calls:
        items = output_items(records[call.call_id])
        items[-1].update(
            prompt_token_ids=call.prompt_token_ids,
            generation_token_ids=call.generation_token_ids,
            generation_log_probs=call.generation_log_probs,
        )
        output.extend(items)
    model = trajectory.calls[-1].model if len(trajectory.calls) else ""
    return GymResponse(
        response_object(f"resp_{trajectory.session_id}", model, output),
        trace.trace_id if trace is not None else "",
        calls,
        len(trajectory.traces) - (trace is not None),
    )


def final_response(records: list[common_pb2.CallRecord], response_id: str) -> dict[str, Any]:
    """The session's final reply as a Responses-API response: the items of its last call that
    produced a response (no item when none did)."""
    answered = [record for record in records if record.response_body and not record.error]
    output = output_items(answered[-1]) if answered else []
    return response_object(response_id, answered[-1].model if answered else "", output)


def response_object(response_id: str, model: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses-API response object with `output`, as NeMo Gym validates it."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "status": "completed",
    }


def output_items(record: common_pb2.CallRecord) -> list[dict[str, Any]]:
    """One call's reply as Responses-API output items (reasoning, message, function calls), read
    from its response body in the call's dialect. Never empty: a call whose body is gone or unreadable
    gets one empty message, so its token fields still have an item to ride on."""
    try:
        body = json.loads(record.response_body) if record.response_body else {}
    except ValueError:
        body = {}
    parse = _PARSERS.get(record.dialect)
    items = parse(body, record.call_id) if parse is not None and isinstance(body, dict) else []
    return items or [_message(record.call_id, "")]


def _message(call_id: str, text: str) -> dict[str, Any]:
    return {
        "id": f"msg_{call_id}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning(call_id: str, text: str) -> dict[str, Any]:
    return {"id": f"rs_{call_id}", "type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def _function_call(call_id: str, index: int, tool_call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"fc_{call_id}_{index}",
        "type": "function_call",
        "call_id": tool_call_id or f"call_{call_id}_{index}",
        "name": name,
        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        "status": "completed",
    }


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _chat_items(body: dict, call_id: str) -> list[dict[str, Any]]:
    choices = body.get("choices") or [{}]
    message = choices[0].get("message") or {}
    items = []
    if reasoning := message.get("reasoning_content") or message.get("reasoning"):
        items.append(_reasoning(call_id, str(reasoning)))
    if text := _text_of(message.get("content")):
        items.append(_message(call_id, text))
    for index, tool_call in enumerate(message.get("tool_calls") or []):
        function = tool_call.get("function") or {}
        items.append(
            _function_call(
                call_id, index, tool_call.get("id", ""), function.get("name", ""), function.get("arguments", "")
            )
        )
    return items


def _responses_items(body: dict, call_id: str) -> list[dict[str, Any]]:
    items = []
    for index, item in enumerate(body.get("output") or []):
        kind = item.get("type")
        if kind == "message":
            items.append(_message(call_id, _text_of(item.get("content"))))
        elif kind == "function_call":
            items.append(
                _function_call(call_id, index, item.get("call_id", ""), item.get("name", ""), item.get("arguments", ""))
            )
        elif kind == "reasoning":
            text = _text_of(item.get("summary")) or _text_of(item.get("content"))
            items.append(_reasoning(call_id, text))
    return items


def _anthropic_items(body: dict, call_id: str) -> list[dict[str, Any]]:
    items = []
    for index, block in enumerate(body.get("content") or []):
        kind = block.get("type")
        if kind == "text":
            items.append(_message(call_id, block.get("text", "")))
        elif kind == "tool_use":
            items.append(
                _function_call(call_id, index, block.get("id", ""), block.get("name", ""), block.get("input", {}))
            )
        elif kind == "thinking":
            items.append(_reasoning(call_id, block.get("thinking", "")))
    return items


def _google_items(body: dict, call_id: str) -> list[dict[str, Any]]:
    candidates = body.get("candidates") or [{}]
    items = []
    for index, part in enumerate((candidates[0].get("content") or {}).get("parts") or []):
        if "functionCall" in part:
            call = part["functionCall"]
            items.append(_function_call(call_id, index, call.get("id", ""), call.get("name", ""), call.get("args", {})))
        elif part.get("thought"):
            items.append(_reasoning(call_id, part.get("text", "")))
        elif "text" in part:
            items.append(_message(call_id, part["text"]))
    return items


_PARSERS = {
    common_pb2.DIALECT_OPENAI_CHAT: _chat_items,
    common_pb2.DIALECT_OPENAI_RESPONSES: _responses_items,
    common_pb2.DIALECT_ANTHROPIC_MESSAGES: _anthropic_items,
    common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT: _google_items,
}
