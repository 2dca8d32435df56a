"""The prefix cache's bookkeeping: chained block keys, and the index that pins and evicts blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from polar.inference.engines.prefix_cache import BLOCK_TOKENS, BlockIndex, block_keys

SETTINGS = settings(max_examples=100, deadline=None)
# Few distinct ids, so that drawn sequences often share prefixes.
tokens = st.lists(st.integers(0, 3), max_size=6 * BLOCK_TOKENS)


@SETTINGS
@given(tokens, tokens)
def test_a_block_key_names_the_whole_prefix_up_to_its_end(a, b):
    keys_a, keys_b = block_keys(a), block_keys(b)
    assert len(keys_a) == len(a) // BLOCK_TOKENS
    for i in range(min(len(keys_a), len(keys_b))):
        end = (i + 1) * BLOCK_TOKENS
        assert (keys_a[i] == keys_b[i]) == (a[:end] == b[:end])


@SETTINGS
@given(tokens, st.integers(0, 6))
def test_keys_continue_from_a_parent(ids, split):
    keys = block_keys(ids)
    split = min(split, len(keys))
    parent = keys[split - 1] if split else b""
    assert block_keys(ids[split * BLOCK_TOKENS :], parent) == keys[split:]


def test_large_ids_are_told_apart():
    base = [7] * BLOCK_TOKENS
    assert block_keys(base) != block_keys(base[:-1] + [7 + 2**32])


# Operations on an index, drawn: add a chain of keys, match a chain, pin what a match found (a
# sequence that takes blocks), end a sequence (unpin what it pinned), clear.
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 11)),
        st.tuples(st.just("match"), st.integers(0, 11)),
        st.tuples(st.just("take"), st.integers(0, 11)),
        st.tuples(st.just("end"), st.integers(0, 5)),
        st.tuples(st.just("clear"), st.just(0)),
    ),
    max_size=80,
)


def chain(n: int) -> list[bytes]:
    """Keys 0..n of one chain: every chain drawn here shares its beginning."""
    return [bytes([i]) for i in range(n + 1)]


@SETTINGS
@given(st.integers(1, 8), operations)
def test_the_index_never_evicts_a_pinned_block_and_evicts_the_least_recently_used(capacity, ops):
    index = BlockIndex(capacity)
    held: dict[bytes, int] = {}  # what the index should hold: key -> row
    pins: dict[bytes, int] = {}
    used: dict[bytes, int] = {}  # key -> when last used (added, matched, or released by its last user)
    sequences: list[list[int]] = []  # rows each running sequence pinned
    clock = 0

    def use(keys):
        nonlocal clock
        for key in reversed(keys):  # a chain is used from its end back: its first block is newest
            clock += 1
            used[key] = clock

    for op, arg in ops:
        if op == "add":
            key = chain(arg)[-1]
            if key in held:
                continue
            unpinned = [k for k in held if not pins.get(k)]
            row = index.add(key)
            if len(held) < capacity:
                assert row is not None and row not in held.values()
            elif not unpinned:
                assert row is None  # everything is pinned: nothing is evicted
                continue
            else:
                oldest = min(unpinned, key=used.__getitem__)
                assert row == held.pop(oldest)
                assert index.row(oldest) is None
            held[key] = row
            use([key])
        elif op in ("match", "take"):
            keys = chain(arg)
            rows = index.match(keys)
            expected = []
            for key in keys:
                if key not in held:
                    break
                expected.append(held[key])
            assert rows == expected
            use(keys[: len(rows)])
            if op == "take" and rows:
                for row, key in zip(rows, keys):
                    index.pin(row)
                    pins[key] = pins.get(key, 0) + 1
                sequences.append(rows)
        elif op == "end" and sequences:
            rows = sequences.pop(arg % len(sequences))
            index.unpin(rows)
            by_row = {row: key for key, row in held.items()}
            released = []
            for row in rows:
                key = by_row[row]
                pins[key] -= 1
                if not pins[key]:
                    released.append(key)
            use(released)
        elif op == "clear":
            index.clear()
            held.clear()
            pins.clear()
            sequences.clear()
        assert len(index) == len(held) <= capacity
        for key, row in held.items():
            assert index.row(key) == row
        assert len(set(held.values())) == len(held)
        assert all(0 <= row < capacity for row in held.values())
