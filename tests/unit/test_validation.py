"""validate_generate: every bad request is refused with the field and value in the message."""

from __future__ import annotations

import math

import pytest

from polar.inference.engines.base import ModelDescription, SamplingConfig
from polar.inference.validation import InvalidRequest, UnknownModel, validate_generate
from polar.v1 import common_pb2, inference_pb2

MODEL = ModelDescription(name="tiny", vocab_size=100, eos_token_ids=(2,), context_length=50, engine="scripted")


def request(prompt=(1, 2, 3), model="", **sampling) -> inference_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 10)
    return inference_pb2.GenerateRequest(
        request_id="r1", model=model, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
    )


def test_valid_request_converts_every_field():
    got = validate_generate(
        request(
            prompt=(0, 99),
            model="tiny",
            temperature=0.5,
            top_p=0.25,
            top_k=7,
            stop_token_ids=[5, 6],
            seed=42,
            ignore_eos=True,
        ),
        MODEL,
    )
    assert got.request_id == "r1"
    assert got.prompt_token_ids == (0, 99)
    assert got.sampling == SamplingConfig(
        max_tokens=10, temperature=0.5, top_p=0.25, top_k=7, stop_token_ids=(5, 6), seed=42, ignore_eos=True
    )


def test_defaults_mean_served_model_no_truncation_and_fresh_seed():
    got = validate_generate(request(), MODEL)
    assert got.sampling.top_p == 1.0  # the wire's 0 = not set
    assert got.sampling.seed is None
    assert got.sampling.temperature == 0.0


def test_seed_zero_is_a_seed():
    assert validate_generate(request(seed=0), MODEL).sampling.seed == 0


def test_unknown_model_is_its_own_error():
    with pytest.raises(UnknownModel) as caught:
        validate_generate(request(model="gpt-9"), MODEL)
    assert caught.value.field == "model"
    assert "'gpt-9'" in str(caught.value) and "'tiny'" in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "field", "fragments"),
    [
        ({"prompt": ()}, "prompt_token_ids", ["prompt_token_ids", "empty"]),
        ({"prompt": (1, 2, 100, 3)}, "prompt_token_ids", ["prompt_token_ids[2] = 100", "[0, 100)"]),
        ({"prompt": (1, -4)}, "prompt_token_ids", ["prompt_token_ids[1] = -4"]),
        ({"max_tokens": 0}, "sampling.max_tokens", ["sampling.max_tokens = 0"]),
        ({"max_tokens": -3}, "sampling.max_tokens", ["sampling.max_tokens = -3"]),
        ({"temperature": -0.5}, "sampling.temperature", ["sampling.temperature = -0.5"]),
        ({"temperature": math.nan}, "sampling.temperature", ["sampling.temperature = nan"]),
        ({"top_p": 1.5}, "sampling.top_p", ["sampling.top_p = 1.5"]),
        ({"top_p": -0.25}, "sampling.top_p", ["sampling.top_p = -0.25"]),
        ({"top_k": -1}, "sampling.top_k", ["sampling.top_k = -1"]),
        ({"prompt": (1,) * 45, "max_tokens": 6}, "sampling.max_tokens", ["45", "6", "51", "50"]),
    ],
)
def test_bad_requests_name_field_and_value(kwargs, field, fragments):
    with pytest.raises(InvalidRequest) as caught:
        validate_generate(request(**kwargs), MODEL)
    assert not isinstance(caught.value, UnknownModel)
    assert caught.value.field == field
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_prompt_that_exactly_fills_the_context_is_allowed():
    assert len(validate_generate(request(prompt=(1,) * 40, max_tokens=10), MODEL).prompt_token_ids) == 40
