"""Properties of the sampling distribution and of the per-request samplers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from polar.inference.sampling import (
    NUCLEUS_CANDIDATES,
    batched_processed_logprobs,
    inverse_cdf,
    new_generator,
    processed_logprobs,
    sample_next_tokens,
)

VOCAB = 64

temperatures = st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5])
top_ks = st.sampled_from([0, 1, 2, 5, 63, 64, 100])
top_ps = st.sampled_from([0.0, 0.05, 0.5, 0.9, 0.99, 1.0])
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def random_logits(seed: int, rows: int = 1, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def params(rows: int, temperature: float, top_k: int, top_p: float):
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.long),
        torch.full((rows,), top_p),
    )


@settings(max_examples=150, deadline=None)
@given(seed=seeds, temperature=temperatures, top_k=top_ks, top_p=top_ps)
def test_probabilities_sum_to_one(seed, temperature, top_k, top_p):
    logprobs = processed_logprobs(random_logits(seed), temperature, top_k, top_p)
    assert logprobs.dtype == torch.float32
    assert logprobs.exp().sum().item() == pytest.approx(1.0, abs=1e-5)


@settings(max_examples=150, deadline=None)
@given(seed=seeds, temperature=temperatures, top_k=top_ks, top_p=top_ps)
def test_kept_tokens_are_the_most_likely_ones(seed, temperature, top_k, top_p):
    logits = random_logits(seed)[0]
    kept = torch.isfinite(processed_logprobs(logits, temperature, top_k, top_p))
    if kept.all():
        return
    assert logits[kept].min() > logits[~kept].max()


@settings(max_examples=150, deadline=None)
@given(seed=seeds, temperature=st.sampled_from([0.3, 1.0, 1.5]), top_k=top_ks)
def test_top_k_keeps_exactly_k_distinct_tokens(seed, temperature, top_k):
    kept = torch.isfinite(processed_logprobs(random_logits(seed)[0], temperature, top_k, 1.0))
    assert kept.sum().item() == (VOCAB if top_k == 0 else min(top_k, VOCAB))


@settings(max_examples=150, deadline=None)
@given(seed=seeds, temperature=st.sampled_from([0.3, 1.0, 1.5]), top_p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_set_reaching_p(seed, temperature, top_p):
    logits = random_logits(seed)[0]
    full = torch.softmax(logits / temperature, -1)
    kept = torch.isfinite(processed_logprobs(logits, temperature, 0, top_p))
    kept_mass = full[kept].sum().item()
    assert kept_mass >= top_p - 1e-6
    # Dropping the least likely kept token must fall below p, else the set was not minimal.
    assert kept_mass - full[kept].min().item() < top_p + 1e-6


@settings(max_examples=100, deadline=None)
@given(seed=seeds, temperature=st.sampled_from([0.5, 1.0]), top_p=st.floats(0.05, 0.95))
def test_top_p_applies_to_the_renormalised_top_k_distribution(seed, temperature, top_p):
    logits = random_logits(seed)[0]
    both = processed_logprobs(logits, temperature, 10, top_p)
    masked = logits.masked_fill(~torch.isfinite(processed_logprobs(logits, 1.0, 10)), -math.inf)
    assert torch.equal(torch.isfinite(both), torch.isfinite(processed_logprobs(masked, temperature, 0, top_p)))


@settings(max_examples=100, deadline=None)
@given(seed=seeds, top_k=top_ks, top_p=top_ps)
def test_greedy_is_the_full_log_softmax(seed, top_k, top_p):
    logits = random_logits(seed)
    assert torch.equal(processed_logprobs(logits, 0.0, top_k, top_p), logits.log_softmax(-1))


@settings(max_examples=100, deadline=None)
@given(seed=seeds, temperature=st.sampled_from([0.3, 1.0, 1.5]))
def test_untruncated_is_the_tempered_log_softmax(seed, temperature):
    logits = random_logits(seed)
    expected = (logits / temperature).log_softmax(-1)
    assert torch.allclose(processed_logprobs(logits, temperature, 0, 1.0), expected, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=seeds, rows=st.lists(st.tuples(temperatures, top_ks, top_ps), min_size=1, max_size=6))
def test_batched_rows_equal_single_rows(seed, rows):
    logits = random_logits(seed, rows=len(rows))
    temperature = torch.tensor([r[0] for r in rows])
    top_k = torch.tensor([r[1] for r in rows])
    top_p = torch.tensor([r[2] for r in rows])
    batched = batched_processed_logprobs(logits, temperature, top_k, top_p)
    for i, (t, k, p) in enumerate(rows):
        assert torch.allclose(batched[i], processed_logprobs(logits[i], t, k, p), atol=1e-6, equal_nan=False)
        assert torch.equal(torch.isfinite(batched[i]), torch.isfinite(processed_logprobs(logits[i], t, k, p)))


def reference_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The definition, straightforwardly in fp64 with a full sort: logits [V] -> [V]."""
    x = logits.double()
    if temperature == 0:
        return x.log_softmax(-1)
    x = x / temperature
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < x.sort(descending=True).values[top_k - 1], -math.inf)
    if 0 < top_p < 1:
        ordered = x.sort(descending=True).values
        before = torch.cumsum(ordered.softmax(-1), 0) - ordered.softmax(-1)
        x = x.masked_fill(x < ordered[(before < top_p).sum() - 1], -math.inf)
    return x.log_softmax(-1)


# Peaked rows keep their nucleus among the first candidates; flat rows need the whole vocabulary.
@settings(max_examples=80, deadline=None)
@given(
    seed=seeds,
    rows=st.lists(
        st.tuples(temperatures, top_ks, st.floats(0.05, 0.99), st.sampled_from([0.3, 12.0])), min_size=1, max_size=4
    ),
)
def test_large_vocabularies_match_the_definition(seed, rows):
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = torch.cat([random_logits(seed + i, vocab=vocab, scale=r[3]) for i, r in enumerate(rows)])
    batched = batched_processed_logprobs(
        logits,
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows]),
    )
    for i, (t, k, p, _) in enumerate(rows):
        expected = reference_logprobs(logits[i], t, k, p)
        assert torch.equal(torch.isfinite(batched[i]), torch.isfinite(expected))
        assert torch.allclose(batched[i].double(), expected, atol=1e-5)


def test_tied_logits_are_kept_or_dropped_together():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    assert torch.isfinite(processed_logprobs(logits, 1.0, top_k=2)).tolist() == [[True, True, True, True, False]]


@settings(max_examples=150, deadline=None)
@given(seed=seeds, temperature=temperatures, top_k=top_ks, top_p=top_ps, draw_seed=seeds)
def test_sampled_token_is_allowed_and_carries_its_processed_logprob(seed, temperature, top_k, top_p, draw_seed):
    logits = random_logits(seed, rows=3)
    tokens, logprobs = sample_next_tokens(
        logits, *params(3, temperature, top_k, top_p), [new_generator(draw_seed + i) for i in range(3)]
    )
    expected = processed_logprobs(logits, temperature, top_k, top_p)
    for row in range(3):
        assert math.isfinite(expected[row, tokens[row]].item())
        assert logprobs[row].item() == expected[row, tokens[row]].item()


@settings(max_examples=100, deadline=None)
@given(
    seed=seeds,
    temperature=temperatures,
    top_k=top_ks,
    top_p=top_ps,
    draw_seed=seeds,
    forced=st.lists(st.integers(-1, VOCAB - 1), min_size=3, max_size=3),
)
def test_a_forced_token_is_taken_with_its_processed_logprob_and_other_rows_sample_as_before(
    seed, temperature, top_k, top_p, draw_seed, forced
):
    logits = random_logits(seed, rows=3)
    sampling = params(3, temperature, top_k, top_p)
    free, free_logprobs = sample_next_tokens(logits, *sampling, [new_generator(draw_seed + i) for i in range(3)])
    tokens, logprobs = sample_next_tokens(
        logits, *sampling, [new_generator(draw_seed + i) for i in range(3)], forced=torch.tensor(forced)
    )
    expected = processed_logprobs(logits, temperature, top_k, top_p)
    for row, token in enumerate(forced):
        if token < 0:
            assert (tokens[row].item(), logprobs[row].item()) == (free[row].item(), free_logprobs[row].item())
        else:  # -inf where truncation drops it, as the trainer computes it
            assert (tokens[row].item(), logprobs[row].item()) == (token, expected[row, token].item())


@settings(max_examples=100, deadline=None)
@given(seed=seeds, temperature=st.sampled_from([0.3, 1.0, 1.5]), draw_seed=seeds)
def test_top_k_one_equals_greedy(seed, temperature, draw_seed):
    logits = random_logits(seed, rows=4)
    tokens, _ = sample_next_tokens(logits, *params(4, temperature, 1, 1.0), [new_generator(draw_seed)] * 4)
    greedy, greedy_logprobs = sample_next_tokens(logits, *params(4, 0.0, 0, 1.0), [new_generator(draw_seed)] * 4)
    assert torch.equal(tokens, greedy)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(greedy_logprobs, logits.log_softmax(-1).gather(-1, greedy[:, None]).squeeze(-1))


def test_greedy_rows_draw_nothing_from_their_generator():
    generator = new_generator(7)
    sample_next_tokens(random_logits(1, rows=1), *params(1, 0.0, 0, 1.0), [generator])
    assert torch.equal(generator.get_state(), new_generator(7).get_state())


@settings(max_examples=60, deadline=None)
@given(
    seed=seeds, draw_seed=seeds, others=st.lists(st.tuples(temperatures, seeds), max_size=5), position=st.integers(0, 5)
)
def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch(seed, draw_seed, others, position):
    position = min(position, len(others))
    logits = random_logits(seed, rows=len(others) + 1)
    alone, alone_logprob = sample_next_tokens(
        logits[position : position + 1], *params(1, 0.8, 20, 0.9), [new_generator(draw_seed)]
    )
    rows = [(t, s) for t, s in others]
    rows.insert(position, (0.8, draw_seed))
    temperature = torch.tensor([t for t, _ in rows])
    top_k = torch.tensor([20 if i == position else 0 for i in range(len(rows))])
    top_p = torch.tensor([0.9 if i == position else 1.0 for i in range(len(rows))])
    tokens, logprobs = sample_next_tokens(logits, temperature, top_k, top_p, [new_generator(s) for _, s in rows])
    assert tokens[position].item() == alone.item()
    assert logprobs[position].item() == pytest.approx(alone_logprob.item(), abs=1e-6)


def test_same_seed_same_tokens_and_different_seeds_differ():
    logits = random_logits(3, rows=1, scale=0.5)

    def run(seed: int) -> list[int]:
        generator = new_generator(seed)
        return [sample_next_tokens(logits, *params(1, 1.0, 0, 1.0), [generator])[0].item() for _ in range(30)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_unseeded_generators_differ():
    assert not torch.equal(new_generator(None).get_state(), new_generator(None).get_state())


def test_sample_frequencies_match_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, -9.0, 0.5]])
    expected = processed_logprobs(logits, 0.9, 0, 0.95).exp()[0]
    generator = new_generator(5)
    draws = 20_000
    tokens, _ = sample_next_tokens(logits.expand(draws, -1), *params(draws, 0.9, 0, 0.95), [generator] * draws)
    frequencies = torch.bincount(tokens, minlength=6).double() / draws
    assert torch.allclose(frequencies, expected.double(), atol=0.012)
    assert frequencies[expected == 0].sum().item() == 0


@pytest.mark.parametrize("uniform", [0.0, 0.5, 1.0 - 2.0**-53])
def test_inverse_cdf_never_returns_a_masked_token(uniform):
    # Masked tokens at both ends and in the middle: the extreme uniforms must land on allowed ones.
    logprobs = torch.tensor([[-math.inf, math.log(0.5), -math.inf, math.log(0.5), -math.inf]])
    token = inverse_cdf(logprobs, torch.tensor([uniform], dtype=torch.float64)).item()
    assert token in (1, 3)
    assert token == (1 if uniform < 0.5 else 3)


@settings(max_examples=150, deadline=None)
@given(
    allowed=st.sets(st.integers(0, 699), min_size=1, max_size=6),
    uniform=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2.0**-53)),
)
def test_inverse_cdf_across_blocks_lands_on_allowed_tokens_in_order(allowed, uniform):
    ordered = sorted(allowed)
    scaled = uniform * len(ordered)
    assume(scaled == 0 or abs(scaled - round(scaled)) > 1e-4)  # fp32 masses blur exact boundaries
    logprobs = torch.full((1, 700), -math.inf)
    logprobs[0, ordered] = -math.log(len(ordered))
    token = inverse_cdf(logprobs, torch.tensor([uniform], dtype=torch.float64)).item()
    assert token == ordered[min(int(uniform * len(ordered)), len(ordered) - 1)]
