"""Sampled tokens of one call → client text → stop strings → parse events, as they arrive.

`OutputAssembler` is the gateway's text side: it keeps the sampled ids and logprobs for the record,
decodes them incrementally (multi-byte characters complete with the token that ends them), ends the
output at the first client stop string to complete (`StopScanner`), and feeds the text to the model
family's streaming parser. For clients that disabled tools, tool calls go back to text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from gateway.chat_format import tool_call_text
from gateway.conversation import ToolCall
from gateway.parsers import (
    ParseEvent,
    StreamingParser,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)


class StopScanner:
    """Finds the first client stop string to complete in text that arrives in pieces.

    `feed` returns the text that is certainly before any stop string, holding back a suffix that may
    be the start of one, and the stop string once one is complete (the text returned then ends right
    before it, and everything after it is dropped).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def feed(self, piece: str) -> tuple[str, str | None]:
        if not self._stops:
            return piece, None
        text = self._held + piece
        # The stop that completes first wins, as it would if the text came one character at a time.
        found = [(index + len(stop), index, stop) for stop in self._stops if (index := text.find(stop)) != -1]
        if found:
            _, index, stop = min(found)
            self._held = ""
            return text[:index], stop
        held = _longest_stop_prefix(text, self._stops)
        self._held = text[len(text) - held :]
        return text[: len(text) - held], None

    def flush(self) -> str:
        """The held-back text, at the end of the output (no stop string completed)."""
        held, self._held = self._held, ""
        return held


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    longest = min(len(text), max(len(stop) for stop in stops) - 1)
    for size in range(longest, 0, -1):
        if any(stop.startswith(text[-size:]) for stop in stops):
            return size
    return 0


def tool_calls_as_text(events: list[ParseEvent]) -> list[ParseEvent]:
    """The events with each tool call turned back into its text, for clients that disabled tools."""
    converted: list[ParseEvent] = []
    pending: dict[int, tuple[ToolCallStart, str]] = {}
    for event in events:
        if isinstance(event, ToolCallStart):
            pending[event.index] = (event, "")
        elif isinstance(event, ToolCallArgumentsDelta):
            start, arguments = pending[event.index]
            pending[event.index] = (start, arguments + event.arguments)
        elif isinstance(event, ToolCallEnd):
            start, arguments = pending.pop(event.index)
            call = ToolCall(start.id, start.name, json.loads(arguments))
            converted.append(TextDelta("\n" + tool_call_text(call)))
        else:
            converted.append(event)
    return converted


class OutputAssembler:
    """Sampled tokens of one call → recorded ids and logprobs, client text, parse events.

    Tokens are decoded one by one (a token that ends inside a multi-byte character shows its text with
    the token that completes it). Client stop strings end the output: the token that completed the
    stop is the last one kept, and the text is cut before the stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        parser: StreamingParser,
        *,
        stops: Sequence[str] = (),
        forced_text: str = "",
        parse_tool_calls: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._decoded: list[str] = []  # text the decode stream produced so far, piece by piece
        self._scanner = StopScanner(stops)
        self._parser = parser
        self._parse_tool_calls = parse_tool_calls
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.events: list[ParseEvent] = []
        self.stop_sequence: str | None = None
        # The forced opening is prompt, but the parser must read it so opening + sample is one call.
        self._pending = self._convert(parser.feed(forced_text)) if forced_text else []

    @property
    def stopped(self) -> bool:
        return self.stop_sequence is not None

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> list[ParseEvent]:
        """Events these tokens make certain; tokens after a completed stop string are dropped.

        Tokens are decoded and scanned for stops one by one, but their text reaches the parser in one
        piece: an engine message carries every token ready since the last, and the parser's cost is
        per piece, so a message of many tokens makes one text delta, not one per token.
        """
        events, self._pending = self._pending, []
        keep = self._keep if self._scanner.active else self._keep_without_stops
        text = keep(token_ids, logprobs)
        if text:
            events += self._convert(self._parser.feed(text))
        self.events += events
        return events

    def _keep_without_stops(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> str:
        """Every token kept, decoded step by step in one pass; their text."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        step, tokenizer = self._decoder.step, self._tokenizer
        text = "".join([step(tokenizer, token_id) or "" for token_id in token_ids])
        self._decoded.append(text)
        return text

    def _keep(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> str:
        """The tokens up to the one that completes a stop string; their text before any stop."""
        texts: list[str] = []
        for token_id, logprob in zip(token_ids, logprobs):
            if self.stopped:
                break
            self.token_ids.append(token_id)
            self.logprobs.append(logprob)
            piece = self._decoder.step(self._tokenizer, token_id) or ""
            self._decoded.append(piece)
            text, self.stop_sequence = self._scanner.feed(piece)
            texts.append(text)
        return "".join(texts)

    def finish(self) -> list[ParseEvent]:
        """The events held back until the end of the output."""
        events, self._pending = self._pending, []
        if not self.stopped:
            text, self.stop_sequence = self._scanner.feed(self._undecoded_tail())
            if not self.stopped:
                text += self._scanner.flush()
            if text:
                events += self._convert(self._parser.feed(text))
        events += self._convert(self._parser.finish())
        self.events += events
        return events

    def _undecoded_tail(self) -> str:
        # Bytes of an unfinished character stay inside the decode stream; the whole decode shows them
        # (as replacement characters), so the client's text covers every sampled id.
        whole = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        decoded = "".join(self._decoded)
        return whole[len(decoded) :] if whole.startswith(decoded) else ""

    def _convert(self, events: list[ParseEvent]) -> list[ParseEvent]:
        return events if self._parse_tool_calls else tool_calls_as_text(events)
