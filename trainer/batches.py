"""Laying traces out as micro-batches: packed rows (the training layout) or padded rows (the baseline).

`pack` puts several sequences in one row with no padding (position ids restart per sequence), and
with shared prefixes lays traces that begin with the same prompt out as a tree of pieces; `pad` puts
one sequence per row. The layouts and the alignment with the logits: docs/design/packing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from polar.inference.sampling import to_device
from trainer.prefix_tree import plain_units, shared_units
from trainer.sequences import Piece, TrainSequence

# A shared stretch is given a piece of its own only when it saves at least this many computed tokens:
# each piece costs the backends one more attention call per layer.
MIN_SAVING = 64


class TraceTooLongError(ValueError):
    """A sequence does not fit in one micro-batch."""


@dataclass
class MicroBatch:
    """[R, L] tensors aligned with the logits: position i predicts the token at i + 1 of its sequence."""

    input_ids: torch.Tensor  # int64 [R, L]
    position_ids: torch.Tensor  # int64 [R, L], from 0 in each sequence
    attention_mask: torch.Tensor  # int64 [R, L]: 1 on real tokens, 0 on padding
    targets: torch.Tensor  # int64 [R, L]: the next token; 0 where there is none
    loss_mask: torch.Tensor  # bool [R, L]: the target is a trainable sampled token
    behaviour_logprobs: torch.Tensor  # float32 [R, L]; 0 where loss_mask is False (so are the next three)
    advantages: torch.Tensor  # float32 [R, L]
    token_weights: torch.Tensor  # float32 [R, L]
    temperature: torch.Tensor  # float32 [R, L]; 1 where loss_mask is False
    top_p: torch.Tensor  # float32 [R, L]; 1 where loss_mask is False
    top_k: torch.Tensor  # int64 [R, L]; 0 where loss_mask is False
    sequence_lengths: list[list[int]]  # per row, the lengths of its pieces (sequences, or parts of a tree) in order
    # Per row, each piece's parent: the index of the piece it continues, in the same row; -1 for a
    # root. None: every piece is a root (no sharing).
    parents: list[list[int]] | None = None
    shared_tokens: int = 0  # tokens computed once for several traces, beyond the first: represented - computed
    # Constrained decoding: flat indices [M] into [R * L] of positions whose target was sampled under a
    # constraint's mask, and those masks, bool [M, V] (the allowed tokens). None: no constrained target.
    constraint_index: torch.Tensor | None = None
    constraint_allowed: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Real (non-padding) tokens: the tokens the model computes."""
        return sum(sum(row) for row in self.sequence_lengths)

    @property
    def represented_tokens(self) -> int:
        """Tokens of the traces this micro-batch holds, counting a shared prefix once per trace."""
        return self.tokens + self.shared_tokens

    @property
    def shares_prefixes(self) -> bool:
        return self.parents is not None and any(parent >= 0 for row in self.parents for parent in row)

    def row_parents(self, row: int) -> list[int]:
        """The parent of each piece of ``row`` (-1 for a root)."""
        return self.parents[row] if self.parents is not None else [-1] * len(self.sequence_lengths[row])

    @property
    def trainable_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def padded_tokens(self) -> int:
        """Positions the model computes, padding included: R * L."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (copies queued without a host sync)."""
        device = torch.device(device)
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def _row_masks(pieces: Sequence[Piece]) -> list[tuple[int, np.ndarray]]:
    """(row position predicting the token, its constraint mask) for the constrained targets of a row."""
    masks, at = [], 0
    for piece in pieces:
        if piece.trains:
            for position, allowed in piece.sequence.constraint_masks:
                if piece.start < position < piece.end:
                    masks.append((at + position - piece.start - 1, allowed))
        at += len(piece)
    return masks


def _row_arrays(pieces: Sequence[Piece], length: int) -> dict[str, np.ndarray]:
    """One row [L] holding ``pieces`` back to back, then padding up to ``length`` positions."""
    row = {
        "input_ids": np.zeros(length, np.int64),
        "position_ids": np.arange(length, dtype=np.int64),  # padding continues its row's positions
        "attention_mask": np.zeros(length, np.int64),
        "targets": np.zeros(length, np.int64),
        "loss_mask": np.zeros(length, bool),
        "behaviour_logprobs": np.zeros(length, np.float32),
        "advantages": np.zeros(length, np.float32),
        "token_weights": np.zeros(length, np.float32),
        "temperature": np.ones(length, np.float32),
        "top_p": np.ones(length, np.float32),
        "top_k": np.zeros(length, np.int64),
    }
    at = 0
    for piece in pieces:
        sequence, first, last = piece.sequence, piece.start, piece.end
        end = at + len(piece)
        row["input_ids"][at:end] = sequence.token_ids[first:last]
        row["position_ids"][at:end] = np.arange(first, last)  # a piece continues its parent's positions
        row["attention_mask"][at:end] = 1
        if piece.trains:
            predicting = slice(at, end - 1)  # position i predicts token i + 1 of the sequence
            targets = slice(first + 1, last)
            mask = sequence.loss_mask[targets].astype(bool)  # [n - 1]
            row["targets"][predicting] = sequence.token_ids[targets]
            row["loss_mask"][predicting] = mask
            row["behaviour_logprobs"][predicting] = np.where(mask, sequence.behaviour_logprobs[targets], 0)
            row["advantages"][predicting] = np.where(mask, sequence.advantage, 0)
            row["token_weights"][predicting] = np.where(mask, sequence.token_weight, 0)
            row["temperature"][predicting] = np.where(mask, sequence.temperature[targets], 1)
            row["top_p"][predicting] = np.where(mask, sequence.top_p[targets], 1)
            row["top_k"][predicting] = np.where(mask, sequence.top_k[targets], 0)
        at = end
    return row


def _micro_batch(rows: Sequence[Sequence[Piece]]) -> MicroBatch:
    """R rows of pieces -> one MicroBatch, every row padded to the longest."""
    length = max(sum(len(piece) for piece in row) for row in rows)
    arrays = [_row_arrays(row, length) for row in rows]
    tensors = {name: torch.from_numpy(np.stack([a[name] for a in arrays])) for name in arrays[0]}  # [R, L] each
    parents = [[piece.parent for piece in row] for row in rows]
    masks = [(r * length + position, allowed) for r, row in enumerate(rows) for position, allowed in _row_masks(row)]
    if masks:
        tensors["constraint_index"] = torch.tensor([index for index, _ in masks], dtype=torch.int64)
        tensors["constraint_allowed"] = torch.from_numpy(np.stack([allowed for _, allowed in masks]))
    represented = sum(len(piece.sequence) for row in rows for piece in row if piece.trains)
    computed = sum(len(piece) for row in rows for piece in row)
    return MicroBatch(
        **tensors,
        sequence_lengths=[[len(piece) for piece in row] for row in rows],
        parents=parents if any(p >= 0 for row in parents for p in row) else None,
        shared_tokens=represented - computed,
    )


def _trainable_fitting(sequences: Sequence[TrainSequence], max_tokens: int) -> list[TrainSequence]:
    """The sequences with a trainable token, longest first (ties in input order); each must fit."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    kept = [sequence for sequence in sequences if sequence.trainable_tokens]
    for sequence in kept:
        if len(sequence) > max_tokens:
            raise TraceTooLongError(
                f"trace {sequence.name} has {len(sequence)} tokens, more than the micro-batch budget of "
                f"{max_tokens}; raise the budget (max_tokens) to at least {len(sequence)}"
            )
    return sorted(kept, key=len, reverse=True)  # a stable sort: deterministic


def pack(
    sequences: Sequence[TrainSequence], max_tokens: int, *, share_prefixes: bool = False, min_saving: int = MIN_SAVING
) -> list[MicroBatch]:
    """First-fit-decreasing into rows of at most ``max_tokens`` computed tokens; one row per micro-batch.

    Each micro-batch is one [1, L] row with no padding. Sequences are placed longest first, each into
    the first row with room for it, so the result depends only on the input. A sequence longer than
    ``max_tokens`` raises TraceTooLongError rather than being split: its later tokens were sampled in
    the context of its earlier ones, and a piece without that context would be trained on a different
    distribution from the one the engine sampled. Sequences with no trainable token are dropped.

    ``share_prefixes``: sequences that begin with the same prompt are first grouped into trees
    (trainer/prefix_tree.py: a shared stretch saving fewer than ``min_saving`` tokens is not worth a
    piece of its own), each tree at most ``max_tokens`` computed tokens; the trees and the sequences
    that share nothing are then placed as above, by computed size. Where nothing is shared the result
    is exactly the layout without sharing.
    """

    kept = _trainable_fitting(sequences, max_tokens)
    units = shared_units(kept, max_tokens, min_saving) if share_prefixes else plain_units(kept)
    rows: list[list[Piece]] = []
    room: list[int] = []  # free positions of each row
    for unit in units:  # largest first
        size = sum(len(piece) for piece in unit)
        index = next((i for i, free in enumerate(room) if free >= size), len(rows))
        if index == len(rows):
            rows.append([])
            room.append(max_tokens)
        offset = len(rows[index])
        rows[index].extend(replace(piece, parent=piece.parent + offset if piece.parent >= 0 else -1) for piece in unit)
        room[index] -= size
    return [_micro_batch([row]) for row in rows]


def pad(sequences: Sequence[TrainSequence], max_tokens: int) -> list[MicroBatch]:
    """One sequence per row, padded to the longest of its micro-batch, R * L <= ``max_tokens``.

    Sequences are sorted longest first (ties in input order) before being grouped, so rows of similar
    length share a micro-batch and the baseline wastes as little on padding as this layout can: a fair
    comparison for ``pack``. Padding has attention_mask 0 and loss_mask False. Same refusals and drops
    as ``pack``.
    """
    batches: list[list[TrainSequence]] = []
    for sequence in _trainable_fitting(sequences, max_tokens):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0]) <= max_tokens:
            batches[-1].append(sequence)  # the first sequence of a batch is its longest: L
        else:
            batches.append([sequence])
    return [_micro_batch([[Piece(sequence, 0, len(sequence))] for sequence in batch]) for batch in batches]
