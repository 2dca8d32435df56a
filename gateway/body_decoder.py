"""Request bodies as JSON: read as Python's json module reads them, and the large values a harness
sends with every call (its tools, its system prompt) read once per gateway.

orjson reads, the standard library where orjson would refuse or differ; a known value's text is read
as a marker and the place takes the known value. Why that is exact: docs/design/gateway-pipeline.md.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.dialects.base import ErrorKind, GatewayError

# Where the dialects keep what a harness repeats: tools (all four), Anthropic's `system`, Gemini's
# `systemInstruction` (either spelling), the Responses API's `instructions`, and the first item of
# the conversation (a system or developer message: Qwen Code's is 38 kB, Codex's 17 kB).
KNOWN_PLACES = (
    "tools",
    "system",
    "systemInstruction",
    "system_instruction",
    "instructions",
    "messages[0]",
    "input[0]",
    "contents[0]",
)
# Smaller values cost less to read than to look up.
MIN_KNOWN_BYTES = 2048
# Bounds of what a gateway keeps per place: a few harnesses' configurations. Per place, so that
# first messages that differ in every session cannot push a harness's tools out.
MAX_KNOWN_VALUES = 16
MAX_KNOWN_BYTES = 4 * 1024 * 1024
# Known texts are found by their first bytes after the member's name, then compared whole.
PREFIX_BYTES = 64
# Texts orjson writes otherwise, by their first bytes: not looked for again.
MAX_UNMATCHED = 256
# Where the dialects keep a conversation's items: Chat Completions' and Anthropic's `messages`, the
# Responses API's `input`, Gemini's `contents`.
CONVERSATION_MEMBERS = ("messages", "input", "contents")
# A session's conversations kept (its main one and a side call's), and the longest text kept of one:
# past it, later calls read it all. The items read from a text take a few times its size in memory.
MAX_CONVERSATIONS = 2
MAX_CONVERSATION_BYTES = 2 * 1024 * 1024

# 19 digits in a row: perhaps an integer past 64 bits, which orjson reads as a float.
_DIGITS_AS_ZEROS_OTHERS_AS_ONES = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x31 for byte in range(256))
_HUGE_INTEGER = b"0" * 19
_MINUS = ord("-")
_JSON_WHITESPACE = b" \t\r\n"
_BEFORE_A_VALUE = b":,["
_MAX_SPACES_LOOKED_AT = 64
# A \uD800-\uDFFF escape: half of a surrogate pair, or, alone, no character at all.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Characters of a string value that JSON writes as up to 6 bytes each (\u001f): a string shorter
# than this share of MIN_KNOWN_BYTES is never written that long.
_MAX_BYTES_PER_CHARACTER = 6


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; INVALID_REQUEST for anything else."""
    return _read(raw)[0]


def _read(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The body's object, and whether orjson read it (else the standard library did)."""
    body = _read_fast(raw)
    if body is not None:
        return body, True
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    # JSON lets "\ud800" escape half of a surrogate pair alone, which decodes to no character at
    # all: the tokenizer rejects it and no reply or record quoting it encodes as UTF-8.
    if _unpaired_surrogate_escape(raw):
        raise GatewayError(
            ErrorKind.INVALID_REQUEST, "the request body holds an unpaired surrogate escape (\\ud800-\\udfff)"
        )
    return body, False


def _read_fast(raw: bytes) -> Any:
    """What orjson reads from `raw` when it reads it as the standard library would; else None."""
    if _may_hold_huge_integer(raw):
        return None
    try:
        body = orjson.loads(raw)  # it refuses unpaired surrogates itself
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    return body


@dataclass(frozen=True)
class _Place:
    """Where a known value may be: a member of the body, or the first item of a member's array."""

    member: str
    first_item: bool

    @classmethod
    def of(cls, name: str) -> _Place:
        member = name.removesuffix("[0]")
        return cls(member, member != name)

    def lead(self) -> bytes:
        """The JSON text that comes right before the value, written compact."""
        return orjson.dumps(self.member) + (b":[" if self.first_item else b":")

    def get(self, body: dict[str, Any]) -> Any:
        value = body.get(self.member)
        if not self.first_item:
            return value
        return value[0] if isinstance(value, list) and value else None

    def put(self, body: dict[str, Any], value: Any) -> None:
        if self.first_item:
            body[self.member][0] = value
        else:
            body[self.member] = value


@dataclass(frozen=True, eq=False)
class _Known:
    place: _Place
    text: bytes  # the value's JSON text, as orjson writes it and the harness sent it
    value: Any  # what the text reads to; shared, never changed


class _KnownAt:
    """The known values of one place, least recently used first, found by their texts' first bytes."""

    def __init__(self, place: _Place, marker: str) -> None:
        self.place = place
        self.lead = place.lead()
        self.marker = marker
        self.marker_text = orjson.dumps(marker)
        self.by_prefix: dict[bytes, list[_Known]] = {}
        self.recent: OrderedDict[int, _Known] = OrderedDict()
        self.bytes = 0

    def at(self, raw: bytes, start: int) -> _Known | None:
        for known in self.by_prefix.get(raw[start : start + PREFIX_BYTES], ()):
            if raw.startswith(known.text, start):
                return known
        return None

    def keep(self, known: _Known, max_values: int, max_bytes: int) -> None:
        self.by_prefix.setdefault(known.text[:PREFIX_BYTES], []).insert(0, known)
        self.recent[id(known)] = known
        self.bytes += len(known.text)
        while len(self.recent) > max_values or self.bytes > max_bytes:
            _, oldest = self.recent.popitem(last=False)
            same_prefix = self.by_prefix[oldest.text[:PREFIX_BYTES]]
            same_prefix.remove(oldest)
            if not same_prefix:
                del self.by_prefix[oldest.text[:PREFIX_BYTES]]
            self.bytes -= len(oldest.text)


class KnownConversations:
    """One session's conversations as its latest calls sent them: the JSON text of their items
    (compact, without the brackets) and the items that text reads to, shared and never changed.

    A harness sends its whole conversation again with every call. A later call whose conversation
    starts with a known text (its earlier items, as sent before) reads only the items it adds, and
    gets the earlier items as the same objects, which lets a dialect convert only the new ones
    (`gateway.dialects.base.ConversationFold`). Two conversations per session, for a harness
    whose side calls (a title, a summary) share its session; the least recent goes first.
    """

    def __init__(self) -> None:
        self.entries: list[_Conversation] = []  # most recent first


@dataclass
class _Conversation:
    place: _Place  # its first item: the text follows the place's lead
    text: bytes
    items: list[Any]


@dataclass
class _Substitution:
    """A known text in a body, and how its marker's place takes the known value."""

    start: int
    end: int
    marker: str
    marker_text: bytes
    place: _Place
    value: Any
    spliced: bool = False  # the marker stands for the items `value` holds, not for one value
    known_at: _KnownAt | None = None  # where a known value is kept (not a conversation)

    def put(self, body: dict[str, Any]) -> bool:
        if self.place.get(body) != self.marker:
            return False
        if self.spliced:
            body[self.place.member][0:1] = self.value
        else:
            self.place.put(body, self.value)
        return True


class BodyDecoder:
    """`decode_body` that reads the known values of `places` once (see the module docstring)."""

    def __init__(
        self,
        places: tuple[str, ...] = KNOWN_PLACES,
        *,
        min_bytes: int = MIN_KNOWN_BYTES,
        max_values: int = MAX_KNOWN_VALUES,
        max_bytes: int = MAX_KNOWN_BYTES,
    ) -> None:
        # Letters only: no digit run of a marker can look like a huge integer to `_read_fast`.
        secret = "".join(secrets.choice(string.ascii_letters) for _ in range(32))
        self._places = [_KnownAt(_Place.of(name), f"polar-known-value-{secret}-{name}") for name in places]
        self._conversation_marker = f"polar-known-value-{secret}-conversation"
        self._conversation_marker_text = orjson.dumps(self._conversation_marker)
        self._min_bytes = max(min_bytes, PREFIX_BYTES)  # a text is found by its first PREFIX_BYTES
        self._max_values = max_values
        self._max_bytes = max_bytes
        self._unmatched: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    @property
    def known_values(self) -> int:
        return sum(len(place.recent) for place in self._places)

    def decode(self, raw: bytes, conversations: KnownConversations | None = None) -> dict[str, Any]:
        """The request's JSON object, equal to `decode_body(raw)`; INVALID_REQUEST for anything else.
        `conversations`: the session's, when the body is a call of a session."""
        spliced = self._find_conversation(raw, conversations) if conversations is not None else None
        found = self._find(raw, spliced)
        body = self._read_around(raw, found) if found else None
        if body is None:
            body, by_orjson = _read(raw)
            if not by_orjson:
                return body
            found, spliced = [], None
        self._learn(raw, body, [item.known_at for item in found if item.known_at is not None])
        if conversations is not None:
            self._remember_conversation(raw, body, conversations, spliced)
        return body

    def _find_conversation(self, raw: bytes, conversations: KnownConversations) -> _Substitution | None:
        """The session's known conversation that the body's conversation starts with, if any."""
        for known in conversations.entries:
            lead = known.place.lead()
            at = raw.find(lead)
            if at == -1:
                continue
            start = at + len(lead)
            end = start + len(known.text)
            if raw.startswith(known.text, start) and raw[end : end + 1] in (b",", b"]"):
                marker, marker_text = self._conversation_marker, self._conversation_marker_text
                return _Substitution(start, end, marker, marker_text, known.place, known.items, spliced=True)
        return None

    def _find(self, raw: bytes, spliced: _Substitution | None) -> list[_Substitution]:
        """Where known texts follow their place's lead (one text per place at most), and the
        session's known conversation, which stands for its first item too."""
        found = [spliced] if spliced is not None else []
        for place in self._places:
            if not place.recent or (spliced is not None and place.place == spliced.place):
                continue
            at = raw.find(place.lead)
            while at != -1:
                start = at + len(place.lead)
                known = place.at(raw, start)
                if known is not None:
                    end = start + len(known.text)
                    found.append(
                        _Substitution(
                            start, end, place.marker, place.marker_text, place.place, known.value, known_at=place
                        )
                    )
                    place.recent.move_to_end(id(known))
                    break
                at = raw.find(place.lead, start)
        return found

    def _read_around(self, raw: bytes, found: list[_Substitution]) -> dict[str, Any] | None:
        """The body read with each found text replaced by its marker and the markers then by the
        known values; None when a marker did not land in its place (or the rest is not what orjson
        reads as the standard library does), and the body must be read whole."""
        found.sort(key=lambda item: item.start)
        parts, end = [], 0
        for item in found:
            if item.start < end:
                return None  # one known text inside another
            parts += (raw[end : item.start], item.marker_text)
            end = item.end
        parts.append(raw[end:])
        try:
            body = _read_fast(b"".join(parts))
        except GatewayError:
            return None
        if body is None or not all([item.put(body) for item in found]):
            return None
        return body

    def _learn(self, raw: bytes, body: dict[str, Any], known: list[_KnownAt]) -> None:
        """Keep the long values of the places (but those `known` already), where they are written as
        orjson writes them."""
        for place in self._places:
            if place in known:
                continue
            value = place.place.get(body)
            if not isinstance(value, (dict, list, str)):
                continue
            if isinstance(value, str) and len(value) * _MAX_BYTES_PER_CHARACTER + 2 < self._min_bytes:
                continue
            at = raw.find(place.lead)
            if at == -1:
                continue
            start = at + len(place.lead)
            unmatched = (place.marker, raw[start : start + PREFIX_BYTES])
            if unmatched in self._unmatched or place.at(raw, start) is not None:
                continue
            try:
                text = orjson.dumps(value)
            except orjson.JSONEncodeError:
                continue
            if not self._min_bytes <= len(text) <= self._max_bytes:
                continue
            if raw.find(place.lead + text) != -1:
                place.keep(_Known(place.place, text, value), self._max_values, self._max_bytes)
            else:
                self._unmatched[unmatched] = None
                if len(self._unmatched) > MAX_UNMATCHED:
                    self._unmatched.popitem(last=False)

    def _remember_conversation(
        self, raw: bytes, body: dict[str, Any], conversations: KnownConversations, spliced: _Substitution | None
    ) -> None:
        """Keep the body's conversation for the session's next call: the known text it started with
        and the text of its new items, as orjson writes them, when that is what the body holds."""
        member = next((name for name in CONVERSATION_MEMBERS if isinstance(body.get(name), list)), None)
        if member is None or not body[member]:
            return
        items = body[member]
        known = None
        if spliced is not None:
            known = next(entry for entry in conversations.entries if entry.items is spliced.value)
        try:
            if known is not None:
                added = items[len(known.items) :]
                text = known.text + (b"," + orjson.dumps(added)[1:-1] if added else b"")
            else:
                text = orjson.dumps(items)[1:-1]
        except orjson.JSONEncodeError:
            return
        if len(text) > MAX_CONVERSATION_BYTES:
            return
        place = _Place(member, first_item=True)
        lead = place.lead()
        at = raw.find(lead)
        if at == -1:
            return
        start = at + len(lead)
        end = start + len(text)
        if raw[end : end + 1] != b"]" or not raw.startswith(text, start):
            return  # written otherwise than orjson writes it: read in full next time
        if known is not None:
            conversations.entries.remove(known)
        conversations.entries.insert(0, _Conversation(place, text, items))
        del conversations.entries[MAX_CONVERSATIONS:]


def _may_hold_huge_integer(raw: bytes) -> bool:
    """Whether a JSON text may hold an integer of 19 digits or more, which orjson would read as a
    float past 64 bits. A run of 19 digits counts only where JSON lets a number begin: at the start,
    or after `:`, `,` or `[`, with whitespace and a minus sign between (past a few dozen bytes of
    whitespace, it counts). A run inside a string, such as a nanosecond timestamp in a tool's
    output, cannot be a number: its body still goes to orjson, and so does every later call of its
    session, which sends it again."""
    kinds = raw.translate(_DIGITS_AS_ZEROS_OTHERS_AS_ONES)
    at = kinds.find(_HUGE_INTEGER)
    while at != -1:  # `at` starts a run of digits: the search starts where the last run ended
        before = at - 1
        if before >= 0 and raw[before] == _MINUS:
            before -= 1
        spaces = 0
        while before >= 0 and raw[before] in _JSON_WHITESPACE:
            before, spaces = before - 1, spaces + 1
        if before < 0 or raw[before] in _BEFORE_A_VALUE or spaces > _MAX_SPACES_LOOKED_AT:
            return True
        end = kinds.find(b"1", at)
        if end == -1:
            return False
        at = kinds.find(_HUGE_INTEGER, end)
    return False


def _unpaired_surrogate_escape(raw: bytes) -> bool:
    """Whether JSON that parsed holds a surrogate escape without its other half.

    Pairs are common (clients that escape everything outside ASCII write an emoji as two escapes), so
    only the escapes themselves are visited, not the whole body again. In valid JSON every backslash
    starts an escape: one preceded by an odd run of backslashes is an escaped backslash's text.
    """
    low_expected_at = -1
    for match in _SURROGATE_ESCAPE.finditer(raw):
        start = match.start()
        before = start
        while before and raw[before - 1] == 0x5C:  # backslash
            before -= 1
        if (start - before) % 2:
            continue  # "\\ud800": text, not an escape
        high = int(raw[start + 2 : start + 6], 16) < 0xDC00
        if start == low_expected_at:
            if high:
                return True  # a high half where its low half should be
            low_expected_at = -1
        elif low_expected_at != -1 or not high:
            return True  # a high half without its low half, or a low half alone
        else:
            low_expected_at = match.end()
    return low_expected_at != -1
