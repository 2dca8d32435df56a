"""A fake edge for tests and benchmarks: sessions of call records as a gateway would record them.

A small simulated harness talks through a token-faithful gateway using a ChatML-like template over a
fake vocabulary: ``<|im_start|> role \\n words <|im_end|> \\n``. Every prompt that continues a
conversation is ``previous prompt ‖ previous sample ‖ new messages ‖ assistant header``, exactly as the
gateway renders it; a sample that stopped ends with ``<|im_end|>``; one cut at max tokens does not, and
the next prompt closes the turn with ``<|im_end|>`` as its first new token.

``generate_session(events, seed)`` plays the main conversation's first turn, then each event followed
by one plain main turn, and records which calls must start a sibling trace and why
(``SyntheticSession.expected_forks``, following the rules in prefix_merging.py). Events:

* ``turn``: a tool result and a reply;  ``truncated``: a reply cut at the task's max tokens per call
  (recorded as truncated);
* ``sub_agent``: a conversation with its own system prompt runs 1–3 turns, then the main one resumes;
* ``compaction``: the main history is replaced by the system prompt and a short summary;
* ``edit``: one token of older main history is rewritten, then the conversation goes on;
* ``parallel``: two requests extend the same history with different tool results; the main
  conversation goes on from one of them;
* ``aborted``: a reply whose stream the client dropped (partial sample, possibly empty, recorded as
  aborted or as an engine error), then a retry of the same prompt.

``end_aborted`` makes the session end on a dropped stream (a cancelled session). Every message's first
word is a fresh id, so unrelated messages never share a prefix by chance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from polar.trajectory.records import CallView, SamplingParams
from polar.v1 import common_pb2

IM_START, IM_END, NEWLINE = 1, 2, 3
SYSTEM, USER, ASSISTANT, TOOL = 4, 5, 6, 7
_WORDS = (100, 40_000)  # random content ids
_FRESH = 40_000  # fresh ids (first word of every message) count up from here
EVENTS = ("turn", "truncated", "sub_agent", "compaction", "edit", "parallel", "aborted")
_HEADER = np.array([IM_START, ASSISTANT, NEWLINE], dtype=np.int32)


@dataclass(frozen=True)
class SessionShape:
    """Token counts of the generated messages, as inclusive (low, high) ranges."""

    system_tokens: int = 24
    task_tokens: tuple[int, int] = (4, 16)
    tool_tokens: tuple[int, int] = (1, 24)
    sample_tokens: tuple[int, int] = (1, 24)
    max_tokens: int = 12  # length of a sample cut at max tokens
    summary_tokens: tuple[int, int] = (1, 6)


TEST_SHAPE = SessionShape()
# Close to what a coding agent sends: a long system prompt with tools, mid-sized tool outputs.
BENCH_SHAPE = SessionShape(
    system_tokens=2_000,
    task_tokens=(100, 300),
    tool_tokens=(50, 400),
    sample_tokens=(30, 200),
    max_tokens=200,
    summary_tokens=(100, 300),
)


@dataclass(frozen=True)
class SyntheticSession:
    calls: tuple[CallView, ...]
    expected_forks: Mapping[str, str]  # call id -> fork reason of the trace that call must start


@dataclass
class _Conversation:
    tokens: np.ndarray  # (n,) everything the harness would resend: last prompt ‖ last sample
    open_turn: bool = False  # the last sample was cut before its end-of-turn token
    last_point: int = 0  # where the last call's new tokens began (the point it extended)
    calls: int = 0


@dataclass
class _Harness:
    rng: np.random.Generator
    shape: SessionShape
    calls: list[CallView] = field(default_factory=list)
    expected: dict[str, str] = field(default_factory=dict)
    fresh: int = _FRESH

    def words(self, span: tuple[int, int]) -> np.ndarray:
        n = int(self.rng.integers(span[0], span[1] + 1))
        self.fresh += 1
        rest = self.rng.integers(*_WORDS, size=max(n - 1, 0))
        return np.concatenate(([self.fresh], rest)).astype(np.int32)

    def message(self, role: int, span: tuple[int, int]) -> np.ndarray:
        return np.concatenate(([IM_START, role, NEWLINE], self.words(span), [IM_END, NEWLINE])).astype(np.int32)

    def opening(self, system: np.ndarray, first: np.ndarray) -> _Conversation:
        return _Conversation(np.concatenate((system, first)))

    def prompt(self, conv: _Conversation, new_role: int = TOOL) -> np.ndarray:
        """``conv ‖ a new message ‖ assistant header``, closing a cut turn first.

        A conversation's first prompt is its opening messages and the header alone.
        """
        if conv.calls == 0:
            return np.concatenate((conv.tokens, _HEADER))
        new = self.message(new_role, self.shape.tool_tokens)
        closing = [IM_END, NEWLINE] if conv.open_turn else [NEWLINE]
        return np.concatenate((conv.tokens, np.array(closing, dtype=np.int32), new, _HEADER))

    def record(self, prompt: np.ndarray, sampled: np.ndarray, finish: int, aborted: bool = False) -> CallView:
        # Calls alternate between two temperatures, so a trace holds spans sampled differently.
        sampling = SamplingParams(temperature=(1.0, 0.6)[len(self.calls) % 2], max_tokens=self.shape.max_tokens)
        call = CallView(
            call_id=f"c{len(self.calls) + 1:04d}",
            prompt_ids=prompt,
            sampled_ids=sampled,
            logprobs=-self.rng.exponential(1.0, size=len(sampled)).astype(np.float32),
            finish_reason=finish,
            aborted=aborted,
            received_unix_ns=1_700_000_000_000_000_000 + len(self.calls) * 1_000_000,
            sampling=sampling,
            truncated=finish == common_pb2.FINISH_REASON_LENGTH,
        )
        self.calls.append(call)
        return call

    def advance(self, conv: _Conversation, prompt: np.ndarray, sampled: np.ndarray, open_turn: bool) -> None:
        conv.last_point = len(prompt) if conv.calls == 0 else len(conv.tokens)
        conv.tokens = np.concatenate((prompt, sampled))
        conv.open_turn = open_turn
        conv.calls += 1

    def turn(self, conv: _Conversation, truncated: bool = False) -> CallView:
        prompt = self.prompt(conv)
        if truncated:
            sampled = self.words((self.shape.max_tokens, self.shape.max_tokens))
            call = self.record(prompt, sampled, common_pb2.FINISH_REASON_LENGTH)
        else:
            sampled = np.append(self.words(self.shape.sample_tokens), IM_END).astype(np.int32)
            call = self.record(prompt, sampled, common_pb2.FINISH_REASON_STOP)
        self.advance(conv, prompt, sampled, truncated)
        return call


def generate_session(
    events: Sequence[str], seed: int, shape: SessionShape = TEST_SHAPE, end_aborted: bool = False
) -> SyntheticSession:
    h = _Harness(np.random.default_rng(seed), shape)
    system = h.message(SYSTEM, (shape.system_tokens, shape.system_tokens))
    sub_system = h.message(SYSTEM, (shape.system_tokens, shape.system_tokens))
    main = h.opening(system, h.message(USER, shape.task_tokens))
    h.turn(main)
    for event in events:
        if event == "truncated":
            h.turn(main, truncated=True)
        elif event == "sub_agent":
            sub = h.opening(sub_system, h.message(USER, shape.task_tokens))
            first = h.turn(sub)
            h.expected[first.call_id] = "sub_agent"
            for _ in range(int(h.rng.integers(0, 3))):
                h.turn(sub)
        elif event == "compaction":
            compacted = h.opening(system, h.message(USER, shape.summary_tokens))
            if len(compacted.tokens) + len(_HEADER) < len(main.tokens):
                main = compacted
                h.expected[h.turn(main).call_id] = "compaction"
        elif event == "edit":
            edited = main.tokens.copy()
            position = int(h.rng.integers(0, main.last_point))
            h.fresh += 1
            edited[position] = h.fresh
            main = _Conversation(edited, main.open_turn, main.last_point, main.calls)
            h.expected[h.turn(main).call_id] = "edit"
        elif event == "parallel":
            side = _Conversation(main.tokens, main.open_turn, main.last_point, main.calls)
            if h.rng.random() < 0.5:
                h.turn(main)
                h.expected[h.turn(side).call_id] = "parallel_branch"
            else:
                h.turn(side)
                h.expected[h.turn(main).call_id] = "parallel_branch"
        elif event == "aborted":
            dropped = _drop_stream(h, main)
            if len(dropped.sampled_ids):
                h.expected[dropped.call_id] = "aborted_call"
            _retry(h, main, dropped)
        elif event != "turn":
            raise ValueError(f"unknown event {event!r}; events are {', '.join(EVENTS)}")
        h.turn(main)
    if end_aborted:
        _drop_stream(h, main)
    return SyntheticSession(tuple(h.calls), dict(h.expected))


def _drop_stream(h: _Harness, conv: _Conversation) -> CallView:
    """A call whose stream ended early: a partial sample, recorded as aborted or as an engine error."""
    prompt = h.prompt(conv)
    partial = h.words(h.shape.sample_tokens)[: int(h.rng.integers(0, h.shape.sample_tokens[1] + 1))]
    if h.rng.random() < 0.5:
        return h.record(prompt, partial, common_pb2.FINISH_REASON_ABORTED, aborted=True)
    return h.record(prompt, partial, common_pb2.FINISH_REASON_ERROR)


def _retry(h: _Harness, conv: _Conversation, dropped: CallView) -> None:
    sampled = np.append(h.words(h.shape.sample_tokens), IM_END).astype(np.int32)
    h.record(dropped.prompt_ids, sampled, common_pb2.FINISH_REASON_STOP)
    h.advance(conv, dropped.prompt_ids, sampled, False)


def tool_session(turns: int, seed: int, shape: SessionShape = BENCH_SHAPE) -> tuple[CallView, ...]:
    """One tool-using conversation of ``turns`` calls, a tenth of the replies cut at max tokens."""
    h = _Harness(np.random.default_rng(seed), shape)
    main = h.opening(h.message(SYSTEM, (shape.system_tokens, shape.system_tokens)), h.message(USER, shape.task_tokens))
    h.turn(main)
    for _ in range(turns - 1):
        h.turn(main, truncated=bool(h.rng.random() < 0.1))
    return tuple(h.calls)
