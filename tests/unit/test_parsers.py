"""The hermes output parser: whole-text parse, streaming parse over any chunking, forced openings."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat_format import assistant_body
from gateway.conversation import Message, ToolCall
from gateway.parsers import (
    HermesParser,
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    UnknownOutputParserError,
    collect,
    get_output_parser,
    tool_call_id,
)

PROPERTY = settings(max_examples=400, deadline=None)
parser = HermesParser()


def stream_events(text, cuts, call_id="c1", opening=""):
    """Feed `text` to a streaming parser in pieces cut at `cuts`; return every event."""
    stream = parser.stream(call_id=call_id)
    events = stream.feed(opening) if opening else []
    bounds = [0, *sorted(set(cut % (len(text) + 1) for cut in cuts)), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        events += stream.feed(text[start:end])
    return events + stream.finish()


# Outputs built from the pieces a model writes, including broken, nested and unclosed ones.
valid_calls = st.builds(
    lambda name, arguments, pad: (
        f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': arguments})}{pad}</tool_call>"
    ),
    st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
    st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4) | st.booleans(), max_size=2),
    st.sampled_from(["", "\n", " \n"]),
)
PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<think",
    "</tool_",
    "<",
    ">",
    "\n",
    "\n\n",
    " ",
    "{",
    "}",
    '{"name": "f", "arguments": 3}',
    '{"name": "", "arguments": {}}',
    '{"name": "f", "arguments": {}',
    "[1]",
    '{"name": "f", "arguments": {"x": NaN}}',
    "é",
    "🙂",
]
outputs = st.lists(st.one_of(st.text(max_size=6), st.sampled_from(PIECES), valid_calls), max_size=12).map("".join)


@PROPERTY
@given(text=outputs, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_streaming_events_fold_into_the_whole_text_parse(text, cuts):
    assert collect(stream_events(text, cuts)) == parser.parse(text, call_id="c1")


@PROPERTY
@given(text=outputs, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_every_tool_call_opens_streams_its_arguments_and_closes_in_order(text, cuts):
    events = [
        event
        for event in stream_events(text, cuts)
        if isinstance(event, (ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd))
    ]
    for index, triple in enumerate(zip(events[0::3], events[1::3], events[2::3])):
        assert [type(event) for event in triple] == [ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]
        assert {event.index for event in triple} == {index}
        assert triple[0].id == tool_call_id("c1", index)
    assert len(events) % 3 == 0


@PROPERTY
@given(text=st.text(alphabet=st.characters(blacklist_characters="<"), max_size=30).filter(lambda t: t == t.rstrip()))
def test_plain_text_is_emitted_as_soon_as_it_arrives(text):
    stream = parser.stream(call_id="c1")
    emitted = "".join(event.text for event in stream.feed(text))
    assert emitted == text.strip()


def test_only_a_possible_tag_start_and_trailing_whitespace_are_held_back():
    stream = parser.stream(call_id="c1")
    assert stream.feed("Hello <thi") == [TextDelta("Hello")]
    assert stream.feed("s is not a tag") == [TextDelta(" <this is not a tag")]
    assert stream.feed(" <think>Plan") == [ReasoningDelta("Plan")]
    assert stream.feed(" more </th") == [ReasoningDelta(" more")]
    assert stream.feed("ink>\n\nDone.") == [TextDelta("\nDone.")]
    assert stream.finish() == []


def test_a_tool_call_is_emitted_when_its_block_closes():
    stream = parser.stream(call_id="c9")
    assert stream.feed('Let me check.\n<tool_call>\n{"name": "get_weather", ') == [TextDelta("Let me check.")]
    assert stream.feed('"arguments": {"city": "Paris"}}\n</tool') == []
    assert stream.feed("_call>") == [
        ToolCallStart(0, "call_c9_0", "get_weather"),
        ToolCallArgumentsDelta(0, '{"city": "Paris"}'),
        ToolCallEnd(0),
    ]


def test_reasoning_content_and_calls_are_separated():
    text = (
        "<think>\nThe user wants weather.\n</think>\n\nChecking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert parser.parse(text, call_id="c3") == ParsedOutput(
        content="Checking both.",
        reasoning="The user wants weather.",
        tool_calls=(
            ToolCall("call_c3_0", "get_weather", {"city": "Paris"}),
            ToolCall("call_c3_1", "get_weather", {"city": "Rome"}),
        ),
    )


def test_a_tool_call_inside_reasoning_is_not_a_call():
    text = '<think>maybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call></think>No call.'
    parsed = parser.parse(text, call_id="c1")
    assert parsed.tool_calls == ()
    assert parsed.reasoning == 'maybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parsed.content == "No call."


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"x": 1}',  # unbalanced
        '{"name": "f", "arguments": "{\\"x\\": 1}"}',  # arguments not an object
        '{"arguments": {}}',  # no name
        '{"name": "f", "arguments": {"x": NaN}}',  # not JSON
        "[1, 2]",
    ],
)
def test_malformed_tool_call_json_stays_text(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    assert parser.parse(text, call_id="c1") == ParsedOutput(content=text)


def test_an_output_cut_inside_a_block_keeps_what_it_has():
    cut_call = 'Sure.\n<tool_call>\n{"name": "f", "argum'
    assert parser.parse(cut_call, call_id="c1") == ParsedOutput(content=cut_call)
    assert parser.parse("<think>still thinking", call_id="c1") == ParsedOutput(reasoning="still thinking")


def test_a_forced_opening_and_the_sample_parse_as_one_call():
    opening = '<tool_call>\n{"name": "'
    sampled = 'read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
    expected = ParsedOutput(tool_calls=(ToolCall("call_c2_0", "read_file", {"path": "a.txt"}),))
    assert parser.parse(opening + sampled, call_id="c2") == expected
    assert collect(stream_events(sampled, [3, 9, 20], call_id="c2", opening=opening)) == expected


plain = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=["Cs"]), max_size=20).map(
    str.strip
)


@PROPERTY
@given(
    content=plain,
    reasoning=plain,
    calls=st.lists(
        st.builds(
            ToolCall,
            id=st.just(""),
            name=st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
            arguments=st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=5), max_size=2),
        ),
        max_size=3,
    ),
)
def test_parsing_a_rendered_assistant_turn_gives_the_message_back(content, reasoning, calls):
    message = Message("assistant", content, reasoning, tuple(calls))
    parsed = parser.parse(assistant_body(message), call_id="c5")
    with_ids = tuple(ToolCall(tool_call_id("c5", index), call.name, call.arguments) for index, call in enumerate(calls))
    assert parsed.message() == Message("assistant", content, reasoning, with_ids)


def test_registry():
    assert get_output_parser("hermes").name == "hermes"
    with pytest.raises(UnknownOutputParserError, match="hermes"):
        get_output_parser("mistral")
