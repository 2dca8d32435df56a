"""One trace as the trainer lays it out (``TrainSequence``), and a stretch of one in a row (``Piece``).

Kept apart from the layouts (batches.py) and the prefix trie (prefix_tree.py), which both build on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    # Constrained decoding: (position of a token, bool [V] the tokens its constraint's mask allowed
    # there), for each sampled token of a constrained call; the logits are masked so before sampling.
    constraint_masks: tuple[tuple[int, np.ndarray], ...] = ()

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


@dataclass(frozen=True)
class Piece:
    """Tokens ``start:end`` of one sequence, laid out as one stretch of a row.

    A leaf (``trains``) carries its sequence's targets from ``start`` on; a shared piece holds prompt
    tokens only and predicts nothing. ``parent``: the index, among its tree's pieces, of the piece
    holding the tokens just before ``start`` (-1 when ``start`` is 0).
    """

    sequence: TrainSequence
    start: int
    end: int
    parent: int = -1
    trains: bool = True

    def __len__(self) -> int:
        return self.end - self.start
