"""Micro-batch layouts: every trainable token lands once, shifted onto the position that predicts it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.batches import MicroBatch, TraceTooLongError, pack, pad
from trainer.sequences import TrainSequence

VOCAB = 64


def make_sequence(name: str, length: int, seed: int, vocab: int = VOCAB) -> TrainSequence:
    """A trace of ``length`` tokens: a prompt, then random sampled spans with random sampling values."""
    rng = np.random.default_rng(seed)
    mask = rng.random(length) < 0.6
    mask[: max(1, length // 4)] = False  # the prompt
    return TrainSequence(
        name=name,
        token_ids=rng.integers(0, vocab, length).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask, -rng.random(length) * 5, 0).astype(np.float32),
        advantage=float(rng.normal()),
        token_weight=float(rng.random()) / 100,
        temperature=np.where(mask, rng.choice([0.0, 0.7, 1.0], length), 1).astype(np.float32),
        top_p=np.where(mask, rng.choice([0.9, 1.0], length), 1).astype(np.float32),
        top_k=np.where(mask, rng.choice([0, 20], length), 0).astype(np.int32),
    )


sequence_lists = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 2**32 - 1)), max_size=12).map(
    lambda specs: [make_sequence(f"traj{i}/trace{i}", length, seed) for i, (length, seed) in enumerate(specs)]
)
budgets = st.integers(40, 120)


def expected_targets(sequences: list[TrainSequence]) -> Counter:
    """Every trainable token as (target, previous token, its position, behaviour, advantage, weight, T, p, k)."""
    records = Counter()
    for s in sequences:
        for i in np.flatnonzero(s.loss_mask):
            records[
                (
                    int(s.token_ids[i]),
                    int(s.token_ids[i - 1]),
                    i - 1,
                    float(s.behaviour_logprobs[i]),
                    np.float32(s.advantage).item(),
                    np.float32(s.token_weight).item(),
                    float(s.temperature[i]),
                    float(s.top_p[i]),
                    int(s.top_k[i]),
                )
            ] += 1
    return records


def laid_out_targets(batches: list[MicroBatch]) -> Counter:
    """The same records, read back from the micro-batches."""
    records = Counter()
    for b in batches:
        for r, i in b.loss_mask.nonzero().tolist():
            records[
                (
                    int(b.targets[r, i]),
                    int(b.input_ids[r, i]),
                    int(b.position_ids[r, i]),
                    float(b.behaviour_logprobs[r, i]),
                    float(b.advantages[r, i]),
                    float(b.token_weights[r, i]),
                    float(b.temperature[r, i]),
                    float(b.top_p[r, i]),
                    int(b.top_k[r, i]),
                )
            ] += 1
    return records


def row_sequences(batch: MicroBatch) -> list[tuple[int, ...]]:
    """The token ids of every sequence in the micro-batch, cut by sequence_lengths."""
    cut = []
    for row, lengths in zip(batch.input_ids.tolist(), batch.sequence_lengths):
        start = 0
        for length in lengths:
            cut.append(tuple(row[start : start + length]))
            start += length
    return cut


def assert_unused_positions_are_neutral(batch: MicroBatch) -> None:
    off = ~batch.loss_mask
    for name in ("behaviour_logprobs", "advantages", "token_weights", "top_k"):
        assert torch.all(getattr(batch, name)[off] == 0), name
    assert torch.all(batch.temperature[off] == 1) and torch.all(batch.top_p[off] == 1)
    assert torch.all(batch.targets[batch.attention_mask == 0] == 0)
    assert not torch.any(batch.loss_mask & (batch.attention_mask == 0))


@settings(max_examples=60, deadline=None)
@given(sequence_lists, budgets)
def test_pack_keeps_every_trainable_token_once_on_the_position_that_predicts_it(sequences, max_tokens):
    batches = pack(sequences, max_tokens)
    kept = [s for s in sequences if s.trainable_tokens]
    assert laid_out_targets(batches) == expected_targets(kept)
    laid_out = Counter(cut for b in batches for cut in row_sequences(b))
    assert laid_out == Counter(tuple(s.token_ids.tolist()) for s in kept)
    for batch in batches:
        assert batch.input_ids.shape[0] == 1
        assert batch.tokens == batch.padded_tokens <= max_tokens
        assert torch.all(batch.attention_mask == 1)
        positions = batch.position_ids[0].tolist()
        expected_positions = [p for length in batch.sequence_lengths[0] for p in range(length)]
        assert positions == expected_positions
        ends = np.cumsum(batch.sequence_lengths[0]) - 1
        assert not batch.loss_mask[0, ends].any()  # a sequence's last token predicts nothing
        assert_unused_positions_are_neutral(batch)
    assert sum(b.trainable_tokens for b in batches) == sum(s.trainable_tokens for s in sequences)


@settings(max_examples=60, deadline=None)
@given(sequence_lists, budgets)
def test_pad_and_pack_carry_the_same_targets(sequences, max_tokens):
    packed, padded = pack(sequences, max_tokens), pad(sequences, max_tokens)

    def triples(batches):
        return Counter(
            (int(b.targets[r, i]), float(b.behaviour_logprobs[r, i]), float(b.token_weights[r, i]))
            for b in batches
            for r, i in b.loss_mask.nonzero().tolist()
        )

    assert triples(padded) == triples(packed)
    assert laid_out_targets(padded) == laid_out_targets(packed)
    for batch in padded:
        assert batch.padded_tokens <= max_tokens
        assert all(len(lengths) == 1 for lengths in batch.sequence_lengths)
        assert batch.attention_mask.sum(-1).tolist() == [lengths[0] for lengths in batch.sequence_lengths]
        assert_unused_positions_are_neutral(batch)
    assert sum(b.tokens for b in padded) == sum(b.tokens for b in packed)


def test_pack_is_deterministic_and_first_fit_decreasing():
    sequences = [make_sequence(f"t/{i}", length, seed=i) for i, length in enumerate([5, 9, 3, 9, 4, 6])]
    batches = pack(sequences, max_tokens=12)
    assert [b.sequence_lengths for b in batches] == [[[9, 3]], [[9]], [[6, 5]], [[4]]]
    again = pack(sequences, max_tokens=12)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again))


def test_a_sequence_over_budget_is_refused_by_name():
    sequences = [make_sequence("traj-a/trace-0", 10, seed=0), make_sequence("traj-b/trace-3", 30, seed=1)]
    for layout in (pack, pad):
        with pytest.raises(TraceTooLongError, match=r"traj-b/trace-3 has 30 tokens.*budget of 20.*raise"):
            layout(sequences, max_tokens=20)


def test_sequences_without_trainable_tokens_are_dropped():
    silent = make_sequence("t/silent", 50, seed=0)
    silent = TrainSequence(**{**silent.__dict__, "loss_mask": np.zeros(50, bool)})
    trained = make_sequence("t/trained", 8, seed=1)
    for layout in (pack, pad):
        (batch,) = layout([silent, trained], max_tokens=10)  # the silent one would not even fit
        assert batch.sequence_lengths == [[8]]


def test_a_trainable_first_token_is_refused():
    sequence = make_sequence("t/0", 6, seed=0)
    mask = sequence.loss_mask.copy()
    mask[0] = True
    with pytest.raises(ValueError, match="t/0.*first token"):
        TrainSequence(**{**sequence.__dict__, "loss_mask": mask})


def test_micro_batch_moves_to_a_device():
    (batch,) = pack([make_sequence("t/0", 8, seed=0)], max_tokens=8)
    moved = batch.to("cpu")
    assert moved.sequence_lengths == batch.sequence_lengths
    assert moved.input_ids.device.type == "cpu" and moved.top_k.dtype == torch.int64


# -------------------------------------------------------------------------------------------------
# A real model: sequences packed into one row do not see each other


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def target_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[1, L] inputs -> [L] log-probabilities of the targets.

    Hugging Face reads packing from position_ids only without an attention mask and without a KV
    cache: ``use_cache=False`` matters, as the default builds a cache and then ignores the restarts.
    """
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False).logits[0]
    return logits.float().log_softmax(-1).gather(-1, targets[0, :, None]).squeeze(-1)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_sequences_get_the_logprobs_they_get_alone(tiny_llama, attention):
    tiny_llama.set_attn_implementation(attention)
    sequences = [make_sequence(f"t/{i}", length, seed=i) for i, length in enumerate([13, 7, 21, 5])]
    (packed,) = pack(sequences, max_tokens=64)
    assert len(packed.sequence_lengths[0]) == 4
    together = target_logprobs(tiny_llama, packed.input_ids, packed.position_ids, packed.targets)  # [L]
    start = 0
    for length in packed.sequence_lengths[0]:
        piece = slice(start, start + length)
        alone = target_logprobs(
            tiny_llama, packed.input_ids[:, piece], packed.position_ids[:, piece], packed.targets[:, piece]
        )
        torch.testing.assert_close(together[piece][:-1], alone[:-1], rtol=0, atol=1e-5)
        start += length


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padded_rows_get_the_logprobs_sequences_get_alone(tiny_llama, attention):
    tiny_llama.set_attn_implementation(attention)
    sequences = [make_sequence(f"t/{i}", length, seed=i) for i, length in enumerate([13, 7, 21, 5])]
    (padded,) = pad(sequences, max_tokens=4 * 21)
    with torch.no_grad():
        logits = tiny_llama(
            input_ids=padded.input_ids,
            position_ids=padded.position_ids,
            attention_mask=padded.attention_mask,
            use_cache=False,
        ).logits  # [R, L, V]
    rows = logits.float().log_softmax(-1).gather(-1, padded.targets[..., None]).squeeze(-1)  # [R, L]
    for row, (length,) in enumerate(padded.sequence_lengths):
        piece = (slice(row, row + 1), slice(0, length))
        alone = target_logprobs(tiny_llama, padded.input_ids[piece], padded.position_ids[piece], padded.targets[piece])
        torch.testing.assert_close(rows[row, : length - 1], alone[:-1], rtol=0, atol=1e-5)
