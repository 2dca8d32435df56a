"""Constrained decoding's pure parts: masks from bitmasks, masked logits, and each dialect's forcing
and schema options as the one constraint (gateway/constraint.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from gateway.constraint import call_schema, output_constraint
from gateway.conversation import Conversation, Message, ToolChoice, ToolSpec
from gateway.dialects import anthropic, gemini, openai_chat, openai_responses
from gateway.dialects.base import ErrorKind, GatewayError, Route
from polar.inference.constraints import (
    ConstraintError,
    OutputConstraint,
    bitmask_to_bool,
    grammar,
    mask_logits_,
    masked_logits,
)
from trainer.backends.megatron.logprobs import vocab_parallel_logprobs
from trainer.grpo import constrained_logits, token_logprobs


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


@given(st.integers(2, 6), st.integers(2, 40), st.data())
@settings(max_examples=50, deadline=None)
def test_masking_in_place_and_differentiably_agree(rows, vocab, data):
    logits = torch.randn(rows, vocab)
    picked = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    allowed = np.random.default_rng(rows * vocab).random((len(picked), vocab)) < 0.5
    allowed[:, 0] = True  # a mask always leaves a token
    in_place = logits.clone()
    mask_logits_(in_place, picked, allowed)
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
    slices = [constrained_logits(logits[:, r * width : (r + 1) * width], flat, index, allowed, vocab_start=r * width)
              for r in range(tp)]
    assert torch.equal(torch.cat(slices, 1)[:, :vocab], whole)
    # Each target is a token its mask allows, sampled at a temperature.
    allowed_ids = [row.isfinite().nonzero().squeeze(-1).tolist() for row in whole]
    targets_ids = torch.tensor([rng.choice(ids) for ids in allowed_ids])
    temperature = torch.tensor([rng.choice([0.0, 0.5, 1.0, 1.7]) for _ in range(targets)])
    engine_logits, parallel_logits = (whole.detach().clone().requires_grad_() for _ in range(2))
    engine = token_logprobs(engine_logits, targets_ids, temperature, torch.zeros(targets, dtype=torch.long),
                            torch.ones(targets))
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
        (openai_chat, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
         Route("/v1/chat/completions"), SCHEMA),
        (openai_chat, {"response_format": {"type": "json_object"}}, Route("/v1/chat/completions"), {"type": "object"}),
        (openai_chat, {"response_format": {"type": "text"}}, Route("/v1/chat/completions"), None),
        (openai_responses, {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
         Route("/v1/responses"), SCHEMA),
        (gemini, {"generationConfig": {"responseJsonSchema": SCHEMA}}, Route("/v1beta/models/m:generateContent", "m"),
         SCHEMA),
        (gemini, {"generationConfig": {"responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "INTEGER"}}}}},
         Route("/v1beta/models/m:generateContent", "m"), {**SCHEMA, "additionalProperties": False}),
        (anthropic, {"max_tokens": 8}, Route("/v1/messages"), None),
    ],
)  # fmt: skip
def test_each_dialects_schema_option_is_the_output_schema(module, body, route, expected):
    base = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]} if module is gemini else {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "input": "hi"
    }  # fmt: skip
    if module is openai_chat or module is anthropic:
        base.pop("input")
    if module is openai_responses:
        base.pop("messages")
    request = module.DIALECT.parse_request({**base, **body}, route)
    assert request.output_schema == expected
