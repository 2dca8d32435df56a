"""Token-faithful prompts: a request that continues an earlier call reuses that call's exact tokens.

The prompt is that call's prompt ids + its sampled ids + the tokens closing the turn + the new
messages' ids; when no earlier call fits, it is rendered fresh and `fresh_reason` says why. The rule
and the history policies (`faithful`, `template`): docs/design/rendering.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Literal

from gateway.chat_format import ChatFormat, forced_opening
from gateway.conversation import Conversation, Message, turns_match
from polar.codec import packed_ids, unpacked_ids

History = Literal["faithful", "template"]

FIRST_CALL = "first_call"
HISTORY_DIVERGED = "history_diverged"
TOOLS_CHANGED = "tools_changed"
TEMPLATE_DROPS_SAMPLED_REASONING = "template_drops_sampled_reasoning"


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt of one call and how it relates to the session's earlier calls.

    The ids are held in packed wire form (polar.codec.packed_ids), the form the engine is sent, joined
    from the chat format's cached pieces: the gateway needs no id as a Python int, and a session's
    prompts are not tens of thousands of objects for the garbage collector to visit.
    """

    packed_ids: bytes
    token_count: int
    # The messages and tools exactly as the prompt shows them to the model (sampled reasoning put back,
    # or the template's view): record this as the call's `PriorCall.conversation`.
    conversation: Conversation
    # The call whose prompt + sampled ids this prompt starts with; empty when rendered fresh.
    extends_call_id: str = ""
    # Why the prompt was rendered fresh; empty when it extends a call.
    fresh_reason: str = ""
    # Ids at the end of token_ids that force a tool call's opening; prompt, never sampled.
    forced_token_count: int = 0
    # The request's messages the prompt was rendered from (after the template's rule, if any): each
    # is the turn at its place in `conversation`, or matches it.
    matched: tuple[Message, ...] = ()

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The ids, decoded from packed_ids."""
        return unpacked_ids(self.packed_ids)


@dataclass(frozen=True)
class PriorCall:
    """An earlier call of the session."""

    call_id: str
    prompt: RenderedPrompt
    sampled_ids: tuple[int, ...]
    # The assistant message its output (forced opening included) parsed into.
    reply: Message

    @property
    def conversation(self) -> Conversation:
        return self.prompt.conversation


class PriorCalls:
    """A session's earlier calls, indexed by how many messages they were prompted with.

    Only a call with fewer messages than a request can be extended by it, so a lookup visits those
    alone, longest first and latest first within a length: a session of thousands of calls that each
    start afresh (the same short request looped, or a harness's side calls) costs nothing per call,
    where scanning every call grew with the session.
    """

    def __init__(self, calls: Iterable[PriorCall] = ()) -> None:
        self._by_size: dict[int, list[PriorCall]] = {}
        self._count = 0
        for call in calls:
            self.add(call)

    def add(self, call: PriorCall) -> None:
        """Append a call (in completion order)."""
        self._by_size.setdefault(len(call.conversation.messages), []).append(call)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def longest_first(self, below: int) -> Iterator[PriorCall]:
        """The calls prompted with fewer than `below` messages: most messages first, then latest first."""
        for size in sorted((size for size in self._by_size if size < below), reverse=True):
            yield from reversed(self._by_size[size])


def render_request(
    chat_format: ChatFormat,
    conversation: Conversation,
    prior_calls: PriorCalls | Sequence[PriorCall] = (),
    *,
    history: History = "faithful",
) -> RenderedPrompt:
    """The prompt for a request: extending the best-matching earlier call, else rendered fresh."""
    if history not in ("faithful", "template"):
        raise ValueError(f"history must be 'faithful' or 'template', not {history!r}")
    messages = conversation.messages
    if history == "template":
        messages = chat_format.template_history(messages)
    forced = forced_opening(chat_format, conversation.tool_choice)
    if not isinstance(prior_calls, PriorCalls):
        prior_calls = PriorCalls(prior_calls)
    prior, reason = _best_prior(prior_calls, messages, conversation, strict_reasoning=history == "template")
    if prior is None:
        seen = Conversation(messages, chat_format.shared_tools(conversation.tools), conversation.tool_choice)
        count, packed = chat_format.render_prompt_packed(seen)
        return RenderedPrompt(
            packed + packed_ids(forced),
            count + len(forced),
            seen,
            fresh_reason=reason,
            forced_token_count=len(forced),
            matched=tuple(messages),
        )
    reply_index = len(prior.conversation.messages)
    new_messages = messages[reply_index + 1 :]
    after_reply = (*prior.sampled_ids, *chat_format.close_sampled_turn(prior.sampled_ids))
    new_count, new_packed = chat_format.render_messages_packed(
        new_messages, tools=conversation.tools, start=reply_index + 1
    )
    opening = (*chat_format.generation_prompt(), *forced)
    # The extended prompt is joined as it is; only the sampled ids and the few ids around the new
    # messages are converted here.
    packed = b"".join((prior.prompt.packed_ids, packed_ids(after_reply), new_packed, packed_ids(opening)))
    count = prior.prompt.token_count + len(after_reply) + new_count + len(opening)
    seen_messages = (*prior.conversation.messages, prior.reply, *new_messages)
    # The tools the prompt shows are the extended call's (they match the request's), kept once for
    # the whole chain rather than once per call.
    seen = Conversation(seen_messages, prior.conversation.tools, conversation.tool_choice)
    return RenderedPrompt(
        packed, count, seen, extends_call_id=prior.call_id, forced_token_count=len(forced), matched=tuple(messages)
    )


def _best_prior(
    prior_calls: PriorCalls,
    messages: Sequence[Message],
    conversation: Conversation,
    *,
    strict_reasoning: bool,
) -> tuple[PriorCall | None, str]:
    """The call to extend (longest history, then latest), or None and the reason of the closest miss."""
    if not prior_calls:
        return None, FIRST_CALL
    reason = HISTORY_DIVERGED
    for prior in prior_calls.longest_first(below=len(messages)):
        miss = _mismatch(prior, messages, conversation, strict_reasoning)
        if miss is None:
            return prior, ""
        if reason == HISTORY_DIVERGED:
            reason = miss
    return None, reason


def _mismatch(
    prior: PriorCall, messages: Sequence[Message], conversation: Conversation, strict_reasoning: bool
) -> str | None:
    """Why `messages` do not extend the prior call's messages + reply; None when they do."""
    recorded = (*prior.conversation.messages, prior.reply)
    if len(messages) < len(recorded):
        return HISTORY_DIVERGED
    # Most of a later call's turns are the very objects the earlier call was rendered from
    # (ConversationFold), each already found to match its recorded turn: only the others are compared.
    pairs = [
        (incoming, seen)
        for incoming, seen, earlier in zip_longest(
            messages[: len(recorded)], recorded, prior.prompt.matched[: len(recorded)]
        )
        if incoming is not earlier
    ]
    if not all(turns_match(incoming, seen) for incoming, seen in pairs):
        return HISTORY_DIVERGED
    if strict_reasoning and not all(turns_match(incoming, seen, strict_reasoning=True) for incoming, seen in pairs):
        return TEMPLATE_DROPS_SAMPLED_REASONING
    if prior.conversation.tools != conversation.tools:
        return TOOLS_CHANGED
    return None
