"""Output parsers: sampled text back into content, reasoning and tool calls, per model family.

The `hermes` grammar (Hermes / Qwen2.5 tool calls, Qwen3 / DeepSeek reasoning):

- `<think>…</think>` is reasoning; an unclosed `<think>` makes the rest of the output reasoning. Tags
  inside reasoning are reasoning text: a `<tool_call>` while thinking is not a call.
- `<tool_call>…</tool_call>` whose body is a JSON object with a non-empty string `name` and an object
  `arguments` is a tool call. Any other body (malformed JSON, a missing `</tool_call>` because the
  output was cut) leaves the whole block as content text, never an error.
- Everything else is content. Content and reasoning are each split into segments by the blocks around
  them; every segment is stripped of surrounding whitespace (the newlines the template puts around
  tags) and the non-empty ones are joined with `\\n`.

`HermesParser.parse` reads a whole output; `HermesParser.stream` reads it as deltas arrive and emits
events as early as it can without ever emitting something a later delta would contradict: it holds
back only a suffix that could be the start of a tag, trailing whitespace (which the end of a segment
drops), and an open `<tool_call>` block until its `</tool_call>` decides whether it is a call. The
events of any chunking fold (`collect`) into exactly what `parse` returns.

For a forced tool choice the gateway feeds the forced opening (prompt text) before the sampled text, so
opening + sample parse as one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.conversation import Message, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
OPENING_TAGS = (THINK_OPEN, CALL_OPEN)


class UnknownOutputParserError(LookupError):
    """No output parser is registered under that name."""


@dataclass(frozen=True)
class ParsedOutput:
    """One sampled output, understood."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def message(self) -> Message:
        return Message("assistant", self.content, self.reasoning, self.tool_calls)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    # A piece of the arguments' JSON text; the pieces of one call concatenate to a JSON object.
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


ParseEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


class StreamingParser(Protocol):
    def feed(self, delta: str) -> list[ParseEvent]:
        """Events that the text so far makes certain."""

    def finish(self) -> list[ParseEvent]:
        """Events for whatever was held back, at the end of the output."""


class OutputParser(Protocol):
    name: str

    def parse(self, text: str, *, call_id: str) -> ParsedOutput:
        """The whole output of the call `call_id`."""

    def stream(self, *, call_id: str) -> StreamingParser:
        """A parser for the output of the call `call_id`, fed as it is sampled."""


def tool_call_id(call_id: str, index: int) -> str:
    """The id of a call's index-th tool call: deterministic, so a later request can be matched to it."""
    return f"call_{call_id}_{index}"


def collect(events: list[ParseEvent]) -> ParsedOutput:
    """Fold streaming events into the output they describe."""
    content = "".join(event.text for event in events if isinstance(event, TextDelta))
    reasoning = "".join(event.text for event in events if isinstance(event, ReasoningDelta))
    starts = [event for event in events if isinstance(event, ToolCallStart)]
    arguments = {start.index: "" for start in starts}
    for event in events:
        if isinstance(event, ToolCallArgumentsDelta):
            arguments[event.index] += event.arguments
    calls = tuple(ToolCall(start.id, start.name, json.loads(arguments[start.index])) for start in starts)
    return ParsedOutput(content, reasoning, calls)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_tool_call_body(body: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a `<tool_call>` body, or None when it is not a well-formed call."""
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # a sample nested past the parser's limit is no call either
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, arguments


def _join_segments(segments: list[str]) -> str:
    return "\n".join(stripped for stripped in (segment.strip() for segment in segments) if stripped)


def _next_opening(text: str, start: int) -> tuple[int, str] | None:
    found = [(index, tag) for tag in OPENING_TAGS if (index := text.find(tag, start)) != -1]
    return min(found) if found else None


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the tags."""
    longest = max(len(tag) for tag in tags) - 1
    # Runs on every sampled token: most tails hold no tag's first character, so nothing is held.
    tail = text[-longest:]
    if not any(tag[0] in tail for tag in tags):
        return 0
    for size in range(min(longest, len(text)), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in tags):
            return size
    return 0


class HermesParser:
    """`<think>` reasoning and `<tool_call>` JSON (see the module docstring)."""

    name = "hermes"

    def parse(self, text: str, *, call_id: str) -> ParsedOutput:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        segment = ""  # the content segment being read; invalid tool-call blocks stay inside it
        position = 0
        while (opening := _next_opening(text, position)) is not None:
            start, tag = opening
            segment += text[position:start]
            body_start = start + len(tag)
            closing = THINK_CLOSE if tag == THINK_OPEN else CALL_CLOSE
            end = text.find(closing, body_start)
            if tag == THINK_OPEN:
                content.append(segment)
                segment = ""
                reasoning.append(text[body_start:] if end == -1 else text[body_start:end])
                position = len(text) if end == -1 else end + len(closing)
                continue
            if end == -1:
                position = start
                break
            parsed = parse_tool_call_body(text[body_start:end])
            position = end + len(closing)
            if parsed is None:
                segment += text[start:position]
                continue
            content.append(segment)
            segment = ""
            calls.append(ToolCall(tool_call_id(call_id, len(calls)), *parsed))
        content.append(segment + text[position:])
        return ParsedOutput(_join_segments(content), _join_segments(reasoning), tuple(calls))

    def stream(self, *, call_id: str) -> HermesStream:
        return HermesStream(call_id)


class _Channel:
    """Emits one kind of text (content or reasoning) by segment, trimmed and joined as `parse` does."""

    def __init__(self, delta_type: type[TextDelta] | type[ReasoningDelta]) -> None:
        self._delta_type = delta_type
        self._in_segment = False  # the current segment has shown non-whitespace text
        self._pending_whitespace = ""  # trailing whitespace, dropped if the segment ends here
        self._emitted = False

    def write(self, text: str, events: list[ParseEvent]) -> None:
        if not self._in_segment:
            text = text.lstrip()
            if not text:
                return
            self._in_segment = True
            if self._emitted:
                text = "\n" + text
        body = text.rstrip()
        if not body:
            self._pending_whitespace += text
            return
        events.append(self._delta_type(self._pending_whitespace + body))
        self._pending_whitespace = text[len(body) :]
        self._emitted = True

    def end_segment(self) -> None:
        self._in_segment = False
        self._pending_whitespace = ""


class HermesStream:
    """Incremental `HermesParser`: feed text deltas, then finish."""

    def __init__(self, call_id: str) -> None:
        self._call_id = call_id
        self._mode = "text"  # text | reasoning | tool_call (inside an open <tool_call> block)
        self._buffer = ""  # text received but not yet turned into events
        self._scanned = 0  # in tool_call mode: how much of the buffer is known to hold no </tool_call>
        self._content = _Channel(TextDelta)
        self._reasoning = _Channel(ReasoningDelta)
        self._calls = 0

    def feed(self, delta: str) -> list[ParseEvent]:
        self._buffer += delta
        events: list[ParseEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._mode == "reasoning":
            self._reasoning.write(self._buffer, events)
        else:
            # An unclosed <tool_call> is text, like everything the stream held back.
            opening = CALL_OPEN if self._mode == "tool_call" else ""
            self._content.write(opening + self._buffer, events)
        self._buffer = ""
        self._content.end_segment()
        self._reasoning.end_segment()
        return events

    def _step(self, events: list[ParseEvent]) -> bool:
        """Consume what the buffer decides; True when a tag was consumed and the rest needs a look."""
        if self._mode == "text":
            return self._step_text(events)
        if self._mode == "reasoning":
            return self._step_reasoning(events)
        return self._step_tool_call(events)

    def _step_text(self, events: list[ParseEvent]) -> bool:
        opening = _next_opening(self._buffer, 0)
        if opening is None:
            self._emit_all_but_tag_start(self._content, OPENING_TAGS, events)
            return False
        start, tag = opening
        self._content.write(self._buffer[:start], events)
        self._buffer = self._buffer[start + len(tag) :]
        if tag == THINK_OPEN:
            self._content.end_segment()
            self._mode = "reasoning"
        else:
            self._mode, self._scanned = "tool_call", 0
        return True

    def _step_reasoning(self, events: list[ParseEvent]) -> bool:
        end = self._buffer.find(THINK_CLOSE)
        if end == -1:
            self._emit_all_but_tag_start(self._reasoning, (THINK_CLOSE,), events)
            return False
        self._reasoning.write(self._buffer[:end], events)
        self._reasoning.end_segment()
        self._buffer = self._buffer[end + len(THINK_CLOSE) :]
        self._mode = "text"
        return True

    def _step_tool_call(self, events: list[ParseEvent]) -> bool:
        end = self._buffer.find(CALL_CLOSE, self._scanned)
        if end == -1:
            # A </tool_call> can only appear overlapping the part not yet searched.
            self._scanned = max(0, len(self._buffer) - len(CALL_CLOSE) + 1)
            return False
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(CALL_CLOSE) :]
        self._mode = "text"
        parsed = parse_tool_call_body(body)
        if parsed is None:
            self._content.write(CALL_OPEN + body + CALL_CLOSE, events)
            return True
        self._content.end_segment()
        name, arguments = parsed
        index = self._calls
        self._calls += 1
        events.append(ToolCallStart(index, tool_call_id(self._call_id, index), name))
        events.append(ToolCallArgumentsDelta(index, json.dumps(arguments, ensure_ascii=False)))
        events.append(ToolCallEnd(index))
        return True

    def _emit_all_but_tag_start(self, channel: _Channel, tags: tuple[str, ...], events: list[ParseEvent]) -> None:
        held = _held_suffix(self._buffer, tags)
        channel.write(self._buffer[: len(self._buffer) - held], events)
        self._buffer = self._buffer[len(self._buffer) - held :]


OUTPUT_PARSERS: dict[str, OutputParser] = {"hermes": HermesParser()}


def get_output_parser(name: str) -> OutputParser:
    parser = OUTPUT_PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(OUTPUT_PARSERS))
        raise UnknownOutputParserError(f"no output parser {name!r}; known: {known}")
    return parser
