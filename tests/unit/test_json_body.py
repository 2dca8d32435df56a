"""Request bodies with known values (gateway/body_decoder.py): read once, and read exactly as without them."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.body_decoder import BodyDecoder, KnownConversations, decode_body
from gateway.dialects.base import ByIdentity, ConversationFold, GatewayError
from gateway.replay import NotReplayable, recorded_request
from polar.trajectory.session_file import SUFFIXES, read_trajectory

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sessions"
SESSION_FILES = sorted(p for p in FIXTURES.iterdir() if p.name.endswith(SUFFIXES))


def _recorded_requests(path: Path) -> list:
    requests = []
    for call in read_trajectory(path).calls:
        try:
            requests.append(recorded_request(call))
        except NotReplayable:
            continue
    return requests


def _outcome(decode, raw: bytes) -> tuple[str, str]:
    """What a reader makes of `raw`, written so that 1, 1.0 and True differ."""
    try:
        return "body", json.dumps(decode(raw))
    except GatewayError as exc:
        return "error", exc.message


@pytest.mark.parametrize("path", SESSION_FILES, ids=[p.name for p in SESSION_FILES])
def test_a_harness_s_tools_and_system_prompt_are_read_once_per_gateway(path):
    """Every recorded call reads as it reads without known values; the second session's first call
    (the same body again) gets the first one's tools and first message, the same objects, and so do
    later calls after a dialect read the body (a dialect that changed what it reads would show)."""
    requests = _recorded_requests(path)
    assert requests, f"{path.name} holds no replayable call"
    decoder = BodyDecoder()
    first = decoder.decode(requests[0].body)
    requests[0].dialect.parse_request(first, requests[0].route)
    assert decoder.known_values >= 1, "nothing was learned from a harness's first call"
    for request in (requests[0], *requests[1:]):
        body = decoder.decode(request.body)
        assert json.dumps(body) == json.dumps(decode_body(request.body))
        assert body["tools"] is first["tools"]
        request.dialect.parse_request(body, request.route)
    conversation = next(key for key in ("messages", "input", "contents") if key in first)
    if len(orjson.dumps(first[conversation][0])) >= 2048:
        assert decoder.decode(requests[-1].body)[conversation][0] is first[conversation][0]


# A value long enough to be kept: a tool list as a harness sends it.
TOOL = st.fixed_dictionaries(
    {
        "name": st.text(min_size=1, max_size=8),
        "description": st.text(max_size=40),
        "input_schema": st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "n": st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False)),
            }
        ),
    }
)
KNOWN = st.lists(TOOL, min_size=1, max_size=4)


def _places(known: bytes) -> st.SearchStrategy[bytes]:
    """Members of a body: the known text in its place and out of it, and what else a body may hold."""
    escaped = json.dumps(known.decode()).encode()
    return st.sampled_from(
        [
            b'"tools":' + known,  # in place
            b'"tools": ' + known,  # in place, written with a space
            b'"tools":' + known[:-1] + b",1]",  # the known text cut short, then more items
            b'"tools":[]',  # the member with another value
            b'"x":{"tools":' + known + b"}",  # nested
            b'"s":' + escaped,  # inside a string
            b'"s":"' + known,  # a string left open before it: not valid JSON
            b'"messages":[' + known + b',{"role":"user"}]',  # the first item of a conversation
            b'"messages":[' + known + b"0]",  # an item that does not end where the text does
            b'"messages":[1,' + known + b"]",  # a later item
            b'"n":12345678901234567890123',  # past 64 bits: the standard library's reading
            b'"u":"\\ud800"',  # an unpaired surrogate: refused
            b'"f":1.0',
        ]
    )


@settings(max_examples=300, deadline=None)
@given(known_value=KNOWN, data=st.data())
def test_a_body_reads_as_without_known_values_wherever_their_texts_are(known_value, data):
    known = orjson.dumps(known_value)
    decoder = BodyDecoder(min_bytes=8)
    # Learned from a body that holds them in their places.
    decoder.decode(b'{"tools":' + known + b',"messages":[' + known + b"]}")
    assert decoder.known_values == 2
    members = data.draw(st.lists(_places(known), min_size=1, max_size=4))
    raw = b"{" + b",".join(members) + b"}"
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]  # cut anywhere: invalid JSON
    assert _outcome(decoder.decode, raw) == _outcome(decode_body, raw)


def test_texts_written_another_way_are_not_learned_and_bodies_still_read():
    tools = [{"name": "edit", "description": "é" * 2000}]
    escaped = json.dumps({"tools": tools}).encode()  # non-ASCII escaped: not orjson's text
    decoder = BodyDecoder()
    assert decoder.decode(escaped) == {"tools": tools}
    assert decoder.known_values == 0
    decoder.decode(escaped)  # looked for once, not again: nothing learned, nothing broken
    assert decoder.known_values == 0
    assert decoder.decode(orjson.dumps({"tools": tools})) == {"tools": tools}
    assert decoder.known_values == 1


def test_known_values_are_bounded_per_place():
    decoder = BodyDecoder(min_bytes=8, max_values=3)
    tools = [[{"name": f"tool{i}", "description": "d" * 100}] for i in range(5)]
    firsts = [{"role": "system", "content": f"prompt {i} " * 10} for i in range(5)]
    for i in range(5):
        decoder.decode(orjson.dumps({"tools": tools[0], "messages": [firsts[i]]}))
    # Five first messages came and went; the tools seen with each stayed.
    assert decoder.known_values == 4
    first = decoder.decode(orjson.dumps({"tools": tools[0]}))["tools"]
    assert decoder.decode(orjson.dumps({"tools": tools[0]}))["tools"] is first


def test_by_identity_converts_a_value_once_while_it_is_held():
    converted = []

    def convert(value):
        converted.append(value)
        if value == "bad":
            raise ValueError(value)
        return len(value)

    memo = ByIdentity(convert, entries=2)
    tools = ["a", "b"]
    assert memo(tools) == 2 and memo(tools) == 2
    assert len(converted) == 1
    assert memo(list(tools)) == 2  # equal but another object: converted again
    assert len(converted) == 2
    for _ in range(2):
        with pytest.raises(ValueError):
            memo("bad")
    assert len(converted) == 4  # a failure is not remembered
    memo(["c"]), memo(["d"])  # two more push `tools` out
    memo(tools)
    assert len(converted) == 7


# ------------------------------------------------------------------------------ conversations

ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=12)}),
    st.integers(-5, 5),
    st.text(max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["extend", "edit", "spaced", "other", "same", "nested"]), st.lists(ITEM, max_size=3)),
        min_size=1,
        max_size=6,
    ),
    start=st.lists(ITEM, min_size=1, max_size=3),
)
def test_a_session_s_later_calls_read_as_without_known_conversations(calls, start):
    """A session's calls extend its conversation, edit an earlier item, write it with spaces, send
    another conversation, the same again, or the known one nested in another member before theirs:
    each reads as without known conversations, and a call that extends the one before gets the
    earlier items as the very objects the earlier call got."""
    decoder = BodyDecoder()
    conversations = KnownConversations()
    items = list(start)
    previous, previous_compact = None, False
    for change, added in calls:
        if change == "edit":
            items[0] = {"role": "user", "content": "edited"}
        elif change == "other":
            items = [{"role": "user", "content": "another conversation"}]
        items = items + added if change in ("extend", "edit", "other") else items
        text = {"model": "m", "messages": items}
        if change == "nested":
            text = {"model": "m", "x": {"messages": items}, "messages": [*added, "other"]}
        raw = json.dumps(text, separators=(", ", ": ")).encode() if change == "spaced" else orjson.dumps(text)
        body = decoder.decode(raw, conversations)
        assert json.dumps(body) == json.dumps(decode_body(raw))
        if change in ("extend", "same") and previous is not None and previous_compact:
            assert all(a is b for a, b in zip(body["messages"], previous["messages"]))
        previous, previous_compact = body, change not in ("spaced", "nested")


def test_a_session_s_conversation_is_read_once():
    decoder = BodyDecoder()
    conversations = KnownConversations()
    items = [{"role": "user", "content": "hi"}]
    bodies = []
    for turn in range(4):
        items = [*items, {"role": "assistant", "content": f"reply {turn}"}, {"role": "user", "content": f"next {turn}"}]
        bodies.append(decoder.decode(orjson.dumps({"messages": items, "max_tokens": 5}), conversations))
    assert all(bodies[-1]["messages"][i] is bodies[0]["messages"][i] for i in range(3))
    assert bodies[-1]["messages"][-3] is bodies[-2]["messages"][-1]
    # Another session's decoder state is its own: the same body reads anew.
    assert (
        decoder.decode(orjson.dumps({"messages": items}), KnownConversations())["messages"][0]
        is not bodies[0]["messages"][0]
    )


def test_a_fold_converts_only_the_items_a_later_call_adds():
    steps = []

    def step(state, index, item):
        steps.append(index)
        state.append((index, item["n"]))

    fold = ConversationFold(list, step, list)
    first = [{"n": 1}, {"n": 2}]
    assert fold(first) == [(0, 1), (1, 2)]
    later = [*first, {"n": 3}]
    assert fold(later) == [(0, 1), (1, 2), (2, 3)]
    assert steps == [0, 1, 2]
    # Equal items that are other objects, or the same items in another order, convert anew.
    assert fold([{"n": 1}, {"n": 2}]) == [(0, 1), (1, 2)]
    assert fold([first[1], first[0]]) == [(0, 2), (1, 1)]
    assert steps == [0, 1, 2, 0, 1, 0, 1]
    # A kept state is never changed by a conversion that resumed from it.
    assert fold(later) == [(0, 1), (1, 2), (2, 3)] and fold([*first, {"n": 9}])[-1] == (2, 9)
    assert fold(later) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("path", SESSION_FILES, ids=[p.name for p in SESSION_FILES])
def test_recorded_calls_convert_alike_whether_their_items_are_known_or_not(path):
    """Each recorded call, read with the session's known conversations and converted resuming the
    call before, is the request it is read and converted afresh."""
    decoder = BodyDecoder()
    conversations = KnownConversations()
    for request in _recorded_requests(path):
        resumed = request.dialect.parse_request(decoder.decode(request.body, conversations), request.route)
        afresh = request.dialect.parse_request(decode_body(request.body), request.route)
        assert resumed.conversation == afresh.conversation
