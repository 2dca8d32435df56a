"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (the `tiny` model's), loaded once per session."""
    from transformers import AutoTokenizer

    from polar.inference.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny"))
