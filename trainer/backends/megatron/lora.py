"""LoRA adapters on the Megatron model, split over tensor-parallel ranks like the layers they adapt.

The adapters are PEFT's: one per Hugging Face projection (q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj), A [r, in] and B [out, r], output scaled by s = alpha / r (polar/lora.py). A push
and a checkpoint carry them under PEFT's names and shapes, exactly what the torch backend writes.

Megatron fuses q/k/v into linear_qkv and gate/up into linear_fc1 (column-parallel: each rank computes
a slice of the outputs), and o_proj and down_proj are the row-parallel linear_proj and linear_fc2
(each rank takes a slice of the inputs, and the partial outputs are all-reduced). Each projection's
adapter lives beside its fused layer, as `<layer>.lora.adapters.<projection>.lora_A` / `.lora_B`, split
the same way:

    column-parallel (q, k, v, gate, up)   A replicated; B split on its output rows, the rank's rows
                                          of that projection (its KV groups' heads, its MLP slice)
    row-parallel (o, down)                A split on its input columns; B replicated

Column: z = x·Aᵀ on every rank (x is replicated), then each rank's y = s·z·B_rankᵀ. The gradient of
z from one rank covers only that rank's outputs, so z passes Megatron's copy-to-tensor-parallel
region (identity forward, all-reduce backward): dL/dA is then whole, and the same, on every rank.
The projections' outputs are laid out as the fused layer's: per KV group its query heads, its key
head, its value head (linear_qkv), or the gate slice then the up slice (linear_fc1); a projection
that is not a target contributes zeros there.

Row: z = x_rank·A_rankᵀ is a partial sum, all-reduced (Megatron's reduce-from region: all-reduce
forward, identity backward); then y = s·z·Bᵀ, the same on every rank, added to the layer's
all-reduced output.

The adapters are fp32 parameters whatever the model's dtype (the matrices are cast to the
activations' dtype in the forward, so their gradients arrive in fp32), as in the torch backend.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from polar.lora import LoraError, LoraSettings, target_of
from trainer.backends.megatron.model import ModelShape

# Megatron layer suffix -> (the HF module holding its projections, the projections in the fused
# layer's order, how the layer is parallel).
_ADAPTED_LAYERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": ("self_attn", ("o_proj",), "row"),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": ("mlp", ("down_proj",), "row"),
}
ADAPTABLE = tuple(projection for _, projections, _ in _ADAPTED_LAYERS.values() for projection in projections)


@dataclass(frozen=True)
class AdapterMatrix:
    """One adapter matrix: its Megatron parameter name, its PEFT name, its whole (HF) shape and the
    dimension split over tensor-parallel ranks (None: every rank holds all of it)."""

    megatron: str
    hf: str
    shape: tuple[int, int]
    split: int | None

    def shard(self, whole: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's part of the whole matrix."""
        return whole if self.split is None else whole.chunk(tp_size, dim=self.split)[tp_rank]

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole matrix from every rank's part (rank order)."""
        return shards[0] if self.split is None or len(shards) == 1 else torch.cat(list(shards), dim=self.split)


def _projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Each projection's HF weight shape [out, in]."""
    hidden, ffn = shape.hidden_size, shape.ffn_hidden_size
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": (q_rows, hidden),
        "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden),
        "o_proj": (hidden, q_rows),
        "gate_proj": (ffn, hidden),
        "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn),
    }


def adapted_projections(shape: ModelShape, settings: LoraSettings) -> dict[str, tuple[str, ...]]:
    """Megatron layer name -> the projections of it that `settings` adapts (those with any), in
    model order; LoraError for a target that names no projection this backend can adapt."""
    adapted, matched = {}, set()
    for layer in range(shape.num_layers):
        for suffix, (hf_module, projections, _) in _ADAPTED_LAYERS.items():
            chosen = []
            for projection in projections:
                target = target_of(f"model.layers.{layer}.{hf_module}.{projection}", settings.targets)
                if target is not None:
                    chosen.append(projection)
                    matched.add(target)
            if chosen:
                adapted[f"decoder.layers.{layer}.{suffix}"] = tuple(chosen)
    missing = [target for target in settings.targets if target not in matched]
    if missing:
        raise LoraError(
            f"lora_targets {', '.join(missing)} match no projection the megatron backend adapts "
            f"({', '.join(ADAPTABLE)})"
        )
    return adapted


def adapter_matrices(shape: ModelShape, settings: LoraSettings) -> list[AdapterMatrix]:
    """Every adapter matrix of the model, in the torch backend's (and PEFT's) order: per layer, per
    projection, A then B."""
    shapes = _projection_shapes(shape)
    matrices = []
    for layer_name, projections in adapted_projections(shape, settings).items():
        suffix = layer_name.split(".", 3)[3]
        hf_module, _, parallel = _ADAPTED_LAYERS[suffix]
        layer = layer_name.split(".")[2]
        for projection in projections:
            out, into = shapes[projection]
            megatron = f"{layer_name}.lora.adapters.{projection}"
            hf = f"model.layers.{layer}.{hf_module}.{projection}"
            a_split, b_split = (None, 0) if parallel == "column" else (1, None)
            matrices.append(AdapterMatrix(f"{megatron}.lora_A", f"{hf}.lora_A.weight", (settings.rank, into), a_split))
            matrices.append(AdapterMatrix(f"{megatron}.lora_B", f"{hf}.lora_B.weight", (out, settings.rank), b_split))
    return matrices


class ProjectionAdapter(nn.Module):
    """One projection's A and B (this rank's parts)."""

    def __init__(self, a_shape: tuple[int, int], b_shape: tuple[int, int], device: torch.device) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(a_shape, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=torch.float32, device=device))


class LayerAdapters(nn.Module):
    """The adapters of one Megatron linear layer: `forward(x)` is what they add to its output."""

    def __init__(
        self,
        parallel: str,
        projections: Mapping[str, tuple[tuple[int, int], tuple[int, int]]],
        layout: Sequence[tuple[str, int]],
        groups: int,
        scaling: float,
        device: torch.device,
    ) -> None:
        """`projections`: each adapted projection's local A and B shapes; `layout`: every projection of
        the fused layer with its local output rows, in the order its output holds them per group
        (`groups` KV groups for linear_qkv, else 1)."""
        super().__init__()
        self.parallel = parallel
        self.layout = tuple(layout)
        self.groups = groups
        self.scaling = scaling
        self.enabled = True
        self.adapters = nn.ModuleDict(
            {name: ProjectionAdapter(a_shape, b_shape, device) for name, (a_shape, b_shape) in projections.items()}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        dtype = x.dtype
        if self.parallel == "row":
            (adapter,) = self.adapters.values()
            z = reduce_from_tensor_model_parallel_region(F.linear(x, adapter.lora_A.to(dtype)))
            return F.linear(z, adapter.lora_B.to(dtype)) * self.scaling
        names = list(self.adapters)
        a = torch.cat([self.adapters[name].lora_A for name in names]).to(dtype)
        z = copy_to_tensor_model_parallel_region(F.linear(x, a))  # [..., P * r]
        parts = dict(zip(names, z.chunk(len(names), dim=-1)))
        lead = x.shape[:-1]
        outputs = []
        for name, rows in self.layout:
            if name in parts:
                y = F.linear(parts[name], self.adapters[name].lora_B.to(dtype))
            else:
                y = x.new_zeros(*lead, rows)
            outputs.append(y.reshape(*lead, self.groups, rows // self.groups))
        return torch.cat(outputs, dim=-1).reshape(*lead, -1) * self.scaling


def _add_adapters(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook of an adapted Megatron linear layer: its output plus its adapters'."""
    adapters = module.lora
    if not adapters.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapters(x), bias


def attach(model: nn.Module, shape: ModelShape, settings: LoraSettings, tp_size: int) -> list[AdapterMatrix]:
    """Add the adapters of `settings` to `model` (this rank's parts, zero) as `<layer>.lora`, each
    layer's output hooked to add them; the adapter matrices. LoraError for an unusable target."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    matrices = adapter_matrices(shape, settings)
    by_name = {matrix.megatron: matrix for matrix in matrices}
    shapes = _projection_shapes(shape)
    device = next(model.parameters()).device
    for layer_name, projections in adapted_projections(shape, settings).items():
        suffix = layer_name.split(".", 3)[3]
        _, fused, parallel = _ADAPTED_LAYERS[suffix]
        local = {}
        for projection in projections:
            parts = []
            for which in ("lora_A", "lora_B"):
                matrix = by_name[f"{layer_name}.lora.adapters.{projection}.{which}"]
                rows, columns = matrix.shape
                if matrix.split == 0:
                    rows //= tp_size
                elif matrix.split == 1:
                    columns //= tp_size
                parts.append((rows, columns))
            local[projection] = tuple(parts)
        groups = shape.num_kv_heads // tp_size if suffix == "self_attention.linear_qkv" else 1
        layout = [(projection, shapes[projection][0] // tp_size) for projection in fused]
        adapters = LayerAdapters(parallel, local, layout, groups, settings.scaling, device)
        linear = model.get_submodule(layer_name)
        linear.add_module("lora", adapters)
        linear.register_forward_hook(_add_adapters, with_kwargs=True)
    for name, parameter in model.named_parameters():
        matrix = by_name.get(name)
        if matrix is not None and matrix.split is not None:
            set_tensor_model_parallel_attributes(parameter, True, matrix.split, 1)
    return matrices


def initial_adapters(matrices: Sequence[AdapterMatrix], seed: int) -> dict[str, torch.Tensor]:
    """Whole matrices of a new adapter, PEFT's initialisation: A as nn.Linear's default (from `seed`,
    so every rank and every tensor-parallel size draws the same), B zero."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for matrix in matrices:
        tensor = torch.zeros(matrix.shape, dtype=torch.float32)
        if matrix.hf.endswith(".lora_A.weight"):
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        tensors[matrix.hf] = tensor
    return tensors


def load_shards(
    parameters: Mapping[str, nn.Parameter],
    matrices: Sequence[AdapterMatrix],
    tensors: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
) -> None:
    """Copy this rank's part of each whole matrix in `tensors` (PEFT names) into the adapters;
    LoraError unless they are exactly the model's adapter matrices, each of its shape."""
    expected = {matrix.hf for matrix in matrices}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        listed = "; ".join(
            f"{what} {', '.join(names[:3])}" + (" ..." if len(names) > 3 else "")
            for what, names in (("missing", missing), ("unknown", extra))
            if names
        )
        raise LoraError(f"the adapter does not fit the model: {listed}")
    with torch.no_grad():
        for matrix in matrices:
            whole = tensors[matrix.hf]
            if tuple(whole.shape) != matrix.shape:
                raise LoraError(
                    f"adapter matrix {matrix.hf} has shape {list(whole.shape)}, the model's is {list(matrix.shape)}"
                )
            parameters[matrix.megatron].copy_(matrix.shard(whole, tp_rank, tp_size))


def layer_adapters(model: nn.Module) -> Iterator[LayerAdapters]:
    for module in model.modules():
        if isinstance(module, LayerAdapters):
            yield module
