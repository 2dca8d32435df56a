"""The core's pure pieces: stop strings, detokenisation, max_tokens clamping, finish kinds, request bodies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.body_decoder import _may_hold_huge_integer, decode_body
from gateway.core import finish_kind, max_tokens_for
from gateway.dialects.base import ErrorKind, FinishKind, GatewayError
from gateway.output_assembler import OutputAssembler, StopScanner, tool_calls_as_text
from gateway.parsers import TextDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart, collect, get_output_parser
from polar.v1 import common_pb2


def _scan(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    scanner = StopScanner(stops)
    text = ""
    for piece in pieces:
        out, stop = scanner.feed(piece)
        text += out
        if stop is not None:
            return text, stop
    return text + scanner.flush(), None


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=200, deadline=None)
@given(
    st.text("abXY", max_size=30),
    st.lists(st.text("abXY", min_size=1, max_size=4), max_size=3),
    st.lists(st.integers(0, 40)),
)
def test_stop_scanning_is_the_same_whatever_the_chunking(text, stops, cuts):
    # The stop that completes first (then the one that starts first) ends the text.
    found = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    expected = (text[: found[0][1]], found[0][2]) if found else (text, None)
    assert _scan(_chunks(text, cuts), stops) == expected


def test_text_that_may_start_a_stop_string_is_held_back_until_decided():
    scanner = StopScanner(["</end>"])
    assert scanner.feed("abc</e") == ("abc", None)
    assert scanner.feed("x") == ("</ex", None)
    assert scanner.feed("</end> tail") == ("", "</end>")


def test_max_tokens_is_clamped_to_what_the_context_leaves():
    assert max_tokens_for(32000, 2768, 32768) == (30000, True)
    assert max_tokens_for(100, 2768, 32768) == (100, False)
    assert max_tokens_for(None, 32000, 32768) == (768, True)


def test_a_prompt_that_fills_the_context_is_a_context_error():
    with pytest.raises(GatewayError) as error:
        max_tokens_for(10, 32768, 32768)
    assert error.value.kind is ErrorKind.CONTEXT_LENGTH


def test_finish_kinds():
    stop, length = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
    assert finish_kind(stop, stop_sequence=None, context_bound=False, tool_calls=True) is FinishKind.TOOL_CALLS
    assert finish_kind(length, stop_sequence=None, context_bound=True, tool_calls=False) is FinishKind.CONTEXT_LENGTH
    assert finish_kind(length, stop_sequence=None, context_bound=False, tool_calls=False) is FinishKind.LENGTH
    assert finish_kind(0, stop_sequence="##", context_bound=False, tool_calls=False) is FinishKind.STOP_SEQUENCE
    with pytest.raises(GatewayError):
        finish_kind(common_pb2.FINISH_REASON_ABORTED, stop_sequence=None, context_bound=False, tool_calls=False)


def _assembler(tokenizer, **options) -> OutputAssembler:
    return OutputAssembler(tokenizer.backend_tokenizer, get_output_parser("hermes").stream(call_id="x"), **options)


def test_multi_byte_characters_split_across_tokens_arrive_whole(smollm2_tokenizer):
    text = "héllo 😀 世界"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assembler = _assembler(smollm2_tokenizer)
    deltas = [event.text for token in ids for event in assembler.add([token], [-0.1])]
    deltas += [event.text for event in assembler.finish()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_a_stop_string_cuts_the_text_and_keeps_the_tokens_up_to_the_one_completing_it(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("one two STOP three four", add_special_tokens=False)
    assembler = _assembler(smollm2_tokenizer, stops=["STOP"])
    assembler.add(ids, [-0.1] * len(ids))
    assembler.finish()
    assert collect(assembler.events).content == "one two"
    assert assembler.stop_sequence == "STOP"
    kept = smollm2_tokenizer.decode(assembler.token_ids)
    assert kept.endswith("STOP") and len(assembler.token_ids) < len(ids)


def test_a_forced_opening_is_parsed_with_the_sample_but_not_recorded(smollm2_tokenizer):
    sample = 'f", "arguments": {"a": 1}}\n</tool_call>'
    ids = smollm2_tokenizer.encode(sample, add_special_tokens=False)
    assembler = _assembler(smollm2_tokenizer, forced_text='<tool_call>\n{"name": "')
    assembler.add(ids, [-0.1] * len(ids))
    assembler.finish()
    output = collect(assembler.events)
    assert [(c.name, c.arguments) for c in output.tool_calls] == [("f", {"a": 1})]
    assert assembler.token_ids == ids


def test_disabled_tools_turn_calls_back_into_text():
    events = [TextDelta("hi"), ToolCallStart(0, "id", "f"), ToolCallArgumentsDelta(0, '{"a": 1}'), ToolCallEnd(0)]
    [text, call] = tool_calls_as_text(events)
    assert text == TextDelta("hi")
    assert call.text.startswith("\n<tool_call>\n") and json.loads(call.text.split("\n")[2])["arguments"] == {"a": 1}


# Pieces of a JSON string's text as a client writes it: surrogate escapes alone and in pairs, other
# escapes, escaped backslashes (after which "ud800" is text), and plain characters.
STRING_PIECES = [
    "\\ud83d",
    "\\ude00",
    "\\uD800",
    "\\uDFFF",
    "\\udbff\\udc00",
    "\\u00e9",
    "\\n",
    "\\\\",
    "\\\\ud800",
    '\\"',
    "a",
    "ud800",
    "\u00e9",
    "🙂",
]


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(STRING_PIECES), max_size=8),
    key_pieces=st.lists(st.sampled_from(STRING_PIECES), max_size=2),
)
def test_a_body_is_refused_exactly_when_it_decodes_to_text_with_a_lone_surrogate(pieces, key_pieces):
    raw = ('{"' + "".join(key_pieces) + '": "' + "".join(pieces) + '", "n": 1}').encode()
    body = json.loads(raw)
    try:
        json.dumps(body, ensure_ascii=False).encode()
        lone = False
    except UnicodeEncodeError:
        lone = True
    if lone:
        with pytest.raises(GatewayError) as caught:
            decode_body(raw)
        assert caught.value.kind is ErrorKind.INVALID_REQUEST and "surrogate" in caught.value.message
    else:
        assert decode_body(raw) == body


# JSON values as a client may write them: integers of every size (past 64 bits too), floats in
# every notation, the literals Python's json reads beyond the standard, and strings, some holding
# long runs of digits (a nanosecond timestamp in a tool's output) after text, a newline, a colon.
LONG_NUMBERS = st.integers(min_value=10**17, max_value=10**40)
JSON_LITERALS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["1.0", "1e3", "-0", "-0.0", "1E-7", "NaN", "Infinity", "-Infinity", "1e400", "true", "null"]),
    st.text(max_size=5).map(json.dumps),
    st.tuples(st.sampled_from(["", "t ", "\n", "k:", "[", "-"]), LONG_NUMBERS).map(
        lambda p: json.dumps(f"{p[0]}{p[1]}")
    ),
)
SEPARATORS = st.sampled_from([",", ", ", ",\n  ", ",\t", " ,  "])


@settings(max_examples=400, deadline=None)
@given(values=st.lists(JSON_LITERALS, max_size=6), members=st.lists(JSON_LITERALS, max_size=3), separator=SEPARATORS)
def test_a_body_reads_as_python_s_json_reads_it(values, members, separator):
    gap = separator.replace(",", "")  # whitespace, as between a member's colon and its value
    fields = "".join(f'{separator}"m{i}":{gap}{value}' for i, value in enumerate(members))
    raw = ('{"tools": [' + separator.join(values) + "]" + fields + "}").encode()
    expected = json.loads(raw)
    body = decode_body(raw)
    # Written back as the prompt writes them: an integer past 64 bits stays that integer, 1 stays 1.
    assert json.dumps(body) == json.dumps(expected)


def test_only_digits_where_a_number_may_begin_send_a_body_to_the_standard_library():
    """A session whose history holds a long run of digits in text (a tool printed a nanosecond
    timestamp) keeps orjson's speed on every later call; a number of 19 digits does not."""
    in_text = [b'{"a": "t 1764201234567890123"}', b'{"a": "x\\n1764201234567890123"}', b'{"a": "' + b"7" * 5000 + b'"}']
    numbers = [b'{"a": 17642012345678901234}', b'{"a":[1,\n -17642012345678901234]}', b"17642012345678901234"]
    assert not any(_may_hold_huge_integer(raw) for raw in in_text)
    assert all(_may_hold_huge_integer(raw) for raw in numbers)


def test_a_body_that_is_not_an_object_is_refused_whichever_reader_reads_it():
    for raw in (b"[1, 2]", b"[12345678901234567890123]", b"NaN"):
        with pytest.raises(GatewayError, match="must be a JSON object"):
            decode_body(raw)
    with pytest.raises(GatewayError, match="not valid JSON"):
        decode_body(b'{"a": ')
