"""Laying traces out as micro-batches: packed rows (the training layout) or padded rows (the baseline).

A micro-batch is a set of [R, L] tensors aligned with the model's logits: position i of a row holds
input token i and predicts the token at i + 1 of the same sequence, so ``targets``, ``loss_mask``
and every per-token quantity of the loss (behaviour logprob, advantage, token weight, sampling
parameters) are the trace's values shifted left by one. The last position of each sequence predicts
nothing (loss mask False). A trace always starts with a prompt, so its first token is never trainable
and every trainable token is some position's target.

``pack`` concatenates several sequences into one row with no padding at all; ``position_ids`` restart
at 0 for each sequence, from which Hugging Face models (and ``sequence_lengths``, for backends that
take cu_seqlens) build a block-diagonal causal mask, so sequences in one row never attend to each
other. Hugging Face does so only when called with ``attention_mask=None`` and ``use_cache=False``:
its default (a KV cache, in train mode too) silently ignores the restarts and lets a row's sequences
attend to the ones before them.

``pad`` puts one sequence per row, padded to the longest of its micro-batch: the layout to compare
against (the padded positions cost compute and teach nothing).

Both layouts drop sequences with no trainable token: they add nothing to the gradient, only compute.
The caller counts them if it reports them (``sequence.trainable_tokens == 0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from polar.inference.sampling import to_device


class TraceTooLongError(ValueError):
    """A sequence does not fit in one micro-batch."""


@dataclass(frozen=True, eq=False)
class TrainSequence:
    """One trace, ready to lay out: its tokens and, per token, what the loss needs of it."""

    name: str  # "trajectory_id/trace_id", for errors
    token_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool or uint8 [T]: 1 where the token was sampled and is trained on
    behaviour_logprobs: np.ndarray  # float32 [T]: the engine's logprob of each sampled token, 0 elsewhere
    advantage: float  # the session's advantage
    token_weight: float  # the trace's coefficient from trace_token_weights
    temperature: np.ndarray  # float32 [T]: what each token was sampled with; 1.0 where mask 0
    top_p: np.ndarray  # float32 [T]; 1.0 where mask 0
    top_k: np.ndarray  # int32 [T]; 0 where mask 0

    def __post_init__(self) -> None:
        length = len(self.token_ids)
        per_token = ("loss_mask", "behaviour_logprobs", "temperature", "top_p", "top_k")
        for name in per_token:
            if len(getattr(self, name)) != length:
                raise ValueError(f"{self.name}: {name} has {len(getattr(self, name))} values for {length} tokens")
        if length and self.loss_mask[0]:
            raise ValueError(f"{self.name}: the first token is trainable, but a trace starts with a prompt")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def trainable_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


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
    sequence_lengths: list[list[int]]  # per row, the lengths of its sequences in order

    @property
    def tokens(self) -> int:
        """Real (non-padding) tokens."""
        return sum(sum(row) for row in self.sequence_lengths)

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
        moved = {f.name: to_device(getattr(self, f.name), device) for f in fields(self) if f.name != "sequence_lengths"}
        return replace(self, **moved)


def _row_arrays(sequences: Sequence[TrainSequence], length: int) -> dict[str, np.ndarray]:
    """One row [L] holding ``sequences`` back to back, then padding up to ``length`` positions."""
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
    start = 0
    for sequence in sequences:
        end = start + len(sequence)
        inputs = slice(start, end)
        predicting = slice(start, end - 1)  # position i predicts token i + 1 of the sequence
        mask = sequence.loss_mask[1:].astype(bool)  # [T - 1]
        row["input_ids"][inputs] = sequence.token_ids
        row["position_ids"][inputs] = np.arange(len(sequence))
        row["attention_mask"][inputs] = 1
        row["targets"][predicting] = sequence.token_ids[1:]
        row["loss_mask"][predicting] = mask
        row["behaviour_logprobs"][predicting] = np.where(mask, sequence.behaviour_logprobs[1:], 0)
        row["advantages"][predicting] = np.where(mask, sequence.advantage, 0)
        row["token_weights"][predicting] = np.where(mask, sequence.token_weight, 0)
        row["temperature"][predicting] = np.where(mask, sequence.temperature[1:], 1)
        row["top_p"][predicting] = np.where(mask, sequence.top_p[1:], 1)
        row["top_k"][predicting] = np.where(mask, sequence.top_k[1:], 0)
        start = end
    return row


def _micro_batch(rows: Sequence[Sequence[TrainSequence]]) -> MicroBatch:
    """R rows of sequences -> one MicroBatch, every row padded to the longest."""
    length = max(sum(len(sequence) for sequence in row) for row in rows)
    arrays = [_row_arrays(row, length) for row in rows]
    tensors = {name: torch.from_numpy(np.stack([a[name] for a in arrays])) for name in arrays[0]}  # [R, L] each
    return MicroBatch(**tensors, sequence_lengths=[[len(sequence) for sequence in row] for row in rows])


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


def pack(sequences: Sequence[TrainSequence], max_tokens: int) -> list[MicroBatch]:
    """First-fit-decreasing into rows of at most ``max_tokens`` real tokens; one row per micro-batch.

    Each micro-batch is one [1, L] row with no padding. Sequences are placed longest first, each into
    the first row with room for it, so the result depends only on the input. A sequence longer than
    ``max_tokens`` raises TraceTooLongError rather than being split: its later tokens were sampled in
    the context of its earlier ones, and a piece without that context would be trained on a different
    distribution from the one the engine sampled. Sequences with no trainable token are dropped.
    """
    rows: list[list[TrainSequence]] = []
    room: list[int] = []  # free positions of each row
    for sequence in _trainable_fitting(sequences, max_tokens):
        index = next((i for i, free in enumerate(room) if free >= len(sequence)), len(rows))
        if index == len(rows):
            rows.append([])
            room.append(max_tokens)
        rows[index].append(sequence)
        room[index] -= len(sequence)
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
    return [_micro_batch([[sequence] for sequence in batch]) for batch in batches]
