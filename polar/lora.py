"""LoRA adapters: the layer, attaching it to a Hugging Face model, and the PEFT files.

A LoRA adapter of a linear layer y = x·Wᵀ + b adds a low-rank term: y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ, with
A [r, in] and B [out, r] and s = alpha / r. The base weight W stays frozen; only A and B train, so
the optimizer holds 2·r·(in + out) numbers per layer instead of in·out, and a weight push carries
those alone. B starts at zero, so an adapter that has not trained yet serves the base model exactly.

`LoraLinear` is an nn.Linear (the base weight and bias keep their Hugging Face names) with two more
submodules, `lora_A` and `lora_B`: the adapter's parameters are named `...q_proj.lora_A.weight` and
`...q_proj.lora_B.weight`, the names PEFT writes (behind its `base_model.model.` prefix), so the
trainer, the inference engines and the files on disk all use one set of names.

On disk an adapter is a PEFT folder, which Hugging Face PEFT and vLLM load as it is:

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in], ....lora_B.weight [out, r]
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from polar.config import DEFAULT_LORA_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's wrapper around the model, in its saved key names
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoraError(ValueError):
    """An adapter setting or folder that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class LoraSettings:
    """The shape of an adapter: its rank, its alpha (the scale is alpha / rank) and the modules it
    adapts (a module is adapted when its name is a target or ends with "." + a target)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def parse(cls, rank: int, alpha: float, targets: str = DEFAULT_LORA_TARGETS) -> LoraSettings:
        """From the config's settings; `targets` comma-separated."""
        names = tuple(name.strip() for name in targets.split(",") if name.strip())
        if rank < 1:
            raise LoraError(f"lora_rank must be >= 1 for an adapter, not {rank}")
        if not alpha > 0 or not math.isfinite(alpha):
            raise LoraError(f"lora_alpha must be a finite number > 0, not {alpha}")
        if not names:
            raise LoraError("lora_targets names no module (e.g. q_proj,v_proj)")
        return cls(rank, float(alpha), names)


class LoraLinear(nn.Linear):
    """A linear layer plus its adapter: y = x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ. It shares the base layer's
    weight and bias (no copy) and holds A and B as `lora_A` and `lora_B` (bias-free linear layers)."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dtype = dtype or base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device, dtype=dtype)
        self.scaling = scaling
        self.enabled = True
        # PEFT's initialisation: A as nn.Linear's default, B zero (so the adapter starts as no change).
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(x)) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + scaling·B·A, in the base weight's dtype (computed in fp32 at least)."""
        compute = torch.promote_types(self.weight.dtype, torch.float32)
        delta = self.lora_B.weight.to(compute) @ self.lora_A.weight.to(compute)
        return (self.weight.to(compute) + self.scaling * delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}"


def attach(model: nn.Module, settings: LoraSettings, dtype: torch.dtype | None = None) -> list[str]:
    """Replace every targeted nn.Linear of `model` by a LoraLinear over it (in place); the names of
    the adapted modules. `dtype`: the adapters' (default: each base weight's). LoraError when a
    target matches no linear layer (a misspelt name would otherwise train nothing)."""
    adapted, matched = [], set()
    for name, module in list(model.named_modules()):
        target = target_of(name, settings.targets)
        if target is None or not isinstance(module, nn.Linear) or isinstance(module, LoraLinear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(module, settings.rank, settings.scaling, dtype))
        adapted.append(name)
        matched.add(target)
    missing = [target for target in settings.targets if target not in matched]
    if missing:
        raise LoraError(f"lora_targets {', '.join(missing)} match no linear layer of the model")
    return adapted


def target_of(name: str, targets: tuple[str, ...]) -> str | None:
    """The target that adapts the module `name` (its name, or its name's last dotted parts); None."""
    return next((t for t in targets if name == t or name.endswith("." + t)), None)


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


def is_adapter_name(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter matrix, A and B, in model order."""
    for name, parameter in model.named_parameters():
        if is_adapter_name(name):
            yield name, parameter


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter of `model` left out while the block runs."""
    layers = [layer for _, layer in adapter_layers(model)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter merged into its base weight (W + s·B·A) and the
    adapters' own entries left out: the state dict of the plain model that computes the same."""
    merged = {f"{name}.weight": layer.merged_weight() for name, layer in adapter_layers(model)}
    state = {}
    for name, tensor in model.state_dict().items():
        if not is_adapter_name(name):
            state[name] = merged.get(name, tensor).detach()
    return state


def merge_into(model: nn.Module) -> None:
    """Replace every LoraLinear of `model` by a plain nn.Linear holding the merged weight (in place):
    `model` becomes the plain Hugging Face model, which save_pretrained writes as such."""
    for name, layer in list(adapter_layers(model)):
        plain = nn.Linear(
            layer.in_features,
            layer.out_features,
            bias=layer.bias is not None,
            device=layer.weight.device,
            dtype=layer.weight.dtype,
        )
        with torch.no_grad():
            plain.weight.copy_(layer.merged_weight())
            if layer.bias is not None:
                plain.bias.copy_(layer.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)


# -- the PEFT folder ------------------------------------------------------------------------------


def is_adapter_folder(path: Path | str) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def save_adapter(folder: Path, model: nn.Module, settings: LoraSettings, base_model: str) -> None:
    """Write the adapters of `model` as a PEFT folder (`base_model`: the folder they adapt)."""
    save_adapter_tensors(folder, adapter_parameters(model), settings, base_model)


def save_adapter_tensors(
    folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], settings: LoraSettings, base_model: str
) -> None:
    """Write adapter matrices (model parameter names, e.g. `...q_proj.lora_A.weight`, and their PEFT
    shapes) as a PEFT folder (`base_model`: the folder they adapt)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    on_disk = {PEFT_PREFIX + name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in tensors}
    save_file(on_disk, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "target_modules": list(settings.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


@dataclass(frozen=True)
class AdapterFolder:
    """A PEFT adapter read from disk: its settings, the model it adapts, and its matrices under the
    model's own parameter names."""

    settings: LoraSettings
    base_model: str
    tensors: Mapping[str, torch.Tensor]


def read_adapter(folder: Path | str) -> AdapterFolder:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors); LoraError naming what is
    missing or not supported (this reader takes plain LoRA: one rank and alpha, no DoRA, no bias)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{folder / CONFIG_FILE} is not a readable adapter config: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {folder} is {config.get('peft_type')!r}, not a LoRA adapter")
    unsupported = [key for key in ("use_dora", "use_rslora") if config.get(key)]
    unsupported += [key for key in ("rank_pattern", "alpha_pattern", "modules_to_save") if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise LoraError(f"adapter {folder} uses {', '.join(unsupported)}: only plain LoRA adapters are supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise LoraError(f"adapter {folder}: target_modules as a pattern ({targets!r}) is not supported; list names")
    try:
        settings = LoraSettings.parse(int(config.get("r", 0)), float(config.get("lora_alpha", 0)), ",".join(targets))
        tensors = load_file(folder / WEIGHTS_FILE)
    except (OSError, SafetensorError, TypeError, ValueError) as exc:
        raise LoraError(f"adapter {folder} cannot be read: {exc}") from None
    named = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        # PEFT's in-memory names carry the adapter's name ("lora_A.default.weight"); saved ones do not.
        name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if not is_adapter_name(name):
            raise LoraError(f"adapter {folder} holds {key!r}, which is not a LoRA matrix")
        named[name] = tensor
    return AdapterFolder(settings, str(config.get("base_model_name_or_path") or ""), named)


def load_adapter_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` (an AdapterFolder's) into the adapters of `model`; LoraError unless they are
    exactly its adapter matrices, each of its shape."""
    parameters = dict(adapter_parameters(model))
    missing = sorted(set(parameters) - set(tensors))
    extra = sorted(set(tensors) - set(parameters))
    if missing or extra:
        listed = "; ".join(
            part
            for part in (
                f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "") if missing else "",
                f"unknown {', '.join(extra[:3])}" + (" ..." if len(extra) > 3 else "") if extra else "",
            )
            if part
        )
        raise LoraError(f"the adapter does not fit the model: {listed}")
    with torch.no_grad():
        for name, parameter in parameters.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(parameter.shape):
                raise LoraError(
                    f"adapter matrix {name} has shape {list(tensor.shape)}, the model's is {list(parameter.shape)}"
                )
            parameter.copy_(tensor)


def write_merged_model(adapter_folder: Path, out: Path, base_model: str = "") -> Path:
    """The adapter merged into its base model (`base_model`, else the one its config names), written
    as a plain Hugging Face folder (safetensors, config, tokenizer) at `out`; the base folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polar.inference.models import ModelNotFoundError, resolve_model

    saved = read_adapter(adapter_folder)
    base = base_model or saved.base_model
    if not base:
        raise LoraError(f"adapter {adapter_folder} names no base model (base_model_name_or_path): give it")
    try:
        folder = resolve_model(base)
    except ModelNotFoundError as exc:
        raise LoraError(str(exc)) from None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    attach(model, saved.settings)
    load_adapter_tensors(model, saved.tensors)
    merge_into(model)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return folder
