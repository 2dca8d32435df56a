"""Model-family chat formats: the conversation rendered to the token ids the model sees.

Each message is rendered on its own and the ids concatenated, so rendering k messages is a token
prefix of rendering k + 1, which lets `gateway.render` splice new turns after sampled ids. `hermes`
is ChatML with the Hermes / Qwen2.5 tool convention. Text is encoded once per gateway, line by line
through a cache all sessions share. The format and why it is exact: docs/design/rendering.md.
"""

from __future__ import annotations

import json
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, Protocol

import orjson

from gateway.conversation import Conversation, Message, ToolCall, ToolChoice, ToolSpec
from polar.codec import packed_ids

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class UnknownChatFormatError(LookupError):
    """No chat format is registered under that name."""


# Where text is cut for encoding and caching: before a line break that a non-space character follows
# (the pattern takes the line break, which the cut puts back: a lookahead alone scans far slower).
LINE_BREAK = re.compile(r"\n(?=\S)")
# Text pairs that must encode to the same ids apart as together for the encoder to cut text.
LINE_BREAK_PROBES = (
    ("a", "\nb"),
    ("a ", '\n{"b": 1}'),
    ("}", "\n{"),
    ("a\n", "\n# Tools"),
    ("1", "\n2"),
    ("é", "\nü"),
    ("a", "\n<|im_end|>"),
    ("\t", "\n's"),
)
# About 40 bytes a token in the cache (ids and their packed form): 1M tokens hold some fifty
# harness-sized system prompts and tools.
DEFAULT_CACHE_TOKENS = 1_000_000
# Tool lists whose schemas' JSON a format keeps (the harnesses a gateway serves, each with a few).
SCHEMAS_CACHE_ENTRIES = 64


@dataclass(frozen=True, slots=True)
class Encoded:
    """The ids of a text, and their packed wire form (`polar.codec.packed_ids`), made once per text."""

    ids: tuple[int, ...]
    packed: bytes

    @classmethod
    def of(cls, ids: Sequence[int]) -> Encoded:
        return cls(tuple(ids), packed_ids(ids))

    @classmethod
    def joined(cls, parts: Sequence[Encoded]) -> Encoded:
        if len(parts) == 1:
            return parts[0]
        return cls(tuple(chain.from_iterable(part.ids for part in parts)), b"".join(part.packed for part in parts))


EMPTY = Encoded((), b"")
# A text given as the parts it joins: a key that is hashed and compared part by part, so a turn
# built around a long message is looked up without first copying the message into a new string.
TextKey = str | tuple[str, ...]


class EncodingCache:
    """Encodings of texts already encoded, bounded by the tokens held; the least recently used go first."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[TextKey, Encoded] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: TextKey) -> Encoded | None:
        encoded = self._entries.get(text)
        if encoded is not None:
            self._entries.move_to_end(text)
        return encoded

    def put(self, text: TextKey, encoded: Encoded) -> None:
        # An entry also costs a token's worth for its key and node, so empty ones are bounded too.
        if text in self._entries or len(encoded.ids) + 1 > self.max_tokens:
            return
        self._entries[text] = encoded
        self.tokens += len(encoded.ids) + 1
        while self.tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= len(evicted.ids) + 1


class TextEncoder:
    """Encodes text as plain text: special-token strings inside it become ordinary tokens.

    Owns a private copy of the tokenizer's backend with special-token matching switched off, because
    Hugging Face's `split_special_tokens` flips that switch on the shared backend for every call.
    Lines already encoded come from its cache (see the module docstring).
    """

    def __init__(self, tokenizer: Any, cache: EncodingCache | None = None) -> None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.encode_special_tokens = True
        self._backend = backend
        self._tokenizer = tokenizer
        self.cache = cache if cache is not None else EncodingCache()
        self.cuts_lines = backend.normalizer is None and all(
            self._encode_uncached(a + b) == self._encode_uncached(a) + self._encode_uncached(b)
            for a, b in LINE_BREAK_PROBES
        )

    def encode(self, text: str) -> list[int]:
        return list(self.lookup(text).ids)

    def lookup(self, text: TextKey) -> Encoded:
        """The encoding of a text, or of the join of its parts (joined only when not in the cache)."""
        whole = self.cache.get(text)
        if whole is not None:
            return whole
        joined = text if isinstance(text, str) else "".join(text)
        if not joined:
            return EMPTY
        pieces = self._cut(joined) if self.cuts_lines else [joined]
        found = [self.cache.get(piece) for piece in pieces]
        missing = list(dict.fromkeys(piece for piece, encoded in zip(pieces, found) if encoded is None))
        if missing:
            # One call for every line not seen before: the backend's per-call cost is paid once.
            batch = self._backend.encode_batch(missing, add_special_tokens=False)
            encoded_now = {piece: Encoded.of(encoding.ids) for piece, encoding in zip(missing, batch)}
            for piece, encoded in encoded_now.items():
                self.cache.put(piece, encoded)
            found = [encoded if encoded is not None else encoded_now[piece] for piece, encoded in zip(pieces, found)]
        result = Encoded.joined(found)
        if text != pieces[0]:
            # The whole text too: a system prompt sent again is one lookup, not one per line.
            self.cache.put(text, result)
        return result

    @staticmethod
    def _cut(text: str) -> list[str]:
        first, *lines = LINE_BREAK.split(text)
        return ([first] if first else []) + ["\n" + line for line in lines]

    def _encode_uncached(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def special_id(self, token: str) -> int:
        token_id = self._tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self._tokenizer.unk_token_id:
            raise UnknownChatFormatError(f"the tokenizer has no special token {token!r}")
        return token_id


@dataclass(frozen=True)
class Special:
    """A special token inside a rendered turn: a splice boundary, never produced by encoding text."""

    text: str


@dataclass(frozen=True)
class Constant:
    """Text every conversation repeats (the turn separator, the generation prompt): encoded once."""

    text: str


SEPARATOR = Constant("\n")
GENERATION_PROMPT = (Special(IM_START), Constant("assistant\n"))

# Message text (a string, or the parts it joins) and the fixed pieces around it.
Piece = str | tuple[str, ...] | Special | Constant


class ChatFormat(Protocol):
    """How one model family's conversations become token ids."""

    name: str

    def render_message(self, message: Message, *, tools: Sequence[ToolSpec] = (), first: bool = False) -> list[int]:
        """Ids of one message; `first` marks the conversation's opening message (it carries the tools)."""

    def render_messages(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (), start: int = 0
    ) -> list[int]:
        """Ids of messages that sit at position `start` onwards of their conversation."""

    def render_messages_packed(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (), start: int = 0
    ) -> tuple[int, bytes]:
        """`render_messages` as the number of ids and their packed wire form (polar.codec.packed_ids)."""

    def render_prompt(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        """Ids of a whole conversation, ending with the opening of the assistant's turn if asked."""

    def render_prompt_packed(self, conversation: Conversation, add_generation_prompt: bool = True) -> tuple[int, bytes]:
        """`render_prompt` as the number of ids and their packed wire form (polar.codec.packed_ids)."""

    def render_text(self, conversation: Conversation, add_generation_prompt: bool = True) -> str:
        """The text `render_prompt` encodes."""

    def generation_prompt(self) -> list[int]:
        """Ids that open the assistant turn the model samples."""

    def close_sampled_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        """Ids that close a sampled assistant turn so the next message can follow it."""

    def template_history(self, messages: Sequence[Message]) -> tuple[Message, ...]:
        """The messages as the family's own template would show them (its rule for past reasoning)."""

    def forced_opening_text(self, tool_choice: ToolChoice) -> str:
        """Text that opens the assistant turn so that it must be a tool call; empty when not forced."""

    def tool_call_delimiters(self) -> tuple[str, str]:
        """The text before and after a tool call's JSON object {"name": ..., "arguments": ...}."""

    def shared_tools(self, tools: Sequence[ToolSpec]) -> tuple[ToolSpec, ...]:
        """Tools that render exactly as these, from an earlier render when there was one: what a call
        keeps, so that a gateway holds one copy of a harness's tools, not one per call."""

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text."""


TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"


def tool_call_text(call: ToolCall) -> str:
    """One call in the Hermes convention, as the model is taught to write it."""
    name = json.dumps(call.name, ensure_ascii=False)
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}{{"name": {name}, "arguments": {arguments}}}{TOOL_CALL_CLOSE}'


def tool_spec_json(tool: ToolSpec) -> str:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def assistant_body(message: Message) -> str:
    """The text of an assistant turn between its header and its end-of-turn token."""
    thinking = f"<think>\n{message.reasoning}\n</think>\n\n" if message.reasoning else ""
    calls = "\n".join(tool_call_text(call) for call in message.tool_calls)
    separator = "\n" if message.content and calls else ""
    return thinking + message.content + separator + calls


# Where orjson writes a JSON null (an object's value, an array's item): it writes NaN and the
# infinities so too, which json.dumps writes apart.
_NULL_VALUES = (b":null", b"[null", b",null")

ToolsKey = tuple[tuple[str, ...], bytes]


def tools_key(tools: Sequence[ToolSpec]) -> ToolsKey:
    """The tools' names and their parameters as bytes that are equal only for parameters JSON
    writes alike; two tool lists with equal keys and equal descriptions write the same schemas.

    A harness sends its tools with every call, parsed anew each time. The parameters are written
    with orjson, which keeps apart what == does not (true == 1 == 1.0, 0.0 == -0.0) but writes NaN
    and the infinities as null: parameters with a null value (or what looks like one, inside a
    string) are pickled instead, as are those orjson cannot write (an integer past 64 bits, a lone
    surrogate). orjson's bytes start with "[", a pickle's with 0x80. The descriptions, most of the
    tools' text, are compared rather than keyed: comparing two strings costs a fraction of writing
    either (Claude Code's 24 tools: about a third of the cost of pickling them whole).
    """
    names = tuple(tool.name for tool in tools)
    parameters = [tool.parameters for tool in tools]
    try:
        written = orjson.dumps(parameters)
    except orjson.JSONEncodeError:
        return names, pickle.dumps(parameters)
    if any(null in written for null in _NULL_VALUES):
        return names, pickle.dumps(parameters)
    return names, written


def _same_descriptions(a: Sequence[ToolSpec], b: Sequence[ToolSpec]) -> bool:
    return all(x.description == y.description for x, y in zip(a, b))


@dataclass(frozen=True)
class _ToolsEntry:
    key: ToolsKey
    tools: tuple[ToolSpec, ...]
    schemas: str  # their JSON schemas, a line each


def _piece_text(piece: Piece) -> str:
    if isinstance(piece, str):
        return piece
    if isinstance(piece, tuple):
        return "".join(piece)
    return piece.text


class HermesFormat:
    """ChatML with Hermes / Qwen2.5 tool calls (see the module docstring)."""

    def __init__(self, encoder: TextEncoder, *, name: str = "hermes", default_system: str = "") -> None:
        self.name = name
        self._encoder = encoder
        # A system turn opens every conversation that has none, the way the family's template does.
        self._default_system = default_system
        # Encodings of the pieces that are not message text, made once.
        self._fixed: dict[Special | Constant, Encoded] = {
            Special(token): Encoded.of([encoder.special_id(token)]) for token in (IM_START, IM_END)
        }
        for constant in (SEPARATOR, *(p for p in GENERATION_PROMPT if isinstance(p, Constant))):
            self._fixed[constant] = encoder.lookup(constant.text)
        self._end_of_turn_id = encoder.special_id(IM_END)
        self._turn_separator = list(self._fixed[SEPARATOR].ids)
        self._generation_prompt = self._encode(GENERATION_PROMPT)
        self._tools_by_key: OrderedDict[ToolsKey, _ToolsEntry] = OrderedDict()
        # The same entries by the identity of their tools (each entry keeps its tools alive).
        self._tools_by_id: dict[int, _ToolsEntry] = {}

    # -- pieces: a turn as text and special tokens -----------------------------------------------

    def _turn(self, role: str, *body: str) -> tuple[Piece, ...]:
        # The turn's text as its parts: looked up by them, joined only to be encoded.
        return (Special(IM_START), (role + "\n", *body), Special(IM_END), SEPARATOR)

    def _system_turn(self, content: str, tools: Sequence[ToolSpec]) -> tuple[Piece, ...]:
        if not tools:
            return self._turn("system", content)
        lead = (content, "\n\n") if content else ()
        return self._turn("system", *lead, TOOLS_INTRO, self._tools(tools).schemas, TOOLS_OUTRO)

    def shared_tools(self, tools: Sequence[ToolSpec]) -> tuple[ToolSpec, ...]:
        return self._tools(tools).tools

    def _tools(self, tools: Sequence[ToolSpec]) -> _ToolsEntry:
        """The entry of tools written as JSON the same way, made when they were first seen.

        A harness sends its tools with every call, and writing them as JSON (Claude Code's 24 tools are
        64 kB) costs more than the rest of a render; `tools_key` and a comparison of the descriptions
        find the entry for a fraction of that, exactly. The entry's tools are the ones a render keeps
        (`shared_tools`), so a render of them finds the entry by identity, and the entry's schemas are
        one string object, whose hash Python keeps for the turn's lookup. Tools whose descriptions
        differ from the entry of their key take its place.
        """
        entry = self._tools_by_id.get(id(tools))
        if entry is not None and entry.tools is tools:
            self._tools_by_key.move_to_end(entry.key)
            return entry
        key = tools_key(tools)
        entry = self._tools_by_key.get(key)
        if entry is not None and _same_descriptions(entry.tools, tools):
            self._tools_by_key.move_to_end(key)
            return entry
        if entry is not None:  # same names and parameters, other descriptions: replaced
            del self._tools_by_key[key], self._tools_by_id[id(entry.tools)]
        entry = _ToolsEntry(key, tuple(tools), "".join("\n" + tool_spec_json(tool) for tool in tools))
        self._tools_by_key[key] = entry
        self._tools_by_id[id(entry.tools)] = entry
        if len(self._tools_by_key) > SCHEMAS_CACHE_ENTRIES:
            _, evicted = self._tools_by_key.popitem(last=False)
            del self._tools_by_id[id(evicted.tools)]
        return entry

    def _message_pieces(self, message: Message, tools: Sequence[ToolSpec], first: bool) -> tuple[Piece, ...]:
        if message.role == "system":
            return self._system_turn(message.content, tools if first else ())
        opens_system_turn = first and bool(tools or self._default_system)
        opening = self._system_turn(self._default_system, tools) if opens_system_turn else ()
        if message.role == "assistant":
            return opening + self._turn("assistant", assistant_body(message))
        if message.role == "tool":
            return opening + self._turn("user", "<tool_response>\n", message.content, "\n</tool_response>")
        return opening + self._turn(message.role, message.content)

    def _messages_pieces(self, messages: Sequence[Message], tools: Sequence[ToolSpec], start: int) -> list[Piece]:
        pieces: list[Piece] = []
        for offset, message in enumerate(messages):
            pieces.extend(self._message_pieces(message, tools, start + offset == 0))
        return pieces

    def _conversation_pieces(self, conversation: Conversation, add_generation_prompt: bool) -> list[Piece]:
        pieces = self._messages_pieces(conversation.messages, conversation.tools, 0)
        if add_generation_prompt:
            pieces.extend(GENERATION_PROMPT)
        return pieces

    def _encoded(self, pieces: Sequence[Piece]) -> list[Encoded]:
        return [
            self._fixed[piece] if isinstance(piece, (Special, Constant)) else self._encoder.lookup(piece)
            for piece in pieces
        ]

    def _encode(self, pieces: Sequence[Piece]) -> list[int]:
        return list(chain.from_iterable(encoded.ids for encoded in self._encoded(pieces)))

    def _encode_packed(self, pieces: Sequence[Piece]) -> tuple[int, bytes]:
        encoded = self._encoded(pieces)
        return sum(len(part.ids) for part in encoded), b"".join(part.packed for part in encoded)

    # -- ChatFormat ------------------------------------------------------------------------------

    def render_message(self, message: Message, *, tools: Sequence[ToolSpec] = (), first: bool = False) -> list[int]:
        return self._encode(self._message_pieces(message, tools, first))

    def render_messages(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (), start: int = 0
    ) -> list[int]:
        return self._encode(self._messages_pieces(messages, tools, start))

    def render_messages_packed(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (), start: int = 0
    ) -> tuple[int, bytes]:
        return self._encode_packed(self._messages_pieces(messages, tools, start))

    def render_prompt(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        return self._encode(self._conversation_pieces(conversation, add_generation_prompt))

    def render_prompt_packed(self, conversation: Conversation, add_generation_prompt: bool = True) -> tuple[int, bytes]:
        return self._encode_packed(self._conversation_pieces(conversation, add_generation_prompt))

    def render_text(self, conversation: Conversation, add_generation_prompt: bool = True) -> str:
        pieces = self._conversation_pieces(conversation, add_generation_prompt)
        return "".join(_piece_text(piece) for piece in pieces)

    def generation_prompt(self) -> list[int]:
        return list(self._generation_prompt)

    def close_sampled_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        # A sample stopped by its end-of-turn token holds it already; one cut at max_tokens does not.
        ended = bool(sampled_ids) and sampled_ids[-1] == self._end_of_turn_id
        return ([] if ended else [self._end_of_turn_id]) + self._turn_separator

    def template_history(self, messages: Sequence[Message]) -> tuple[Message, ...]:
        user_turns = [index for index, message in enumerate(messages) if message.role == "user"]
        last_user = user_turns[-1] if user_turns else -1
        return tuple(
            replace(message, reasoning="") if index < last_user and message.reasoning else message
            for index, message in enumerate(messages)
        )

    def forced_opening_text(self, tool_choice: ToolChoice) -> str:
        # Both openings stop where the canonical call's own tokens break (after ` "` and after `":`),
        # so the model continues from the tokenization it would have produced itself.
        if tool_choice.mode == "required":
            return '<tool_call>\n{"name": "'
        if tool_choice.mode == "function":
            name = json.dumps(tool_choice.function_name, ensure_ascii=False)
            return f'<tool_call>\n{{"name": {name}, "arguments":'
        return ""

    def tool_call_delimiters(self) -> tuple[str, str]:
        return TOOL_CALL_OPEN, TOOL_CALL_CLOSE

    def encode_text(self, text: str) -> list[int]:
        return self._encoder.encode(text)


def forced_opening(chat_format: ChatFormat, tool_choice: ToolChoice) -> list[int]:
    """Prompt ids appended after the generation prompt so the output must be a tool call; [] if not forced."""
    return chat_format.encode_text(chat_format.forced_opening_text(tool_choice))


ChatFormatFactory = Callable[[TextEncoder], ChatFormat]

CHAT_FORMATS: dict[str, ChatFormatFactory] = {
    "hermes": lambda encoder: HermesFormat(encoder, name="hermes"),
    # SmolLM2's own template opens tool-less conversations with this system prompt; keeping it makes
    # fresh renders of plain chats identical to the model's template.
    "smollm2": lambda encoder: HermesFormat(encoder, name="smollm2", default_system=SMOLLM2_SYSTEM),
}


def get_chat_format(name: str, tokenizer: Any) -> ChatFormat:
    """The chat format named `name` in CHAT_FORMATS, bound to a Hugging Face tokenizer or what
    polar.inference.tokenizer_files reads of one."""
    factory = CHAT_FORMATS.get(name)
    if factory is None:
        raise UnknownChatFormatError(f"no chat format {name!r}; known: {', '.join(sorted(CHAT_FORMATS))}")
    return factory(TextEncoder(tokenizer))
