"""Which traces share a prompt, and the trees of pieces they are packed as (trainer/batches.py).

Every session of a CLI starts with the same system prompt and tool list (1.5k tokens for Pi, 20k for
Claude Code), and every sample of a GRPO group with the same instruction; the sampled part of a trace
is often a few hundred tokens. Run one by one, the trainer would compute that prompt once per trace.
Here traces that begin with the same tokens become a tree: the common prefix is one piece, computed
once, and each trace's remainder a piece below it (nested: a system prompt shared by all, below it an
instruction shared by a group, below that each sample's own tokens).

Where a shared prefix ends. The last position of a shared piece predicts the first token of *each*
branch below it, so it could have several targets. Sharing instead ends early enough that no trained
token is ever predicted from a shared position: a trace's *sharable* prefix is its tokens before
index f - 1, f being its first trainable token. The token at f - 1, whose position predicts token f,
is always in the trace's own piece, so every position that predicts a trained token belongs to exactly
one trace and carries that trace's target, behaviour logprob, advantage, weight and sampling. A
shared piece's positions predict only prompt tokens, which no trace trains on. Identical *sampled*
stretches (two samples that began with the same reply) are not shared: one position would need a
target per branch.

The trie is a radix trie over the sharable prefixes whose edges are slices of the traces' own token
arrays, so it holds at most 2n + 1 nodes for n traces however long their prompts are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainer.sequences import Piece, TrainSequence


def sharable_length(sequence: TrainSequence) -> int:
    """How many leading tokens of the sequence may lie in a piece shared with other sequences."""
    trainable = np.flatnonzero(sequence.loss_mask)
    return max(0, int(trainable[0]) - 1) if len(trainable) else 0


class _Node:
    __slots__ = ("owner", "start", "end", "children", "ending", "count")

    def __init__(self, owner: int, start: int, end: int) -> None:
        self.owner = owner  # a sequence whose tokens [start, end) label the edge into this node
        self.start = start
        self.end = end  # the node's depth: the prefix it stands for has this many tokens
        self.children: dict[int, _Node] = {}  # by the first token of the child's edge
        self.ending: list[int] = []  # sequences whose sharable prefix ends here
        self.count = 0  # sequences whose sharable prefix ends here or below


class PrefixTrie:
    """A radix trie over the sharable prefixes of ``sequences`` (indices into it)."""

    def __init__(self, sequences: Sequence[TrainSequence], indices: Sequence[int] | None = None) -> None:
        self.sequences = sequences
        self.root = _Node(-1, 0, 0)
        for index in range(len(sequences)) if indices is None else indices:
            self._insert(index)

    def _insert(self, index: int) -> None:
        tokens = self.sequences[index].token_ids
        length = sharable_length(self.sequences[index])
        node, depth = self.root, 0
        while True:
            node.count += 1
            if depth == length:
                node.ending.append(index)
                return
            first = int(tokens[depth])
            child = node.children.get(first)
            if child is None:
                leaf = node.children[first] = _Node(index, depth, length)
                leaf.count = 1
                leaf.ending.append(index)
                return
            label = self.sequences[child.owner].token_ids[child.start : child.end]
            span = tokens[depth : min(length, child.end)]
            differ = np.flatnonzero(label[: len(span)] != span)
            matched = int(differ[0]) if len(differ) else len(span)
            if matched < len(label):  # the prefix leaves the edge part-way: split it there
                middle = node.children[first] = _Node(child.owner, child.start, child.start + matched)
                middle.count = child.count
                child.start += matched
                middle.children[int(label[matched])] = child
                child = middle
            node, depth = child, child.end

    def _under(self, node: _Node) -> list[int]:
        """The sequences at or below ``node``, depth first (siblings in insertion order)."""
        found, stack = [], [node]
        while stack:
            current = stack.pop()
            found.extend(current.ending)
            stack.extend(reversed(list(current.children.values())))
        return found

    def clusters(self, min_saving: int) -> list[list[int]]:
        """The sequences grouped by a shared prefix that saves at least ``min_saving`` tokens (depth
        first, so neighbours share the most); a sequence that shares no such prefix is a group alone."""
        groups: list[list[int]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            groups.extend([index] for index in node.ending)
            for child in node.children.values():
                if child.count >= 2 and child.end * (child.count - 1) >= min_saving:
                    groups.append(self._under(child))
                else:
                    stack.append(child)
        return groups

    def pieces(self, min_saving: int) -> list[Piece]:
        """The tree of pieces of every sequence in the trie, parents before children.

        A node's stretch gets a piece of its own when the sequences below it save at least
        ``min_saving`` tokens by sharing it; otherwise its tokens go down into each branch.
        """
        pieces: list[Piece] = []
        stack = [(self.root, -1, 0)]  # (node, its parent piece, where its not yet laid out tokens start)
        while stack:
            node, parent, pending = stack.pop()
            if node is not self.root and node.count >= 2 and (node.end - pending) * (node.count - 1) >= min_saving:
                pieces.append(Piece(self.sequences[node.owner], pending, node.end, parent, trains=False))
                parent, pending = len(pieces) - 1, node.end
            for index in node.ending:
                sequence = self.sequences[index]
                pieces.append(Piece(sequence, pending, len(sequence), parent))
            stack.extend((child, parent, pending) for child in reversed(list(node.children.values())))
        return pieces


def _common_length(a: TrainSequence, b: TrainSequence) -> int:
    """Length of the common start of two sequences' sharable prefixes."""
    length = min(sharable_length(a), sharable_length(b))
    differ = np.flatnonzero(a.token_ids[:length] != b.token_ids[:length])
    return int(differ[0]) if len(differ) else length


def plain_units(sequences: Sequence[TrainSequence]) -> list[list[Piece]]:
    """Every sequence a tree of one piece (no sharing), in the given order."""
    return [[Piece(sequence, 0, len(sequence))] for sequence in sequences]


def shared_units(sequences: Sequence[TrainSequence], max_tokens: int, min_saving: int) -> list[list[Piece]]:
    """The sequences as trees of at most ``max_tokens`` computed tokens each, largest first (ties in
    input order); a sequence that shares nothing worth a piece is a tree of one piece.

    Each group of sequences with a common prefix is cut, depth first, into runs whose tree fits the
    budget: a sequence adds its length less what it shares with the one before it.
    """
    units: list[tuple[int, int, list[Piece]]] = []  # (computed tokens, first input index, pieces)

    def add(indices: list[int]) -> None:
        pieces = PrefixTrie(sequences, indices).pieces(min_saving)
        if len(indices) > 1 and all(piece.parent < 0 for piece in pieces):  # nothing worth sharing after all
            for index in indices:
                add([index])
            return
        units.append((sum(len(piece) for piece in pieces), min(indices), pieces))

    for group in PrefixTrie(sequences).clusters(min_saving):
        run: list[int] = []
        size = 0
        for index in group:
            shared = _common_length(sequences[run[-1]], sequences[index]) if run else 0
            grown = size + len(sequences[index]) - shared
            if run and grown > max_tokens:
                _add_fitting(run, add, sequences, max_tokens, min_saving)
                run, grown = [], len(sequences[index])
            run.append(index)
            size = grown
        _add_fitting(run, add, sequences, max_tokens, min_saving)
    units.sort(key=lambda unit: (-unit[0], unit[1]))
    return [pieces for _, _, pieces in units]


def _add_fitting(run: list[int], add, sequences, max_tokens: int, min_saving: int) -> None:
    """Add the run as one tree, or, where a stretch too short to pay for a piece of its own makes
    the tree larger than its estimate and the budget, as two runs."""
    size = sum(len(piece) for piece in PrefixTrie(sequences, run).pieces(min_saving))
    if size <= max_tokens or len(run) == 1:
        add(run)
        return
    half = len(run) // 2
    _add_fitting(run[:half], add, sequences, max_tokens, min_saving)
    _add_fitting(run[half:], add, sequences, max_tokens, min_saving)
