"""Trajectories as supervised fine-tuning rows: the conversation as the harness saw it, and its tokens.

One row per trace (a chain of calls merged into one token sequence; a session that forked has
several). Its conversation is the chain's last call: that call's request, read by the gateway's own
dialect module (`messages` and `tools` in the OpenAI Chat Completions shape, whatever dialect the
harness spoke), followed by that call's reply as an assistant message read back from its response
body. Its token view is the trace itself: `input_ids`, `loss_mask` (1 exactly where the engine
sampled the token) and `logprobs` (the behaviour log-probability of each sampled token, 0 elsewhere).

Row fields:
    task_id, attempt, session_id, trace_id, reward, outcome   where the row comes from
    messages    [{"role", "content", "reasoning_content"?, "tool_calls"?, "tool_call_id"?, "name"?}]
    tools       the tools offered, as a JSON string of OpenAI tool objects (a JSON schema per tool
                has no fixed shape, and a column must: as text every row has one schema)
    input_ids, loss_mask, logprobs   the token view, same length
    metadata    the task's metadata, as a JSON string (free-form keys, for the same reason)

Formats: JSON Lines (one row a line), Parquet (`pyarrow`), or a Hugging Face `datasets` folder
(`Dataset.save_to_disk`); the last two need the `export` extra (`pip install polar[export]`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.conversation import Message, ToolCall, ToolSpec
from gateway.parsers import CALL_OPEN
from gateway.replay import NotReplayable, recorded_request
from polar.v1 import common_pb2

FORMATS = ("jsonl", "parquet", "datasets")


class ExportError(ValueError):
    """A trajectory or call that cannot be exported; the message names it."""


# ----------------------------------------------------------------------------------- conversations


def request_conversation(call: common_pb2.CallRecord) -> tuple[tuple[Message, ...], tuple[ToolSpec, ...]]:
    """The messages and tools of a call's request, read by its dialect as the gateway read them."""
    try:
        request = recorded_request(call)
        body = json.loads(call.request_body)
        parsed = request.dialect.parse_request(body, request.route)
    except NotReplayable as exc:
        raise ExportError(str(exc)) from None
    except Exception as exc:
        raise ExportError(f"call {call.call_id}: its request body cannot be read: {exc}") from None
    return parsed.conversation.messages, parsed.conversation.tools


def reply_message(call: common_pb2.CallRecord) -> Message:
    """The assistant turn a call's response body holds (its non-streaming shape, also for streams)."""
    if not call.response_body:
        raise ExportError(f"call {call.call_id} has no response body")
    try:
        body = json.loads(call.response_body)
        return _READERS[common_pb2.Dialect.Name(call.dialect)](body)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ExportError(
            f"call {call.call_id}: its response body cannot be read: {type(exc).__name__}: {exc}"
        ) from None


def _openai_chat_reply(body: Mapping[str, Any]) -> Message:
    message = body["choices"][0]["message"]
    calls = tuple(
        ToolCall(c.get("id", ""), c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
        for c in message.get("tool_calls") or ()
    )
    return Message("assistant", message.get("content") or "", message.get("reasoning_content") or "", calls)


def _openai_responses_reply(body: Mapping[str, Any]) -> Message:
    content, reasoning, calls = [], [], []
    for item in body.get("output") or ():
        if item["type"] == "message":
            content += [part.get("text", "") for part in item.get("content") or () if part.get("type") == "output_text"]
        elif item["type"] == "reasoning":
            reasoning += [part.get("text", "") for part in (item.get("content") or item.get("summary") or ())]
        elif item["type"] == "function_call":
            calls.append(ToolCall(item.get("call_id", ""), item["name"], json.loads(item.get("arguments") or "{}")))
    return Message("assistant", "\n".join(content), "\n".join(reasoning), tuple(calls))


def _anthropic_reply(body: Mapping[str, Any]) -> Message:
    content, reasoning, calls = [], [], []
    for block in body.get("content") or ():
        if block["type"] == "text":
            content.append(block["text"])
        elif block["type"] == "thinking":
            reasoning.append(block.get("thinking", ""))
        elif block["type"] == "tool_use":
            calls.append(ToolCall(block.get("id", ""), block["name"], dict(block.get("input") or {})))
    return Message("assistant", "\n".join(content), "\n".join(reasoning), tuple(calls))


def _gemini_reply(body: Mapping[str, Any]) -> Message:
    content, reasoning, calls = [], [], []
    for part in body["candidates"][0].get("content", {}).get("parts") or ():
        if "functionCall" in part:
            call = part["functionCall"]
            calls.append(ToolCall(call.get("id", ""), call["name"], dict(call.get("args") or {})))
        elif part.get("thought"):
            reasoning.append(part.get("text", ""))
        elif "text" in part:
            content.append(part["text"])
    return Message("assistant", "\n".join(content), "\n".join(reasoning), tuple(calls))


_READERS = {
    "DIALECT_OPENAI_CHAT": _openai_chat_reply,
    "DIALECT_OPENAI_RESPONSES": _openai_responses_reply,
    "DIALECT_ANTHROPIC_MESSAGES": _anthropic_reply,
    "DIALECT_GOOGLE_GENERATE_CONTENT": _gemini_reply,
}


def openai_message(message: Message) -> dict[str, Any]:
    """One message in the OpenAI Chat Completions shape (the keys that apply to its role only)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def openai_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


# --------------------------------------------------------------------------------------------- rows


def unparsed_tool_call(call: common_pb2.CallRecord) -> bool:
    """Whether the call's reply holds a tool call the gateway could not parse: the parser leaves a
    malformed `<tool_call>` block (bad JSON, cut short) in the reply's text rather than failing."""
    try:
        message = reply_message(call)
    except ExportError:
        return False
    return CALL_OPEN in message.content


def failed_calls(trajectory: common_pb2.Trajectory) -> list[str]:
    """Why calls of the trajectory failed, one line each: an engine or gateway error, or a tool call
    that failed to parse. An attempt with any is never accepted."""
    problems = []
    for call in trajectory.calls:
        if call.error or call.finish_reason == common_pb2.FINISH_REASON_ERROR:
            problems.append(f"call {call.call_id} failed: {call.error or 'engine error'}")
        elif unparsed_tool_call(call):
            problems.append(f"call {call.call_id}: a tool call in its reply failed to parse")
    return problems


def trajectory_rows(trajectory: common_pb2.Trajectory, *, task_id: str = "", attempt: int = 0) -> list[dict[str, Any]]:
    """The SFT rows of one trajectory, one per trace (see the module docstring)."""
    calls = {call.call_id: call for call in trajectory.calls}
    rows = []
    for trace in trajectory.traces:
        sampled = [s for s in trace.segments if s.kind == common_pb2.TraceSegment.KIND_SAMPLED]
        if not sampled:
            continue
        last = calls.get(sampled[-1].call_id)
        if last is None:
            raise ExportError(
                f"trajectory {trajectory.trajectory_id}: trace {trace.trace_id} names call {sampled[-1].call_id}, which it lacks"
            )
        messages, tools = request_conversation(last)
        rows.append(
            {
                "task_id": task_id or trajectory.task_id,
                "attempt": attempt,
                "session_id": trajectory.session_id,
                "trace_id": trace.trace_id,
                "reward": trajectory.reward,
                "outcome": common_pb2.SessionOutcome.Name(trajectory.outcome).removeprefix("SESSION_OUTCOME_").lower(),
                "messages": [openai_message(m) for m in (*messages, reply_message(last))],
                "tools": json.dumps([openai_tool(t) for t in tools]),
                "input_ids": list(trace.token_ids),
                "loss_mask": list(trace.loss_mask),
                "logprobs": [round(float(x), 6) for x in trace.behaviour_logprobs],
                "metadata": json.dumps(dict(trajectory.metadata), sort_keys=True),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------ writers


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: Path, *, append: bool = False) -> int:
    count = 0
    with path.open("a" if append else "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def convert(jsonl: Path, fmt: str, out: Path) -> Path:
    """The rows of a JSON Lines file written again as `fmt` at `out` (jsonl: the file itself)."""
    if fmt == "jsonl":
        return jsonl
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    try:
        import datasets
    except ModuleNotFoundError:
        raise ExportError(f"--format {fmt} needs the 'datasets' package (pip install 'polar[export]')") from None
    dataset = (
        datasets.Dataset.from_list(list(read_jsonl(jsonl))) if jsonl.stat().st_size else datasets.Dataset.from_dict({})
    )
    if fmt == "parquet":
        dataset.to_parquet(str(out))
    else:
        dataset.save_to_disk(str(out))
    return out


def output_path(base: Path, fmt: str) -> Path:
    """Where `convert` writes a format next to the JSON Lines file `base` (NAME.jsonl)."""
    return {"jsonl": base, "parquet": base.with_suffix(".parquet"), "datasets": base.with_suffix("")}[fmt]


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def rows_of(trajectories: Sequence[common_pb2.Trajectory], min_reward: float) -> Iterator[dict[str, Any]]:
    """`polar export`: the rows of every completed trajectory whose reward reaches `min_reward` and
    no call of which failed."""
    for trajectory in trajectories:
        if trajectory.outcome != common_pb2.SESSION_OUTCOME_COMPLETED or trajectory.reward < min_reward:
            continue
        if failed_calls(trajectory):
            continue
        yield from trajectory_rows(trajectory, attempt=trajectory.attempt)
