"""Token-faithful splicing: each call's prompt extends the previous call's prompt + sampled ids."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.chat_format import (
    IM_END,
    EncodingCache,
    HermesFormat,
    TextEncoder,
    assistant_body,
    forced_opening,
)
from gateway.conversation import Conversation, Message, ToolCall, ToolChoice, ToolSpec
from gateway.parsers import HermesParser
from gateway.render import (
    FIRST_CALL,
    HISTORY_DIVERGED,
    TEMPLATE_DROPS_SAMPLED_REASONING,
    TOOLS_CHANGED,
    PriorCall,
    PriorCalls,
    RenderedPrompt,
    render_request,
)
from gateway.replay import recorded_request
from polar.codec import packed_ids
from polar.trajectory.session_file import read_trajectory

TOOLS = (
    ToolSpec("read_file", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}}}),
    ToolSpec("run", "Run a shell command.", {"type": "object", "properties": {"command": {"type": "string"}}}),
)
parser = HermesParser()


class Session:
    """A gateway session driven by a fake harness and a fake engine that 'samples' the tokens of a rendered reply.

    The harness keeps its conversation the way dialect clients do: it echoes each reply with new
    tool-call ids, arguments re-built as a new dict in another key order, and (optionally) without the
    reasoning; it answers tool calls with tool results and other replies with a user message.
    """

    def __init__(self, chat_format, tokenizer, history="faithful"):
        self.chat_format, self.tokenizer, self.history = chat_format, tokenizer, history
        self.end_of_turn = tokenizer.convert_tokens_to_ids(IM_END)
        self.calls: list[PriorCall] = []
        self.rendered = []

    def call(self, conversation, reply, cut=None):
        """Render the request, 'sample' `reply` (its first `cut` tokens when cut at max_tokens) and record the call."""
        rendered = render_request(self.chat_format, conversation, self.calls, history=self.history)
        opening = self.chat_format.forced_opening_text(conversation.tool_choice)
        body_ids = self.chat_format.encode_text(assistant_body(reply)[len(opening) :])
        sampled = body_ids[:cut] if cut is not None else [*body_ids, self.end_of_turn]
        call_id = f"c{len(self.calls) + 1:04d}"
        text = opening + self.tokenizer.decode(sampled, skip_special_tokens=True)
        parsed = parser.parse(text, call_id=call_id).message()
        # What the engine is sent: the same ids, fresh or extending, whatever the cache held.
        assert rendered.packed_ids == packed_ids(rendered.token_ids)
        assert rendered.token_count == len(rendered.token_ids)
        self.calls.append(PriorCall(call_id, rendered, tuple(sampled), parsed))
        self.rendered.append(rendered)
        return rendered, parsed


def echoed(reply: Message, echo_reasoning: bool) -> Message:
    calls = tuple(
        ToolCall(f"toolu_{index}", call.name, dict(reversed(call.arguments.items())))
        for index, call in enumerate(reply.tool_calls)
    )
    return replace(reply, reasoning=reply.reasoning if echo_reasoning else "", tool_calls=calls)


def answers(reply: Message, turn: int) -> list[Message]:
    if reply.tool_calls:
        return [
            Message("tool", f"output {turn}.{index}\nline two", tool_call_id=call.id)
            for index, call in enumerate(reply.tool_calls)
        ]
    return [Message("user", f"Go on with step {turn}.")]


# Characters SmolLM2's byte-level vocabulary round-trips (it lacks the lead bytes of unassigned and
# private-use planes, and its tokenizer encodes six control characters as nothing, so no sample can
# hold them), without "<" so that replies are never mistaken for tags.
UNENCODED = "\x04\x06\x13\x14\x16\x1d"
plain = st.text(
    alphabet=st.characters(blacklist_characters="<" + UNENCODED, blacklist_categories=["Cs", "Cn", "Co"]), max_size=24
).map(str.strip)
replies = st.builds(
    lambda reasoning, content, calls: Message("assistant", content, reasoning, tuple(calls)),
    reasoning=plain,
    content=plain,
    calls=st.lists(
        st.builds(
            lambda name, value: ToolCall("", name, {"path": value, "n": 3}),
            st.sampled_from(["read_file", "run"]),
            plain,
        ),
        max_size=2,
    ),
)
turns = st.lists(st.tuples(replies, st.none() | st.integers(1, 40), st.booleans()), min_size=10, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=turns)
def test_ten_turn_tool_conversation_extends_every_earlier_prompt_and_sample(hermes, smollm2_tokenizer, turns):
    session = Session(hermes, smollm2_tokenizer)
    messages = [Message("system", "You are a coding agent."), Message("user", "Fix the bug in a.py.")]
    canonical_so_far = True  # every sample so far ended with end-of-turn, as a fresh render would
    for turn, (reply, cut, echo_reasoning) in enumerate(turns):
        rendered, parsed = session.call(Conversation(tuple(messages), TOOLS), reply, cut)
        if turn == 0:
            assert rendered.fresh_reason == FIRST_CALL
        else:
            previous = session.calls[-2]
            head = previous.prompt.token_ids + previous.sampled_ids
            assert rendered.extends_call_id == previous.call_id
            assert rendered.fresh_reason == ""
            assert rendered.token_ids[: len(head)] == head
            if canonical_so_far:
                # Splicing gives the very ids a fresh render of what the prompt shows the model gives.
                assert list(rendered.token_ids) == hermes.render_prompt(rendered.conversation)
        canonical_so_far &= cut is None
        messages += [echoed(parsed, echo_reasoning), *answers(parsed, turn)]


def test_a_sample_cut_at_max_tokens_is_closed_with_end_of_turn(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    first = Conversation((Message("user", "Count to ten."),))
    _, parsed = session.call(first, Message("assistant", "one two three four five six"), cut=3)
    rendered, _ = session.call(
        Conversation((*first.messages, parsed, Message("user", "Go on."))), Message("assistant", "seven")
    )
    call = session.calls[0]
    closing = rendered.token_ids[len(call.prompt.token_ids) + len(call.sampled_ids) :][:2]
    assert call.sampled_ids[-1] != session.end_of_turn
    assert list(closing) == [session.end_of_turn, *smollm2_tokenizer.encode("\n", add_special_tokens=False)]
    assert smollm2_tokenizer.decode(rendered.token_ids).endswith(
        "one two three<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def build_history(session, reasoning="I should read it."):
    """Two calls: a tool call with reasoning, then a final answer; returns the harness's messages."""
    call = ToolCall("", "read_file", {"path": "a.py"})
    messages = [Message("user", "What is in a.py?")]
    _, first = session.call(Conversation(tuple(messages), TOOLS), Message("assistant", "", reasoning, (call,)))
    messages += [first, Message("tool", "print(1)", tool_call_id=first.tool_calls[0].id)]
    _, second = session.call(Conversation(tuple(messages), TOOLS), Message("assistant", "It prints 1.", "Easy."))
    return [*messages, second]


def test_the_first_call_renders_fresh(hermes, smollm2_tokenizer):
    conversation = Conversation((Message("user", "hi"),), TOOLS)
    rendered = render_request(hermes, conversation, [])
    assert (rendered.extends_call_id, rendered.fresh_reason) == ("", FIRST_CALL)
    assert list(rendered.token_ids) == hermes.render_prompt(conversation)


@pytest.mark.parametrize(
    "rewrite",
    [
        pytest.param(lambda messages: [Message("user", "Summary: a.py prints 1."), *messages[3:]], id="compaction"),
        pytest.param(lambda messages: [Message("user", "What is in b.py?"), *messages[1:]], id="edited-user-turn"),
        pytest.param(
            lambda messages: [
                messages[0],
                replace(messages[1], tool_calls=(ToolCall("x", "read_file", {"path": "b.py"}),)),
                *messages[2:],
            ],
            id="edited-arguments",
        ),
    ],
)
def test_rewritten_history_renders_fresh_and_says_why(hermes, smollm2_tokenizer, rewrite):
    session = Session(hermes, smollm2_tokenizer)
    messages = rewrite(build_history(session)) + [Message("user", "And now?")]
    conversation = Conversation(tuple(messages), TOOLS)
    rendered = render_request(hermes, conversation, session.calls)
    assert (rendered.extends_call_id, rendered.fresh_reason) == ("", HISTORY_DIVERGED)
    assert list(rendered.token_ids) == hermes.render_prompt(conversation)


def test_turns_that_are_the_earlier_call_s_objects_skip_comparison_but_the_reply_is_compared(hermes, smollm2_tokenizer):
    """A later call's turns are the objects of the call before (as the gateway's dialects hand them
    on); the reply it echoes is always compared with the sampled one, and so is any turn replaced."""
    session = Session(hermes, smollm2_tokenizer)
    messages = [Message("user", "What is in a.py?")]
    session.call(Conversation(tuple(messages), TOOLS), Message("assistant", "It prints 1."))
    echoed = [*messages, Message("assistant", "It prints 2."), Message("user", "Sure?")]
    rendered = render_request(hermes, Conversation(tuple(echoed), TOOLS), session.calls)
    assert (rendered.extends_call_id, rendered.fresh_reason) == ("", HISTORY_DIVERGED)
    echoed[1] = Message("assistant", "It prints 1.")
    assert render_request(hermes, Conversation(tuple(echoed), TOOLS), session.calls).extends_call_id == "c0001"
    echoed[0] = Message("user", "What is in b.py?")
    rendered = render_request(hermes, Conversation(tuple(echoed), TOOLS), session.calls)
    assert (rendered.extends_call_id, rendered.fresh_reason) == ("", HISTORY_DIVERGED)


def test_an_edit_after_an_earlier_reply_extends_that_earlier_call(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    messages = build_history(session)
    messages[2] = Message("tool", "print(2)")
    rendered = render_request(hermes, Conversation(tuple(messages), TOOLS), session.calls)
    head = session.calls[0].prompt.token_ids + session.calls[0].sampled_ids
    assert rendered.extends_call_id == "c0001"
    assert rendered.token_ids[: len(head)] == head
    assert "print(2)" in smollm2_tokenizer.decode(rendered.token_ids[len(head) :])


def test_changed_tools_start_a_new_chain(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    messages = build_history(session) + [Message("user", "And now?")]
    rendered = render_request(hermes, Conversation(tuple(messages), TOOLS[:1]), session.calls)
    assert (rendered.extends_call_id, rendered.fresh_reason) == ("", TOOLS_CHANGED)


def test_arguments_match_as_parsed_json_and_ids_are_ignored(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    messages = build_history(session)
    float_arguments = replace(messages[1], tool_calls=(ToolCall("other-id", "read_file", {"path": "a.py"}),))
    messages[1] = float_arguments
    rendered = render_request(hermes, Conversation((*messages, Message("user", "ok")), TOOLS), session.calls)
    assert rendered.extends_call_id == "c0002"


def test_faithful_history_keeps_sampled_reasoning_the_harness_dropped(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    messages = [replace(message, reasoning="") for message in build_history(session)] + [
        Message("user", "Thanks. And b.py?")
    ]
    rendered = render_request(hermes, Conversation(tuple(messages), TOOLS), session.calls)
    assert rendered.extends_call_id == "c0002"
    text = smollm2_tokenizer.decode(rendered.token_ids)
    assert "<think>\nI should read it.\n</think>" in text and "<think>\nEasy.\n</think>" in text
    assert rendered.conversation.messages[1].reasoning == "I should read it."


def test_template_history_starts_a_new_chain_where_the_template_drops_sampled_reasoning(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer, history="template")
    messages = build_history(session) + [Message("user", "Thanks. And b.py?")]
    rendered = render_request(hermes, Conversation(tuple(messages), TOOLS), session.calls, history="template")
    assert (rendered.extends_call_id, rendered.fresh_reason) == ("", TEMPLATE_DROPS_SAMPLED_REASONING)
    assert "<think>" not in smollm2_tokenizer.decode(rendered.token_ids)
    faithful = render_request(hermes, Conversation(tuple(messages), TOOLS), session.calls)
    assert faithful.extends_call_id == "c0002"


def test_template_history_extends_within_a_tool_loop_when_reasoning_is_echoed(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer, history="template")
    build_history(session)
    assert [rendered.extends_call_id for rendered in session.rendered] == ["", "c0001"]
    assert "<think>\nI should read it.\n</think>" in smollm2_tokenizer.decode(session.rendered[1].token_ids)


def test_template_history_cannot_extend_a_reply_whose_reasoning_was_not_echoed(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer, history="template")
    messages = build_history(session)[:3]
    messages[1] = replace(messages[1], reasoning="")
    rendered = render_request(hermes, Conversation(tuple(messages), TOOLS), session.calls, history="template")
    assert rendered.fresh_reason == TEMPLATE_DROPS_SAMPLED_REASONING


def test_the_longest_history_wins_then_the_latest_call(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    question = Conversation((Message("user", "Pick a number."),))
    _, seven = session.call(question, Message("assistant", "7"))
    _, retry_seven = session.call(question, Message("assistant", "7"))
    _, nine = session.call(question, Message("assistant", "9"))
    # A sub-agent's conversation interleaved with the main one.
    _, sub = session.call(Conversation((Message("user", "Sub-task: list files."),)), Message("assistant", "a.py"))

    follow_seven = render_request(
        hermes, Conversation((*question.messages, seven, Message("user", "Why?"))), session.calls
    )
    follow_nine = render_request(
        hermes, Conversation((*question.messages, nine, Message("user", "Why?"))), session.calls
    )
    follow_sub = render_request(
        hermes, Conversation((Message("user", "Sub-task: list files."), sub, Message("user", "More."))), session.calls
    )
    assert (follow_seven.extends_call_id, follow_nine.extends_call_id, follow_sub.extends_call_id) == (
        "c0002",
        "c0003",
        "c0004",
    )
    assert retry_seven == seven

    session.calls.append(PriorCall("c0005", follow_seven, (5, 6), Message("assistant", "Because.")))
    longer = Conversation(
        (*follow_seven.conversation.messages, Message("assistant", "Because."), Message("user", "Sure?"))
    )
    assert render_request(hermes, longer, session.calls).extends_call_id == "c0005"


def test_forced_tool_choice_opening_is_prompt_and_the_next_call_extends_it(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    forced = Conversation((Message("user", "Read a.py."),), TOOLS, ToolChoice.function("read_file"))
    rendered, parsed = session.call(
        forced, Message("assistant", tool_calls=(ToolCall("", "read_file", {"path": "a.py"}),))
    )
    opening = forced_opening(hermes, forced.tool_choice)
    assert rendered.forced_token_count == len(opening) > 0
    assert list(rendered.token_ids[-len(opening) :]) == opening
    assert parsed.tool_calls == (ToolCall("call_c0001_0", "read_file", {"path": "a.py"}),)

    answer = Conversation((*forced.messages, parsed, Message("tool", "print(1)")), TOOLS)
    follow, _ = session.call(answer, Message("assistant", "It prints 1."))
    head = session.calls[0].prompt.token_ids + session.calls[0].sampled_ids
    assert follow.extends_call_id == "c0001"
    assert follow.token_ids[: len(head)] == head
    assert follow.forced_token_count == 0


class CountingEncoder(TextEncoder):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.encoded: list[str] = []

    def lookup(self, text):
        self.encoded.append(text if isinstance(text, str) else "".join(text))
        return super().lookup(text)


def test_an_extending_call_encodes_only_the_new_messages(smollm2_tokenizer):
    encoder = CountingEncoder(smollm2_tokenizer)
    chat_format = HermesFormat(encoder)
    session = Session(chat_format, smollm2_tokenizer)
    messages = build_history(session) + [Message("user", "A NEW QUESTION")]
    encoder.encoded.clear()
    rendered = render_request(chat_format, Conversation(tuple(messages), TOOLS), session.calls)
    assert rendered.extends_call_id == "c0002"
    encoded = "".join(encoder.encoded)
    assert "A NEW QUESTION" in encoded
    assert "a.py" not in encoded and "# Tools" not in encoded
    assert len(encoded) < 60


def test_a_chain_keeps_its_first_call_s_tools_once_however_often_they_are_sent(hermes, smollm2_tokenizer):
    session = Session(hermes, smollm2_tokenizer)
    messages = [Message("user", "Go.")]
    for turn in range(3):
        tools = tuple(
            replace(tool, parameters=json.loads(json.dumps(tool.parameters))) for tool in TOOLS
        )  # parsed anew
        _, reply = session.call(Conversation(tuple(messages), tools), Message("assistant", f"Step {turn}."))
        messages += [reply, Message("user", "Next.")]
    first, *later = session.rendered
    assert [r.extends_call_id for r in later] == ["c0001", "c0002"]
    assert all(rendered.conversation.tools is first.conversation.tools for rendered in later)


def test_a_render_encodes_each_message_s_text_once_and_nothing_else(smollm2_tokenizer):
    encoder = CountingEncoder(smollm2_tokenizer)
    chat_format = HermesFormat(encoder)
    encoder.encoded.clear()
    conversation = Conversation((Message("system", "Be brief."), Message("user", "Hi.")))
    rendered = render_request(chat_format, conversation)
    # No separator or generation prompt (encoded once, with the format); "" is the unforced tool-call opening.
    assert [text for text in encoder.encoded if text] == ["system\nBe brief.", "user\nHi."]
    assert list(rendered.token_ids) == smollm2_tokenizer.encode(
        chat_format.render_text(conversation), add_special_tokens=False
    )


def test_an_unknown_history_policy_is_refused(hermes):
    with pytest.raises(ValueError, match="faithful"):
        render_request(hermes, Conversation((Message("user", "hi"),)), [], history="verbatim")


@settings(max_examples=200)
@given(sizes=st.lists(st.integers(0, 6), max_size=40), below=st.integers(0, 8))
def test_prior_calls_are_visited_longest_first_then_latest_first(sizes, below):
    """The index visits exactly the calls with fewer messages than `below`, in the order the
    longest-then-latest rule ranks them: (messages, completion order), highest first."""
    calls = [
        PriorCall(
            f"c{i:04d}",
            RenderedPrompt(b"", 0, Conversation(tuple(Message("user", str(j)) for j in range(size)))),
            (),
            Message("assistant"),
        )
        for i, size in enumerate(sizes)
    ]
    index = PriorCalls(calls)
    expected = sorted((i for i, size in enumerate(sizes) if size < below), key=lambda i: (sizes[i], i), reverse=True)
    assert [call.call_id for call in index.longest_first(below)] == [calls[i].call_id for i in expected]
    assert len(index) == len(calls)


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sessions"
SESSION_FILES = sorted(FIXTURES.glob("*.json.zst"))


@pytest.fixture(scope="module")
def shared_format(smollm2_tokenizer):
    """One format for every recorded session, as a gateway has: its cache fills across sessions."""
    return HermesFormat(TextEncoder(smollm2_tokenizer))


@pytest.mark.parametrize("path", SESSION_FILES, ids=[p.name for p in SESSION_FILES])
def test_recorded_sessions_render_to_their_recorded_prompts_with_and_without_the_cache(
    path, shared_format, smollm2_tokenizer
):
    """Each recorded call's request, rendered as the gateway renders it (extending the session's earlier
    calls) by a format whose cache other sessions filled, gives the recorded prompt; and a fresh render of
    each request gives the same ids from that cache, from an empty one, and from the whole text encoded in
    one go."""
    records = read_trajectory(path).calls
    prior: list[PriorCall] = []
    for record in records:
        request = recorded_request(record)
        conversation = request.dialect.parse_request(json.loads(request.body), request.route).conversation
        rendered = render_request(shared_format, conversation, prior)
        assert rendered.token_ids == tuple(record.prompt_token_ids)
        assert rendered.packed_ids == packed_ids(record.prompt_token_ids)
        assert rendered.extends_call_id == record.extends_call_id

        fresh = shared_format.render_prompt(conversation)
        assert shared_format.render_prompt(conversation) == fresh  # every line from the cache now
        uncached = HermesFormat(TextEncoder(smollm2_tokenizer, EncodingCache(max_tokens=0)))
        assert uncached.render_prompt_packed(conversation) == shared_format.render_prompt_packed(conversation)
        assert uncached.render_prompt(conversation) == fresh
        text = shared_format.render_text(conversation)
        assert smollm2_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False) == fresh

        sampled = tuple(record.sampled_token_ids)
        reply = parser.parse(smollm2_tokenizer.decode(sampled, skip_special_tokens=True), call_id=record.call_id)
        prior.append(PriorCall(record.call_id, rendered, sampled, reply.message()))
