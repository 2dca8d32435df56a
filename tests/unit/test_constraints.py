"""Constrained decoding's pure parts: masks from bitmasks, masked logits, and each dialect's forcing
and schema options as the one constraint (gateway/request_constraint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from gateway.conversation import Conversation, Message, ToolChoice, ToolSpec
from gateway.dialects import anthropic, gemini, openai_chat, openai_responses
from gateway.dialects.base import ErrorKind, GatewayError, Route
from gateway.request_constraint import call_schema, output_constraint
from polar.inference.constraints import (
    ConstraintError,
    ConstraintViolation,
    OutputConstraint,
    TokenGrammar,
    bitmask_to_bool,
    expressible_schema,
    grammar,
    mask_logits_,
    masked_logits,
)
from polar.trajectory.session_file import read_trajectory
from trainer.backends.megatron.logprobs import vocab_parallel_logprobs
from trainer.grpo import constrained_logits, token_logprobs

SESSIONS = Path(__file__).parents[1] / "fixtures" / "sessions"


@given(st.integers(1, 4), st.integers(1, 200), st.randoms(use_true_random=False))
@settings(max_examples=50, deadline=None)
def test_a_bitmask_unpacks_to_the_tokens_of_its_set_bits(rows, vocab, rng):
    words = (vocab + 31) // 32 + rng.randint(-1, 1) * (vocab > 32)  # a mask shorter or longer than the vocab
    allowed = np.array([[rng.random() < 0.3 for _ in range(words * 32)] for _ in range(rows)])
    bitmask = np.zeros((rows, words), dtype=np.int64)
    for bit in range(32):
        bitmask |= allowed[:, bit::32].astype(np.int64) << bit
    unpacked = bitmask_to_bool(bitmask.astype(np.uint32).view(np.int32), vocab)
    expected = np.zeros((rows, vocab), dtype=bool)
    expected[:, : min(vocab, words * 32)] = allowed[:, :vocab]
    assert unpacked.shape == (rows, vocab) and (unpacked == expected).all()


def packed(allowed: np.ndarray) -> np.ndarray:
    """bool [N, V] -> the grammar's int32 bitmask [N, ceil(V / 32)] (bit j of word w: token 32w + j)."""
    words = (allowed.shape[1] + 31) // 32
    padded = np.zeros((allowed.shape[0], words * 32), dtype=bool)
    padded[:, : allowed.shape[1]] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


@given(st.integers(2, 6), st.integers(2, 40), st.data())
@settings(max_examples=50, deadline=None)
def test_masking_in_place_and_differentiably_agree(rows, vocab, data):
    logits = torch.randn(rows, vocab)
    picked = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    allowed = np.random.default_rng(rows * vocab).random((len(picked), vocab)) < 0.5
    allowed[:, 0] = True  # a mask always leaves a token
    in_place = logits.clone()
    mask_logits_(in_place, picked, packed(allowed))
    differentiable = masked_logits(logits, torch.tensor(picked), torch.from_numpy(allowed))
    assert torch.equal(in_place, differentiable)
    untouched = [row for row in range(rows) if row not in picked]
    assert torch.equal(in_place[untouched], logits[untouched])
    assert torch.isinf(in_place[picked]).eq(torch.from_numpy(~allowed)).all()


def test_the_trainer_masks_only_the_trainable_targets_it_holds():
    logits = torch.zeros(3, 4, requires_grad=True)
    flat = torch.tensor([5, 9, 12])  # three trainable targets' flat positions
    index = torch.tensor([7, 12])  # 7 is no trainable target: skipped
    allowed = torch.tensor([[True, False, False, False], [False, True, True, False]])
    masked = constrained_logits(logits, flat, index, allowed)
    assert torch.isinf(masked[2]).tolist() == [True, False, False, True]
    assert not torch.isinf(masked[:2]).any()
    masked[2, 1].backward()
    assert logits.grad[2, 1] == 1 and logits.grad.sum() == 1


@given(st.integers(1, 6), st.integers(2, 40), st.integers(1, 4), st.integers(0, 3), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_each_vocabulary_slice_masked_is_the_whole_vocabulary_masked(targets, vocab, tp, padding, rng):
    """A tensor-parallel rank masks its own slice of the (padded) vocabulary with the same function:
    the slices joined, padding dropped, are the whole vocabulary masked; and the vocabulary-parallel
    logprob over masked logits (fp32, one rank) is the engine's, values and gradients."""
    width = -(-vocab // tp) + padding  # each rank's columns; the last ranks' may be padding only
    logits = torch.randn(targets, width * tp, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    flat = torch.tensor(sorted(rng.sample(range(3 * targets), targets)))  # [K] trainable targets' positions
    index = torch.tensor(sorted(rng.sample(range(3 * targets), rng.randint(1, 2 * targets))))  # [M]
    allowed = torch.tensor([[rng.random() < 0.4 for _ in range(vocab)] for _ in index])  # [M, V]
    allowed[:, rng.randrange(vocab)] = True
    whole = constrained_logits(logits[:, :vocab], flat, index, allowed)
    slices = [
        constrained_logits(logits[:, r * width : (r + 1) * width], flat, index, allowed, vocab_start=r * width)
        for r in range(tp)
    ]
    assert torch.equal(torch.cat(slices, 1)[:, :vocab], whole)
    # Each target is a token its mask allows, sampled at a temperature.
    allowed_ids = [row.isfinite().nonzero().squeeze(-1).tolist() for row in whole]
    targets_ids = torch.tensor([rng.choice(ids) for ids in allowed_ids])
    temperature = torch.tensor([rng.choice([0.0, 0.5, 1.0, 1.7]) for _ in range(targets)])
    engine_logits, parallel_logits = (whole.detach().clone().requires_grad_() for _ in range(2))
    engine = token_logprobs(
        engine_logits, targets_ids, temperature, torch.zeros(targets, dtype=torch.long), torch.ones(targets)
    )
    parallel = vocab_parallel_logprobs(parallel_logits, targets_ids, temperature, vocab_start=0, vocab_size=vocab)
    torch.testing.assert_close(parallel, engine, atol=1e-5, rtol=0)
    weights = torch.randn(targets)
    (engine * weights).sum().backward()
    (parallel * weights).sum().backward()
    torch.testing.assert_close(parallel_logits.grad, engine_logits.grad, atol=1e-5, rtol=0)


WEATHER = ToolSpec("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})
ALARM = ToolSpec("set_alarm", parameters={"properties": {"hour": {"type": "integer"}}})
TOOLS = (WEATHER, ALARM)


class Hermes:
    def tool_call_delimiters(self):
        return TOOL_CALL_OPEN, TOOL_CALL_CLOSE


def constraint_of(choice: ToolChoice, schema=None) -> OutputConstraint | None:
    return output_constraint(Conversation((Message("user", "hi"),), TOOLS, choice), schema, Hermes())


def test_a_named_function_is_one_call_schema_in_the_tool_call_format():
    constraint = constraint_of(ToolChoice.function("set_alarm"))
    assert (constraint.kind, constraint.prefix, constraint.suffix) == ("tool_call", "<tool_call>\n", "\n</tool_call>")
    schema = json.loads(constraint.json_schema)
    assert schema == call_schema(ALARM)
    assert schema["properties"]["arguments"]["type"] == "object"  # arguments are always an object


@pytest.mark.parametrize(
    ("choice", "names"),
    [(ToolChoice.required(), ["get_weather", "set_alarm"]), (ToolChoice.required(("set_alarm",)), ["set_alarm"])],
)
def test_a_required_call_is_any_of_its_allowed_functions(choice, names):
    schema = json.loads(constraint_of(choice).json_schema)
    options = schema.get("anyOf", [schema])
    assert [option["properties"]["name"]["const"] for option in options] == names


def test_no_forcing_and_no_schema_is_no_constraint_and_a_forced_call_wins_over_a_schema():
    assert constraint_of(ToolChoice.auto()) is None and constraint_of(ToolChoice.none(), None) is None
    schema = {"type": "object"}
    assert constraint_of(ToolChoice.auto(), schema) == OutputConstraint("json_schema", json.dumps(schema))
    assert constraint_of(ToolChoice.function("get_weather"), schema).kind == "tool_call"


def test_a_schema_the_compiler_refuses_is_an_invalid_request_naming_the_problem():
    with pytest.raises(GatewayError) as error:
        constraint_of(ToolChoice.auto(), {"type": "strin"})
    assert error.value.kind is ErrorKind.INVALID_REQUEST and "Invalid type: strin" in error.value.message
    with pytest.raises(ConstraintError, match="not JSON"):
        grammar(OutputConstraint("json_schema", "{"))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("module", "body", "route", "expected"),
    [
        (
            openai_chat,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            Route("/v1/chat/completions"),
            SCHEMA,
        ),
        (openai_chat, {"response_format": {"type": "json_object"}}, Route("/v1/chat/completions"), {"type": "object"}),
        (openai_chat, {"response_format": {"type": "text"}}, Route("/v1/chat/completions"), None),
        (
            openai_responses,
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
            Route("/v1/responses"),
            SCHEMA,
        ),
        (
            gemini,
            {"generationConfig": {"responseJsonSchema": SCHEMA}},
            Route("/v1beta/models/m:generateContent", "m"),
            SCHEMA,
        ),
        (
            gemini,
            {"generationConfig": {"responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "INTEGER"}}}}},
            Route("/v1beta/models/m:generateContent", "m"),
            {**SCHEMA, "additionalProperties": False},
        ),
        (anthropic, {"max_tokens": 8}, Route("/v1/messages"), None),
    ],
)
def test_each_dialects_schema_option_is_the_output_schema(module, body, route, expected):
    base = (
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        if module is gemini
        else {"model": "m", "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    )
    if module is openai_chat or module is anthropic:
        base.pop("input")
    if module is openai_responses:
        base.pop("messages")
    request = module.DIALECT.parse_request({**base, **body}, route)
    assert request.output_schema == expected


# -- propertyNames, which the grammar compiler lacks, rewritten where the rewrite is exact -------------

NAMES = ("a", "b", "xa", "xb")
NAME_RULES = st.sampled_from(
    [
        {},
        {"type": "string"},
        {"type": "string", "description": "a key"},
        {"pattern": "^x"},
        {"enum": ["a", "xb"]},
        {"const": "b"},
        {"maxLength": 1},
    ]
)
VALUE_SCHEMAS = st.sampled_from([{}, {"type": "integer"}, {"type": "string"}])


@st.composite
def objects_with_property_names(draw):
    """(a schema with propertyNames, an instance that may or may not be valid for it)."""
    schema: dict = {"type": "object", "propertyNames": draw(NAME_RULES)}
    named = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=2))
    if named:
        schema["properties"] = {name: draw(VALUE_SCHEMAS) for name in named}
    if draw(st.booleans()):
        schema["additionalProperties"] = draw(st.sampled_from([{}, {"type": "integer"}, False]))
    if named and draw(st.booleans()):
        schema["required"] = named[:1]
    keys = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=3))
    # The grammar writes named properties first, in the schema's order (as a model is prompted to).
    keys.sort(key=lambda key: named.index(key) if key in named else len(named))
    instance = {key: draw(st.one_of(st.integers(0, 9), st.sampled_from(["s", "t"]))) for key in keys}
    return schema, instance


@pytest.fixture(scope="module")
def tiny_grammar():
    return TokenGrammar.for_model("tiny")


def _admits(token_grammar: TokenGrammar, schema: dict, value: object) -> bool:
    """Whether the grammar admits `value` written canonically, token by token, up to the end of the reply."""
    constraint = OutputConstraint("json_schema", json.dumps(schema))
    tokenizer = token_grammar.tokenizer
    ids = tokenizer.tokenize_str(json.dumps(value))
    try:
        token_grammar.replay(constraint, ids)
    except ConstraintViolation:
        return False
    matcher = token_grammar.matcher(constraint)
    assert matcher.consume_tokens(ids)
    return matcher.is_accepting()


@given(objects_with_property_names())
@settings(max_examples=60, deadline=None)
def test_a_rewritten_property_names_rule_admits_exactly_what_the_schema_does(tiny_grammar, case):
    schema, instance = case
    rewritten = expressible_schema(schema)
    valid = jsonschema.Draft202012Validator(schema).is_valid(instance)
    assert jsonschema.Draft202012Validator(rewritten).is_valid(instance) == valid
    if schema["propertyNames"].get("type", "string") == "string" and set(schema["propertyNames"]) <= {
        "type",
        "description",
    }:
        assert "propertyNames" not in rewritten  # a rule that admits every name says nothing
    if "propertyNames" in rewritten:  # not expressible: left for the compiler to refuse, as before
        with pytest.raises(ConstraintError, match="propertyNames"):
            grammar(OutputConstraint("json_schema", json.dumps(schema)))
        return
    assert _admits(tiny_grammar, schema, instance) == valid


@pytest.mark.parametrize("rule", [{"pattern": "^x"}, {"enum": ["a", "xb"]}, {"const": "b"}])
def test_a_pattern_an_enum_or_a_const_rule_becomes_keywords_the_compiler_has(rule):
    schema = {"type": "object", "propertyNames": rule, "additionalProperties": {"type": "integer"}}
    rewritten = expressible_schema({"type": "array", "items": schema})
    assert "propertyNames" not in json.dumps(rewritten)
    grammar(OutputConstraint("json_schema", json.dumps(rewritten)))


def test_claude_codes_records_compile_and_a_forced_call_to_them_is_checked_whole(tiny_grammar):
    """Claude Code writes its records (TaskCreate's metadata) as zod does: propertyNames {type: string}."""
    first = read_trajectory(SESSIONS / "claude-code.json.zst").calls[0]
    tools = {tool["name"]: tool["input_schema"] for tool in json.loads(first.request_body)["tools"]}
    task_create = tools["TaskCreate"]
    assert task_create["properties"]["metadata"]["propertyNames"] == {"type": "string"}
    call = {"subject": "Run tests", "description": "all of them", "metadata": {"owner": "me", "n": 2}}
    assert _admits(tiny_grammar, task_create, call)
    assert not _admits(tiny_grammar, task_create, {**call, "extra": 1})
    assert not _admits(tiny_grammar, task_create, {"subject": "no description"})
