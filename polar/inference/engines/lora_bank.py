"""Several LoRA adapters over one served model, chosen per batch row (the torch engine's).

Each adapted projection keeps the matrices of every adapter the server holds, stacked: A [rows, R, in]
and B [rows, out, R], where R is the server's rank and row 0 is the default adapter. An adapter of a
smaller rank r fills A[row, :r] and B[row, :, :r] and leaves the rest zero, and one that adapts fewer
modules leaves its rows of the others zero: either way it adds exactly s·(x·Aᵀ)·Bᵀ of its own
matrices, so adapters of different shapes share one batch. Before each forward the engine writes which
row every batch row uses (`AdapterBank.select`); a layer then adds, for batch row b,
scale[row_b]·(x_b·A[row_b]ᵀ)·B[row_b]ᵀ. The selection lives in one buffer of fixed address, which a
captured CUDA graph reads afresh at every replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from polar import lora
from polar.inference.engines.base import ParameterSpec


class BankedLoraLinear(nn.Linear):
    """A linear layer plus the adapter rows of its bank: y = x·Wᵀ + b + scale[row]·(x·A[row]ᵀ)·B[row]ᵀ,
    `row` the bank's selection for each batch row (x is [batch, ..., in])."""

    def __init__(self, base: nn.Linear, bank: AdapterBank) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = dict(device=base.weight.device, dtype=bank.dtype)
        self.stacked_A = nn.Parameter(torch.zeros(bank.rows, bank.rank, self.in_features, **factory), False)
        self.stacked_B = nn.Parameter(torch.zeros(bank.rows, self.out_features, bank.rank, **factory), False)
        self.bank = [bank]  # in a list: the bank is no submodule of every layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        bank = self.bank[0]
        rows = bank.selection[: x.shape[0]]
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # [b, tokens, in]
        low = torch.bmm(flat, self.stacked_A[rows].transpose(1, 2)) * bank.scales[rows][:, None, None]
        return out + torch.bmm(low, self.stacked_B[rows].transpose(1, 2)).view(out.shape)


class AdapterBank:
    """The rows of adapters a model holds: row 0 the default adapter, rows 1.. the named ones."""

    def __init__(
        self, model: nn.Module, rank: int, targets: tuple[str, ...], rows: int, batch_rows: int, dtype: torch.dtype
    ) -> None:
        """Stacks of `rows` adapters of rank up to `rank` on the `targets` of `model` (in place), for
        forwards of at most `batch_rows` batch rows (the engine's max_batch_size)."""
        self.rank, self.targets, self.rows, self.dtype = rank, targets, rows, dtype
        device = next(model.parameters()).device
        self.scales = torch.zeros(rows, dtype=dtype, device=device)
        self.selection = torch.zeros(batch_rows, dtype=torch.long, device=device)
        self.layers: dict[str, BankedLoraLinear] = {}
        matched = set()
        for name, module in list(model.named_modules()):
            target = next((t for t in targets if name == t or name.endswith("." + t)), None)
            if target is None or not isinstance(module, nn.Linear):
                continue
            parent_name, _, child = name.rpartition(".")
            layer = BankedLoraLinear(module, self)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
            self.layers[name] = layer
            matched.add(target)
        missing = [t for t in targets if t not in matched]
        if missing:
            raise lora.LoraError(f"lora_targets {', '.join(missing)} match no linear layer of the model")

    def fits(self, settings: lora.LoraSettings) -> str:
        """Why an adapter of `settings` cannot take a row of this bank; "" when it can."""
        if settings.rank > self.rank:
            return f"its rank {settings.rank} is above the server's lora_rank {self.rank}"
        outside = [t for t in settings.targets if t not in self.targets]
        if outside:
            return (
                f"it adapts {', '.join(outside)}, which the server's lora_targets ({','.join(self.targets)}) leave out"
            )
        return ""

    def views(self, row: int, settings: lora.LoraSettings) -> dict[str, torch.Tensor]:
        """The matrices of the adapter in `row`, by their parameter names (PEFT's: `<module>.lora_A.weight`
        [r, in], `<module>.lora_B.weight` [out, r]), as views into the stacks: writing one sets it."""
        views = {}
        for name, layer in self.layers.items():
            if any(name == t or name.endswith("." + t) for t in settings.targets):
                views[f"{name}.lora_A.weight"] = layer.stacked_A[row, : settings.rank]
                views[f"{name}.lora_B.weight"] = layer.stacked_B[row, :, : settings.rank]
        return views

    def clear(self, row: int) -> None:
        """Zero `row`: its adapter adds nothing (and a smaller one put there later leaves no trace)."""
        for layer in self.layers.values():
            layer.stacked_A[row].zero_()
            layer.stacked_B[row].zero_()
        self.scales[row] = 0

    def select(self, rows: Sequence[int]) -> None:
        """The adapter row of each batch row of the next forward, in batch order."""
        self.selection[: len(rows)].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=False)


def specs_of(views: dict[str, torch.Tensor]) -> dict[str, ParameterSpec]:
    return {name: ParameterSpec(tuple(view.shape), view.dtype) for name, view in views.items()}
