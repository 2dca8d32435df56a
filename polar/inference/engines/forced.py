"""Forced replies: the torch engine's teacher-forcing mode, a test fixture for real harness CLIs.

With `[inference] forced_replies` set to a script, the torch engine emits the script's reply for each
call instead of sampling, each token recorded with the served model's own logprob under the call's
sampling, so the trainer's steps on it are real. Never a default. The script format and the reply
conditions: docs/design/engines.md (forced replies).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IM_START = "<|im_start|>"
END_OF_TURN = "<|im_end|>"
ASSISTANT = "assistant\n"
TOOL_RESULT = "user\n<tool_response>"  # how the hermes format renders a tool result
ROLE_TOKENS = 8  # tokens of a turn's start decoded to tell what it is
DEFAULT_FALLBACK = "Done."
_CONDITIONS = ("turn", "prompt_regex", "last_message_regex")


class ForcedRepliesError(ValueError):
    """The forced-replies script is malformed; the message names the entry and field."""


@dataclass(frozen=True)
class _Reply:
    token_ids: tuple[int, ...]
    turn: int | None = None
    prompt: re.Pattern[str] | None = None
    last_message: re.Pattern[str] | None = None


class ForcedReplies:
    """The script's reply for a prompt, as the token ids to force (see the module docstring)."""

    def __init__(self, script: Mapping[str, Any], tokenizer) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        if IM_START not in vocab or END_OF_TURN not in vocab:
            raise ForcedRepliesError(f"forced replies need a ChatML tokenizer ({IM_START}, {END_OF_TURN})")
        self._im_start, self._end_of_turn = vocab[IM_START], vocab[END_OF_TURN]
        unknown = set(script) - {"replies", "fallback"}
        if unknown:
            raise ForcedRepliesError(f"unknown key {sorted(unknown)[0]!r} (known: replies, fallback)")
        entries = script.get("replies", [])
        if not isinstance(entries, list):
            raise ForcedRepliesError("'replies' must be a list")
        self._replies = tuple(self._reply(entry, f"replies[{i}]") for i, entry in enumerate(entries))
        self._fallback = self._reply({"text": script.get("fallback", DEFAULT_FALLBACK)}, "fallback")

    @classmethod
    def load(cls, path: str | Path, tokenizer) -> ForcedReplies:
        try:
            script = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ForcedRepliesError(f"cannot read the forced-replies script {str(path)!r}: {exc}") from exc
        if not isinstance(script, dict):
            raise ForcedRepliesError(f"{path}: the script must be a JSON object")
        return cls(script, tokenizer)

    def _reply(self, entry: Any, where: str) -> _Reply:
        if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
            raise ForcedRepliesError(f"{where}: a reply is an object with a string 'text'")
        unknown = set(entry) - {"text", *_CONDITIONS}
        if unknown:
            raise ForcedRepliesError(
                f"{where}: unknown key {sorted(unknown)[0]!r} (known: text, {', '.join(_CONDITIONS)})"
            )
        turn = entry.get("turn")
        if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or turn < 0):
            raise ForcedRepliesError(f"{where}.turn: must be an integer >= 0, got {turn!r}")
        ids = tuple(self._tokenizer.encode(entry["text"], add_special_tokens=False)) + (self._end_of_turn,)
        return _Reply(ids, turn, _regex(entry, "prompt_regex", where), _regex(entry, "last_message_regex", where))

    def reply(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """The token ids to force for this prompt (the first matching reply's, else the fallback's)."""
        starts = [i for i, token in enumerate(prompt) if token == self._im_start]
        assistant_turns = self._turn(prompt, starts)
        text = last_message = None  # decoded once, when a condition needs them
        for reply in self._replies:
            if reply.turn is not None and reply.turn != assistant_turns:
                continue
            if reply.prompt is not None:
                if text is None:
                    text = self._tokenizer.decode(prompt)
                if not reply.prompt.search(text):
                    continue
            if reply.last_message is not None:
                if last_message is None:
                    window = prompt[starts[-2] : starts[-1]] if len(starts) >= 2 else prompt
                    last_message = self._tokenizer.decode(window)
                if not reply.last_message.search(last_message):
                    continue
            return reply.token_ids
        return self._fallback.token_ids

    def _turn(self, prompt: Sequence[int], starts: list[int]) -> int:
        """Assistant turns after the last user turn that is not a tool result. Turns are
        `<|im_start|>role\n...`; the last one opened is the generation prompt."""
        count = 0
        for start in reversed(starts[:-1]):
            head = self._tokenizer.decode(prompt[start + 1 : start + 1 + ROLE_TOKENS])
            if head.startswith(ASSISTANT):
                count += 1
            elif head.startswith("user") and not head.startswith(TOOL_RESULT):
                break
        return count


def _regex(entry: Mapping[str, Any], key: str, where: str) -> re.Pattern[str] | None:
    if key not in entry:
        return None
    try:
        return re.compile(str(entry[key]))
    except re.error as exc:
        raise ForcedRepliesError(f"{where}.{key}: {entry[key]!r} is not a regex: {exc}") from exc
