"""Shared-prefix packing: the trees hold every trace whole, every trained target once, and fit the budget."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.trace_forests import forest, forests
from trainer.batches import MicroBatch, TraceTooLongError, pack
from trainer.prefix_tree import PrefixTrie, sharable_length
from trainer.tree_attention import TreeLayout

VOCAB = 50


def chains(batch: MicroBatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(tokens, positions) from the root down to each piece that no piece continues."""
    ids, positions = batch.input_ids[0].tolist(), batch.position_ids[0].tolist()
    parents = batch.row_parents(0)
    bounds = np.concatenate([[0], np.cumsum(batch.sequence_lengths[0])]).tolist()
    continued = set(parents)
    found = []
    for piece in range(len(parents)):
        if piece in continued:
            continue
        path, at = [], piece
        while at >= 0:
            path.append(at)
            at = parents[at]
        tokens = [t for p in reversed(path) for t in ids[bounds[p] : bounds[p + 1]]]
        where = [t for p in reversed(path) for t in positions[bounds[p] : bounds[p + 1]]]
        found.append((tuple(tokens), tuple(where)))
    return found


def targets(batches) -> Counter:
    """Every trained target with what the loss reads of it."""
    return Counter(
        (
            int(b.targets[0, i]),
            int(b.input_ids[0, i]),
            int(b.position_ids[0, i]),
            float(b.behaviour_logprobs[0, i]),
            float(b.advantages[0, i]),
            float(b.token_weights[0, i]),
            float(b.temperature[0, i]),
            float(b.top_p[0, i]),
            int(b.top_k[0, i]),
        )
        for b in batches
        for _, i in b.loss_mask.nonzero().tolist()
    )


@settings(max_examples=80, deadline=None)
@given(forests(VOCAB), st.integers(40, 200), st.sampled_from([1, 8, 64]))
def test_every_trace_is_whole_and_every_target_lands_once(sequences, max_tokens, min_saving):
    sequences = [s for s in sequences if len(s) <= max_tokens]
    shared = pack(sequences, max_tokens, share_prefixes=True, min_saving=min_saving)
    plain = pack(sequences, max_tokens)
    assert targets(shared) == targets(plain)
    whole = Counter(chain for batch in shared for chain in chains(batch))
    assert whole == Counter((tuple(s.token_ids.tolist()), tuple(range(len(s)))) for s in sequences)
    for batch in shared:
        assert batch.tokens == batch.padded_tokens <= max_tokens
        assert all(parent < piece for piece, parent in enumerate(batch.row_parents(0)))
        # A piece that others continue predicts nothing: no position has two targets.
        ends = np.cumsum(batch.sequence_lengths[0]) - 1
        assert not batch.loss_mask[0, ends].any()
    assert sum(b.represented_tokens for b in shared) == sum(len(s) for s in sequences)
    assert sum(b.tokens for b in shared) <= sum(b.tokens for b in plain)


@settings(max_examples=40, deadline=None)
@given(forests(VOCAB), st.integers(1, 30))
def test_the_trie_stays_within_2n_plus_1_nodes(sequences, _):
    trie = PrefixTrie(sequences)
    nodes, stack = 0, [trie.root]
    while stack:
        node = stack.pop()
        nodes += 1
        stack.extend(node.children.values())
        assert node.count == len(trie._under(node))
    assert nodes <= 2 * len(sequences) + 1


def test_nothing_shared_packs_as_without_sharing():
    sequences = forest(3, VOCAB, system=0, groups=[(0, 1)] * 6)
    for s in sequences:  # distinct first tokens: nothing in common
        s.token_ids[0] = 1000 + len(s) * 7 + int(s.token_ids[1])
    shared = pack(sequences, 30, share_prefixes=True, min_saving=1)
    plain = pack(sequences, 30)
    assert [b.sequence_lengths for b in shared] == [b.sequence_lengths for b in plain]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(shared, plain))
    assert all(b.parents is None and b.shared_tokens == 0 for b in shared)


def test_a_system_prompt_and_group_instructions_nest():
    sequences = forest(0, VOCAB, system=100, groups=[(40, 3), (40, 3)], tail=(5, 10), truncation=False)
    for s in sequences:  # train only the own tokens: the whole prompt is sharable
        s.loss_mask[:141] = False
        s.loss_mask[141:] = True
    (batch,) = pack(sequences, 1000, share_prefixes=True, min_saving=16)
    # the system prompt; two instructions below it; three members below each
    assert batch.row_parents(0).count(-1) == 1
    depths = []
    for _piece, parent in enumerate(batch.row_parents(0)):
        depth = 0
        while parent >= 0:
            depth, parent = depth + 1, batch.row_parents(0)[parent]
        depths.append(depth)
    assert sorted(depths) == [0, 1, 1] + [2] * 6
    assert batch.represented_tokens - batch.tokens == 5 * 100 + 2 * 2 * 40


def test_a_shared_stretch_too_short_to_pay_is_not_split_off():
    sequences = forest(1, VOCAB, system=10, groups=[(0, 4)], truncation=False)
    for s in sequences:
        s.loss_mask[:12] = False
        s.loss_mask[12] = True  # sharable: the first 11 tokens, 10 of them common
    (batch,) = pack(sequences, 1000, share_prefixes=True, min_saving=64)  # 10 tokens x 3 = 30 < 64
    assert batch.parents is None
    (batch,) = pack(sequences, 1000, share_prefixes=True, min_saving=30)
    assert batch.shared_tokens == 30


def test_trees_are_cut_to_the_budget_and_a_long_trace_is_still_refused():
    sequences = forest(2, VOCAB, system=60, groups=[(0, 8)], tail=(10, 10), truncation=False)
    for s in sequences:
        s.loss_mask[:62] = False
        s.loss_mask[62] = True
    batches = pack(sequences, 100, share_prefixes=True, min_saving=1)
    assert all(b.tokens <= 100 for b in batches) and len(batches) == 2
    with pytest.raises(TraceTooLongError, match="budget of 50"):
        pack(sequences, 50, share_prefixes=True)


def test_sharing_ends_before_the_token_that_predicts_the_first_trained_one():
    sequences = forest(4, VOCAB, system=30, groups=[(0, 2)], truncation=False)
    for s in sequences:
        s.loss_mask[:] = False
        s.loss_mask[5] = True  # trained inside the common prompt
    assert {sharable_length(s) for s in sequences} == {4}
    (batch,) = pack(sequences, 1000, share_prefixes=True, min_saving=1)
    assert batch.sequence_lengths[0][0] == 4 and batch.row_parents(0) == [-1, 0, 0]


def test_layout_of_pieces():
    layout = TreeLayout.from_pieces([3, 2, 4, 1], [-1, 0, 0, 2], total=12)
    assert layout.spans == ((0, 3), (3, 5), (5, 9), (9, 10), (10, 12))
    assert layout.ancestors == ((), ((0, 3),), ((0, 3),), ((0, 3), (5, 9)), ())
    with pytest.raises(ValueError, match="does not come before"):
        TreeLayout.from_pieces([3, 2], [1, -1])


def test_share_prefixes_is_a_validated_trainer_key(tmp_path):
    from polar.config import ConfigError, load_config

    config = tmp_path / "train.toml"
    assert load_config().trainer.share_prefixes is True
    config.write_text("[trainer]\nshare_prefixes = false\n")
    assert load_config(config).trainer.share_prefixes is False
    config.write_text('[trainer]\nshare_prefixes = "yes"\n')
    with pytest.raises(ConfigError, match="share_prefixes"):
        load_config(config)


def test_step_metrics_count_tokens_computed_and_represented():
    from trainer.metrics import sharing_metrics

    sequences = forest(0, VOCAB, system=100, groups=[(40, 3)], tail=(5, 10), truncation=False)
    for s in sequences:
        s.loss_mask[:141] = False
        s.loss_mask[141:] = True
    shared = pack(sequences, 1000, share_prefixes=True)
    row = sharing_metrics([shared, pack(sequences, 1000)])
    represented = 2 * sum(len(s) for s in sequences)
    assert row["tokens_represented"] == represented
    assert row["tokens_computed"] == represented - 2 * 140
    assert row["prefix_saving"] == pytest.approx(2 * 140 / represented)
