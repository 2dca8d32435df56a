"""A decoder forward over a slot-based KV cache, for Llama-family Hugging Face models.

The model owns the weights (decoder_model.py's tree, or transformers' own model: either way
state-dict names, tying and weight updates stay Hugging Face's); this module only re-orders its
submodules around a cache built for continuous
batching: every sequence owns one slot of a [slots, kv_heads, positions, head_dim] tensor per layer,
a decode step runs all slots [0, n) at once over a view of the cache (no gather), and each slot masks
the positions it has not written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.rnn import pad_sequence

from polar.inference.sampling import to_device

# Architectures whose decoder layer is: RMSNorm, attention (optional q/k bias, optional q/k
# RMSNorm per head), RoPE, residual, RMSNorm, gated MLP, residual.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ALIGN = 64  # cache lengths, and the keys a decode step reads, are rounded up to this many positions
# cuDNN attention builds a new plan for every new key length (tens of ms each, once per decode step
# here), so attention runs on the kernels that take any shape as it comes.
_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class UnsupportedModelError(ValueError):
    """The model's architecture is not one this forward implements."""


class SlotKVCache:
    """Keys and values of every layer: [slots, kv_heads, positions, head_dim], grown on demand.

    Growth doubles (capped at max_slots and max_positions) and copies what was written; `release`
    drops the tensors when no sequence needs them.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_slots: int,
        max_positions: int,
    ) -> None:
        self._shape = (kv_heads, head_dim)
        self._layers = layers
        self.dtype = dtype
        self._device = device
        self.max_slots = max_slots
        self.max_positions = max_positions
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = 0
        self.positions = 0
        self.generation = 0  # bumped whenever the tensors are replaced

    def ensure(self, slots: int, positions: int) -> None:
        """Make room for slots [0, slots) and positions [0, positions)."""
        if slots > self.max_slots or positions > self.max_positions:
            raise ValueError(
                f"cache of {self.max_slots} slots x {self.max_positions} positions cannot hold "
                f"{slots} slots x {positions} positions"
            )
        if slots <= self.slots and positions <= self.positions:
            return
        new_slots = min(self.max_slots, max(slots, 2 * self.slots))
        new_positions = max(positions, 2 * self.positions) if positions > self.positions else self.positions
        new_positions = min(self.max_positions, -(-new_positions // _ALIGN) * _ALIGN)
        self.keys = [self._grown(t, new_slots, new_positions) for t in self.keys] or self._empty(
            new_slots, new_positions
        )
        self.values = [self._grown(t, new_slots, new_positions) for t in self.values] or self._empty(
            new_slots, new_positions
        )
        self.slots, self.positions = new_slots, new_positions
        self.generation += 1

    def release(self) -> None:
        self.keys, self.values = [], []
        self.slots = self.positions = 0
        self.generation += 1

    def _empty(self, slots: int, positions: int) -> list[torch.Tensor]:
        kv_heads, head_dim = self._shape
        return [
            torch.zeros(slots, kv_heads, positions, head_dim, dtype=self.dtype, device=self._device)
            for _ in range(self._layers)
        ]

    def _grown(self, old: torch.Tensor, slots: int, positions: int) -> torch.Tensor:
        new = old.new_zeros(slots, old.shape[1], positions, old.shape[3])
        new[: old.shape[0], :, : old.shape[2]] = old
        return new


# CUDA graphs are captured per (slots, key positions) bucket: powers of two from these minimums.
_MIN_GRAPH_SLOTS = 8
_MIN_GRAPH_POSITIONS = 256


def _bucket(value: int, minimum: int, cap: int) -> int:
    return min(cap, max(minimum, 1 << (value - 1).bit_length()))


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    token_ids: torch.Tensor  # [slots] static input
    positions: torch.Tensor  # [slots] static input
    logits: torch.Tensor  # [slots, V] static output


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, q, head_dim]; cos, sin [n, 1, q, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class DecoderRunner:
    """Runs a Hugging Face Llama-family causal LM against a SlotKVCache."""

    def __init__(self, model: nn.Module, max_slots: int, cuda_graphs: bool = False) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {config.model_type!r}"
            )
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported by the torch engine")
        self.model = model
        self.decoder = model.model
        attention = self.decoder.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.group = self.heads // self.kv_heads
        self.has_qk_norm = hasattr(attention, "q_norm")
        parameter = next(model.parameters())
        # On a GPU each RMSNorm is one fused kernel rather than Hugging Face's seven elementwise ones
        # (four norms a layer: most of a decode step's launches); the CPU keeps the model's own modules.
        self.fused_norms = parameter.device.type == "cuda"
        self.cache = SlotKVCache(
            layers=len(self.decoder.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=parameter.dtype,
            device=parameter.device,
            max_slots=max_slots,
            max_positions=config.max_position_embeddings,
        )
        self.cuda_graphs = cuda_graphs and parameter.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._graph_cache_generation = -1
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def release(self) -> None:
        """Drop the keys and values and the graphs that read them, and hand their GPU memory back
        to the driver: a trainer stepping on the same GPU while no sequence runs can take it."""
        self.cache.release()
        if self.cuda_graphs and self._graphs:
            self._drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @sdpa_kernel(_ATTENTION_BACKENDS)
    def prefill(self, slots: list[int], chunks: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
        """Write chunks[r] [q_r] (device) at positions [starts[r], starts[r] + q_r) of slot slots[r],
        all in one forward over the chunks right-padded to the longest; return the logits [b, V] fp32
        of each chunk's last position.

        Padding queries write nothing and attend to whatever their slot holds: their outputs are
        dropped, and no real query sees their positions.
        """
        b = len(chunks)
        lengths = [chunk.shape[0] for chunk in chunks]
        q_len = max(lengths)
        end = max(start + length for start, length in zip(starts, lengths, strict=True))
        self.cache.ensure(max(slots) + 1, end)
        device = self.device
        offsets = torch.arange(q_len, device=device)
        positions = to_device(torch.tensor(starts), device).unsqueeze(1) + offsets  # [b, q]
        cos, sin = self._rope(positions)  # [b, 1, q, head_dim]
        # A prompt's first chunk attends to itself only: causal attention over the fresh keys. A later
        # chunk also reads the keys its earlier chunks left in the cache.
        fresh = not any(starts)
        visible = None if fresh else torch.arange(end, device=device) <= positions.unsqueeze(-1)  # [b, q, end]
        mask = None if fresh else self._additive(visible.unsqueeze(1))  # [b, 1, q, end]
        writes = None if b == 1 else self._prefill_writes(slots, lengths, starts, q_len)
        read_slots = None if b == 1 or fresh else to_device(torch.tensor(slots), device)
        hidden = self.decoder.embed_tokens(pad_sequence(chunks, batch_first=True))  # [b, q, hidden]
        for index, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            q, k, v = self._qkv(attention, self._norm(layer.input_layernorm, hidden), cos, sin)  # [b, heads, q, d]
            keys, values = self.cache.keys[index], self.cache.values[index]
            if writes is None:
                slot, start = slots[0], starts[0]
                keys[slot, :, start : start + q_len] = k[0]
                values[slot, :, start : start + q_len] = v[0]
            else:
                write_slots, write_positions, rows = writes
                keys[write_slots, :, write_positions] = k.transpose(1, 2).reshape(b * q_len, self.kv_heads, -1)[rows]
                values[write_slots, :, write_positions] = v.transpose(1, 2).reshape(b * q_len, self.kv_heads, -1)[rows]
            if fresh:
                read_keys, read_values = k, v
            elif read_slots is None:
                read = slice(slots[0], slots[0] + 1)
                read_keys, read_values = keys[read, :, :end], values[read, :, :end]
            else:
                read_keys, read_values = keys[read_slots, :, :end], values[read_slots, :, :end]
            out = F.scaled_dot_product_attention(
                q,
                read_keys,
                read_values,
                attn_mask=mask,
                is_causal=fresh,
                scale=attention.scaling,
                enable_gqa=True,
            )  # [b, heads, q, d]
            hidden = self._finish_layer(layer, hidden, out.transpose(1, 2).reshape(b, q_len, -1))
        last = to_device(torch.tensor(lengths) - 1, device)
        return self._logits(hidden[torch.arange(b, device=device), last])

    def _prefill_writes(
        self, slots: list[int], lengths: list[int], starts: list[int], q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the real tokens of a padded prefill go: their cache slots and positions, and their
        rows in the flattened [b * q] batch (each [tokens], device)."""
        write_slots, write_positions, rows = [], [], []
        for r, (slot, length, start) in enumerate(zip(slots, lengths, starts, strict=True)):
            write_slots += [slot] * length
            write_positions += range(start, start + length)
            rows += range(r * q_len, r * q_len + length)
        device = self.device
        return tuple(to_device(torch.tensor(values), device) for values in (write_slots, write_positions, rows))

    @sdpa_kernel(_ATTENTION_BACKENDS)
    def decode(self, token_ids: list[int], positions: list[int], rows: list[int]) -> torch.Tensor:
        """One step for slots [0, n): token_ids[i] goes to position positions[i] of slot i, which
        attends to its positions [0, positions[i]]; return logits [len(rows), V] fp32 of `rows`.

        Takes host lists so that sizing the step needs no device sync. With CUDA graphs on, the
        step pads to a bucket of slots and key positions and replays a captured graph.
        """
        if self.cuda_graphs:
            return self._decode_graphed(token_ids, positions, rows)
        n = len(token_ids)
        # Fewer distinct shapes: read a whole number of alignment blocks, the excess masked out.
        length = min(-(-(max(positions) + 1) // _ALIGN) * _ALIGN, self.cache.max_positions)
        self.cache.ensure(n, length)
        device = self.device
        hidden = self._decode_hidden(
            to_device(torch.tensor(token_ids), device), to_device(torch.tensor(positions), device), length
        )
        return self._logits(hidden[to_device(torch.tensor(rows), device)])

    def _decode_hidden(self, token_ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """token_ids, positions [n] (device) over keys [0, length) -> final hidden states [n, hidden]."""
        n = token_ids.shape[0]
        slots = torch.arange(n, device=token_ids.device)
        cos, sin = self._rope(positions.unsqueeze(1))  # [n, 1, 1, head_dim]
        visible = torch.arange(length, device=token_ids.device) <= positions.unsqueeze(1)  # [n, length]
        mask = self._additive(visible[:, None, None, :])  # [n, 1, 1, length]
        hidden = self.decoder.embed_tokens(token_ids.unsqueeze(1))  # [n, 1, hidden]
        for index, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            q, k, v = self._qkv(attention, self._norm(layer.input_layernorm, hidden), cos, sin)  # [n, heads, 1, d]
            keys, values = self.cache.keys[index], self.cache.values[index]
            keys[slots, :, positions] = k[:, :, 0]
            values[slots, :, positions] = v[:, :, 0]
            # A query head h reads kv head h // group: fold the group into the query length so
            # every backend runs grouped-query attention without repeating the cache.
            out = F.scaled_dot_product_attention(
                q.view(n, self.kv_heads, self.group, self.head_dim),
                keys[:n, :, :length],
                values[:n, :, :length],
                attn_mask=mask,
                scale=attention.scaling,
            )  # [n, kv_heads, group, d]
            hidden = self._finish_layer(layer, hidden, out.reshape(n, 1, -1))
        return hidden[:, 0]

    def capture_graphs(self, positions: int) -> None:
        """Give the cache every slot and at least `positions` positions now, and capture the decode
        graph of every bucket within them. Otherwise the first step that decodes more sequences, or
        reads further, than any before grows the cache, which makes every graph captured so far read
        freed tensors: decoding pauses to capture again, mid-run."""
        slots = self.cache.max_slots
        length = _bucket(positions, _MIN_GRAPH_POSITIONS, self.cache.max_positions)
        self.cache.ensure(slots, length)
        lengths, bucket = [], _MIN_GRAPH_POSITIONS
        while bucket < length:
            lengths.append(bucket)
            bucket *= 2
        lengths.append(length)
        for n in sorted({_bucket(n, _MIN_GRAPH_SLOTS, slots) for n in range(1, slots + 1)}):
            for keys in lengths:
                # Nothing is cached yet: what the steps write is overwritten before anyone reads it.
                self._decode_graphed([0] * n, [keys - 1] + [0] * (n - 1), [0])

    def _decode_graphed(self, token_ids: list[int], positions: list[int], rows: list[int]) -> torch.Tensor:
        slots = _bucket(len(token_ids), _MIN_GRAPH_SLOTS, self.cache.max_slots)
        length = _bucket(max(positions) + 1, _MIN_GRAPH_POSITIONS, self.cache.max_positions)
        self.cache.ensure(slots, length)
        if self._graph_cache_generation != self.cache.generation:  # the graphs read freed tensors
            self._drop_graphs()
            self._graph_cache_generation = self.cache.generation
        # Padding slots are free ones (n is past the last occupied slot): writing position 0 there is
        # overwritten by whoever takes the slot next.
        pad = slots - len(token_ids)
        host_tokens = torch.tensor(token_ids + [0] * pad)
        host_positions = torch.tensor(positions + [0] * pad)
        graph = self._graphs.get((slots, length))
        if graph is None:
            graph = self._capture(slots, length, host_tokens, host_positions)
            self._graphs[(slots, length)] = graph
        else:
            # From pinned memory, so that queuing the replay does not wait for the GPU to go idle.
            graph.token_ids.copy_(host_tokens.pin_memory(), non_blocking=True)
            graph.positions.copy_(host_positions.pin_memory(), non_blocking=True)
            graph.graph.replay()
        return graph.logits[to_device(torch.tensor(rows), self.device)]

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        # Deleting every graph of a private pool frees the pool; capturing into its old handle
        # afterwards trips the caching allocator's use-count assertion, so take a new one.
        self._graph_pool = torch.cuda.graph_pool_handle()

    def _capture(
        self, slots: int, length: int, host_tokens: torch.Tensor, host_positions: torch.Tensor
    ) -> _DecodeGraph:
        """Run this step eagerly to warm its kernels up, record it (recording executes nothing),
        then replay it for this step's logits; the replay rewrites the same keys and values."""
        token_ids = host_tokens.to(self.device)
        positions = host_positions.to(self.device)
        self._logits(self._decode_hidden(token_ids, positions, length))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self._logits(self._decode_hidden(token_ids, positions, length))
        graph.replay()
        return _DecodeGraph(graph, token_ids, positions, logits)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        # An additive float mask lets CPU attention take its fused kernel (a bool mask does not).
        zeros = torch.zeros(visible.shape, dtype=self.cache.dtype, device=visible.device)
        return zeros.masked_fill(~visible, float("-inf"))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, q] -> cos, sin [b, 1, q, head_dim] from the model's own rotary module."""
        dtype_probe = self.decoder.embed_tokens.weight[:1]
        cos, sin = self.decoder.rotary_emb(dtype_probe, positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _qkv(self, attention: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, q, hidden] -> q [b, heads, q, d], k and v [b, kv_heads, q, d], RoPE applied."""
        b, q_len, _ = x.shape
        q = attention.q_proj(x).view(b, q_len, -1, self.head_dim)
        k = attention.k_proj(x).view(b, q_len, -1, self.head_dim)
        v = attention.v_proj(x).view(b, q_len, -1, self.head_dim)
        if self.has_qk_norm:
            q, k = self._norm(attention.q_norm, q), self._norm(attention.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm module `norm` applied to x over its last dimension."""
        if self.fused_norms:
            return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
        return norm(x)

    def _finish_layer(self, layer: nn.Module, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = hidden + layer.self_attn.o_proj(attended)
        return hidden + layer.mlp(self._norm(layer.post_attention_layernorm, hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [r, hidden] -> logits [r, V] fp32."""
        return self.model.lm_head(self._norm(self.decoder.norm, hidden)).float()
