"""The torch engine's prefix cache: keys and values of token sequences already computed, by blocks.

Every session of a CLI starts with the same long prompt (its system prompt and tools), and a
session's next call extends its previous call's prompt and output; computing those tokens again is
most of a call's prefill. The cache keeps them, so a new sequence computes only what follows its
longest cached prefix.

A block is BLOCK_TOKENS consecutive positions starting at a multiple of BLOCK_TOKENS. Its key is a
hash of its token ids chained with its parent block's key, so a key names the whole prefix up to
the block's end: block i of two sequences has the same key only when they share all tokens
[0, (i + 1) * BLOCK_TOKENS). The hash is keyed BLAKE2b of 128 bits: a harness cannot make two
prefixes collide.

The blocks live in a pool of their own ([rows, kv_heads, BLOCK_TOKENS, head_dim] per layer, grown on
demand up to a memory budget), beside the engine's slot cache: a sequence that hits copies the rows
into its slot, and the full blocks a sequence computes are copied back. So decoding and its CUDA
graphs read one contiguous slot as before; a copy costs far less than the forward it replaces.

Blocks that a running sequence took or stored are pinned until it ends. When the pool is full, a
new block takes the row of the least recently used unpinned one (a chain is touched from its last
block back to its first, so a leaf goes before its parent); when every row is pinned, the block is
not stored. A weight update makes every block stale: `clear` forgets them all, and sequences that
began before it neither take nor store blocks again.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polar.inference.engines.llama import SlotKVCache
from polar.inference.sampling import to_device

BLOCK_TOKENS = 16
_HASH_KEY = os.urandom(16)  # per process: keys are never compared across processes


def block_keys(token_ids: Sequence[int], parent: bytes = b"", block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Chained keys of the full blocks of `token_ids`, the first one chained to `parent` (the key of
    the block before them; b"" at position 0). A trailing partial block has no key."""
    data = array("q", token_ids).tobytes()
    width = block_tokens * 8  # bytes of one block of int64 ids
    keys = []
    for start in range(0, len(token_ids) // block_tokens * width, width):
        parent = hashlib.blake2b(parent + data[start : start + width], digest_size=16, key=_HASH_KEY).digest()
        keys.append(parent)
    return keys


def adapter_namespace(adapter: str) -> bytes:
    """The parent key of the first block computed with the LoRA adapter named `adapter` ("" = the
    server's default weights: b""): blocks of one prompt under two adapters get different keys."""
    if not adapter:
        return b""
    return hashlib.blake2b(b"adapter\0" + adapter.encode(), digest_size=16, key=_HASH_KEY).digest()


class BlockIndex:
    """Which pool row holds which block, which rows are pinned, and the order to evict in.

    Pure bookkeeping over `capacity` rows: no tensors. A row is free, or holds one key; a held row
    is pinned (by a count of users) or in the eviction order, least recently used first.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: dict[bytes, int] = {}  # key -> row
        self._keys: dict[int, bytes] = {}  # row -> key
        self._pins: dict[int, int] = {}  # pinned row -> users
        self._unpinned: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._free: list[int] = []  # rows released by clear, lowest last: reused before new ones
        self._used = 0  # rows [0, _used) have been handed out at least once

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, key: bytes) -> int | None:
        return self._rows.get(key)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Rows of the longest run keys[0], keys[1], ... that the index holds, touched as just used."""
        rows = []
        for key in keys:
            row = self._rows.get(key)
            if row is None:
                break
            rows.append(row)
        self._touch(rows)
        return rows

    def add(self, key: bytes) -> int | None:
        """A row for the new `key` (not held yet): a never-used one, else the least recently used
        unpinned one, whose block is dropped. None when every row is pinned."""
        if self._free:
            row = self._free.pop()
        elif self._used < self.capacity:
            row, self._used = self._used, self._used + 1
        elif self._unpinned:
            row, _ = self._unpinned.popitem(last=False)
            del self._rows[self._keys.pop(row)]
        else:
            return None
        self._rows[key] = row
        self._keys[row] = key
        self._unpinned[row] = None
        return row

    def pin(self, row: int) -> None:
        self._pins[row] = self._pins.get(row, 0) + 1
        self._unpinned.pop(row, None)

    def unpin(self, rows: Sequence[int]) -> None:
        """Release one use of each row; rows no longer used become evictable, the last one given
        the most recent (so pass a chain in order: its first block outlives its last)."""
        for row in reversed(rows):
            users = self._pins[row] - 1
            if users:
                self._pins[row] = users
            else:
                del self._pins[row]
                self._unpinned[row] = None

    def clear(self) -> None:
        """Forget every block and pin; rows handed out before are reused first."""
        self._free = list(range(self._used - 1, -1, -1))
        self._rows.clear()
        self._keys.clear()
        self._pins.clear()
        self._unpinned.clear()

    def _touch(self, rows: list[int]) -> None:
        # From the last block back, so the first block of the chain is the most recently used.
        for row in reversed(rows):
            if row in self._unpinned:
                self._unpinned.move_to_end(row)


@dataclass(eq=False)
class PrefixLease:
    """One sequence's part in the prefix cache, from admission until it ends."""

    tokens: list[int]  # the ids of its slot's positions: the prompt, then each token decoded into it
    epoch: int  # the cache's epoch when it began; another one means its keys and values are stale
    keys: list[bytes] = field(default_factory=list)  # keys of the full blocks of `tokens`, as far as needed
    blocks: int = 0  # leading blocks of its slot already taken from the cache or offered to it
    rows: list[int] = field(default_factory=list)  # rows it pins, in chain order
    reused_tokens: int = 0  # positions copied from the cache instead of computed
    storing: bool = True  # false once a block found no row: blocks after it could never be reached
    # The first block's parent key: b"" for the model's default weights, else the key of the LoRA
    # adapter it is computed with (adapter_namespace), so that adapters never share blocks.
    namespace: bytes = b""


class PrefixCache:
    """Blocks of keys and values in a pool beside a SlotKVCache, at most `budget_bytes` of them."""

    def __init__(
        self, slots: SlotKVCache, layers: int, kv_heads: int, head_dim: int, device: torch.device, budget_bytes: int
    ) -> None:
        self._slots = slots
        self._shape = (kv_heads, BLOCK_TOKENS, head_dim)
        self._layers = layers
        self._device = device
        row_bytes = 2 * layers * kv_heads * BLOCK_TOKENS * head_dim * slots.dtype.itemsize
        self.index = BlockIndex(budget_bytes // row_bytes)
        self._keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, BLOCK_TOKENS, head_dim]
        self._values: list[torch.Tensor] = []
        self.epoch = 0  # bumped by clear

    def begin(self, prompt: Sequence[int], namespace: bytes = b"") -> PrefixLease:
        """A lease for `prompt`, computed with the weights `namespace` stands for (adapter_namespace)."""
        keys = block_keys(prompt, namespace)
        return PrefixLease(tokens=list(prompt), epoch=self.epoch, keys=keys, namespace=namespace)

    def take(self, lease: PrefixLease, slot: int, cached: int) -> int:
        """Copy into `slot` the cached blocks that continue its first `cached` positions, leaving at
        least the prompt's last token to compute (its logits are needed); return the positions now
        cached. Only from a block boundary that every position before was offered to the cache."""
        if lease.epoch != self.epoch or cached != lease.blocks * BLOCK_TOKENS:
            return cached
        limit = (len(lease.tokens) - 1) // BLOCK_TOKENS
        rows = self.index.match(lease.keys[lease.blocks : limit])
        if not rows:
            return cached
        for row in rows:
            self.index.pin(row)
        lease.rows += rows
        count = len(rows) * BLOCK_TOKENS
        self._slots.ensure(slot + 1, cached + count)
        kv_heads, _, head_dim = self._shape
        index = to_device(torch.tensor(rows), self._device)
        for pool, cache in ((self._keys, self._slots.keys), (self._values, self._slots.values)):
            for layer in range(self._layers):
                # [n, kv_heads, B, d] -> [kv_heads, n * B, d]
                blocks = pool[layer][index].transpose(0, 1).reshape(kv_heads, count, head_dim)
                cache[layer][slot, :, cached : cached + count] = blocks
        lease.blocks += len(rows)
        lease.reused_tokens += count
        return cached + count

    def store(self, lease: PrefixLease, slot: int, cached: int) -> None:
        """Offer the cache the full blocks among the first `cached` positions of `slot` (whose ids
        are lease.tokens) that it was not offered yet; blocks it holds already are pinned, not copied."""
        end = cached // BLOCK_TOKENS
        if lease.epoch != self.epoch or not lease.storing or end <= lease.blocks:
            return
        known = len(lease.keys)
        if end > known:
            parent = lease.keys[-1] if lease.keys else lease.namespace
            lease.keys += block_keys(lease.tokens[known * BLOCK_TOKENS : end * BLOCK_TOKENS], parent)
        new_blocks, new_rows = [], []
        for block in range(lease.blocks, end):
            key = lease.keys[block]
            row = self.index.row(key)
            if row is None:
                row = self.index.add(key)
                if row is None:
                    lease.storing = False
                    break
                new_blocks.append(block)
                new_rows.append(row)
            self.index.pin(row)
            lease.rows.append(row)
        lease.blocks = end
        if new_rows:
            self._copy_in(slot, new_blocks, new_rows)

    def release(self, lease: PrefixLease) -> None:
        """The sequence ended: its blocks may be evicted from now on."""
        if lease.epoch == self.epoch:
            self.index.unpin(lease.rows)
        lease.rows = []

    def clear(self) -> None:
        """Forget every block (the weights changed); running sequences' leases go stale."""
        self.index.clear()
        self.epoch += 1

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def _copy_in(self, slot: int, blocks: list[int], rows: list[int]) -> None:
        self._grow(max(rows) + 1)
        kv_heads, _, head_dim = self._shape
        n = len(blocks)
        offsets = torch.arange(BLOCK_TOKENS)
        positions = (torch.tensor(blocks).unsqueeze(1) * BLOCK_TOKENS + offsets).flatten()  # [n * B]
        positions = to_device(positions, self._device)
        index = to_device(torch.tensor(rows), self._device)
        for pool, cache in ((self._keys, self._slots.keys), (self._values, self._slots.values)):
            for layer in range(self._layers):
                # [kv_heads, n * B, d] -> [n, kv_heads, B, d]
                written = cache[layer][slot].index_select(1, positions).view(kv_heads, n, BLOCK_TOKENS, head_dim)
                pool[layer][index] = written.transpose(0, 1)

    def _grow(self, rows: int) -> None:
        have = self._keys[0].shape[0] if self._keys else 0
        if rows <= have:
            return
        size = min(self.index.capacity, max(rows, 2 * have))

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros((size, *self._shape), dtype=self._slots.dtype, device=self._device)
            if old is not None:
                new[:have] = old
            return new

        self._keys = [grown(t) for t in self._keys] or [grown(None) for _ in range(self._layers)]
        self._values = [grown(t) for t in self._values] or [grown(None) for _ in range(self._layers)]
