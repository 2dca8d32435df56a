"""LoRA adapters served as PEFT folders, for the engines that load an adapter by its path: the vLLM
engine (vLLM's LoRA, in this process) and the upstream engine (an external `vllm serve`).

Such an engine cannot write into an adapter it holds, so each version of an adapter is a folder of
its own (the PEFT layout of polar/lora.py) loaded under a name and id of its own. A push writes the
adapter's matrices (the pushed ones over those held) as a new folder, loads it, sends the next
generations to it, and unloads the old version as soon as no generation runs on it any more. A
generation keeps the version it started with to its end, so its tokens carry that version's number.
Names never repeat, so a cache keyed by an adapter's name (vLLM keys its prefix cache's blocks by the
adapter's name and path) never gives one version's blocks to another.

`HeldAdapters` keeps this bookkeeping; the engine says how a version is loaded and unloaded, and
`FolderAdapterEngine` answers the Engine contract's adapter calls from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from polar import lora
from polar.inference.engines.base import (
    AdapterExists,
    AdapterInfo,
    AdapterLoad,
    AdaptersFull,
    AdaptersUnsupported,
    Engine,
    EngineOptions,
    ParameterSpec,
    UnknownAdapter,
    check_weight_update,
    default_adapter,
)


@dataclass(frozen=True)
class ServedVersion:
    """One version of an adapter as the serving engine knows it."""

    name: str  # unique among every version this process loads (vLLM's lora_name)
    lora_id: int  # unique, from 1 (vLLM's lora_int_id)
    folder: Path  # its PEFT folder


@dataclass(eq=False)
class _Version:
    served: ServedVersion
    version: int  # the policy version its tokens carry
    leases: set[Lease] = field(default_factory=set)
    current: bool = True  # False once a newer version replaced it or its adapter was unloaded


@dataclass(eq=False)
class Lease:
    """A generation's hold on the version of the adapter it samples with, from its start to its end."""

    adapter: str
    of: _Version
    # Set by the engine: ends the generation now (it then ends with `ended` as its error).
    stop: Callable[[], object] | None = None
    ended: str = ""  # why the generation was ended from outside ("" = it was not)

    @property
    def served(self) -> ServedVersion:
        return self.of.served

    @property
    def version(self) -> int:
        return self.of.version


@dataclass(eq=False)
class _Adapter:
    settings: lora.LoraSettings
    tensors: dict[str, torch.Tensor]  # the current version's matrices, fp32 on the CPU
    current: _Version
    draining: list[_Version] = field(default_factory=list)  # older versions still generating


def linear_modules(model_folder: Path, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(in, out) features of every linear layer of the model that `targets` adapt, by module name,
    read from a copy of the model on the meta device (no weights); LoraError for a target that
    matches no linear layer, as `lora.attach` says it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_folder))
    modules, matched = {}, set()
    for name, module in model.named_modules():
        target = lora.target_of(name, targets)
        if target is not None and isinstance(module, nn.Linear):
            modules[name] = (module.in_features, module.out_features)
            matched.add(target)
    missing = [t for t in targets if t not in matched]
    if missing:
        raise lora.LoraError(f"lora_targets {', '.join(missing)} match no linear layer of the model")
    return modules


class HeldAdapters:
    """The adapters a server holds: the default one ("") and up to `max_adapters` named ones, each
    served from the folder of its current version (see the module docstring)."""

    def __init__(
        self,
        model_folder: Path,
        options: EngineOptions,
        dtype: torch.dtype,
        load: Callable[[ServedVersion], Awaitable[None]],
        unload: Callable[[ServedVersion], Awaitable[None]],
    ) -> None:
        """`load` makes the engine serve a version's folder under its name (raising LoraError when it
        cannot); `unload` lets it go. `options` must name an adapter (default_adapter)."""
        default = default_adapter(options)
        if default is None:
            raise lora.LoraError("serving LoRA adapters needs adapter or lora_rank")
        self.settings = default.settings  # the largest rank and the targets every adapter fits in
        self.max_adapters = options.max_adapters
        self._model_folder = model_folder
        self._dtype = dtype
        self._modules = linear_modules(model_folder, self.settings.targets)
        self._default = (default, options.policy_version)
        self._load, self._unload = load, unload
        self._token = secrets.token_hex(4)  # names stay unique across servers sharing an upstream
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # loads, pushes and unloads one at a time
        self._adapters: dict[str, _Adapter] = {}
        self._root: Path | None = None

    async def start(self, root: Path) -> None:
        """Write and load the default adapter; every version's folder goes under `root`."""
        self._root = root
        saved, version = self._default
        tensors = self._complete(saved)
        async with self._lock:
            self._adapters[""] = _Adapter(
                saved.settings, tensors, await self._new_version(saved.settings, tensors, version)
            )

    async def close(self) -> None:
        """Unload every version and remove its folder (the serving engine may be gone already)."""
        async with self._lock:
            versions = [v for a in self._adapters.values() for v in (a.current, *a.draining)]
            self._adapters = {}
            for version in versions:
                # An engine that stopped, or an upstream that went away, holds nothing to unload.
                with contextlib.suppress(Exception):
                    await self._unload(version.served)
                shutil.rmtree(version.served.folder, ignore_errors=True)

    # -- what the Engine contract asks -----------------------------------------------------------

    def _held(self, adapter: str) -> _Adapter:
        held = self._adapters.get(adapter)
        if held is None:
            names = ", ".join(repr(n) for n in self._adapters if n) or "none"
            raise UnknownAdapter(f"this server holds no LoRA adapter {adapter!r} (it holds {names})")
        return held

    def version(self, adapter: str) -> int:
        return self._held(adapter).current.version

    def specs(self, adapter: str) -> dict[str, ParameterSpec]:
        return {
            name: ParameterSpec(shape, self._dtype)
            for name, shape in self._shapes(self._held(adapter).settings).items()
        }

    def infos(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(name, a.settings.rank, a.settings.alpha, a.settings.targets, a.current.version)
            for name, a in self._adapters.items()
        ]

    def begin(self, adapter: str) -> Lease:
        """Hold the current version of `adapter` for a generation; UnknownAdapter if it is not held."""
        current = self._held(adapter).current
        lease = Lease(adapter, current)
        current.leases.add(lease)
        return lease

    async def end(self, lease: Lease) -> None:
        """The generation is over (the serving engine runs it no more): let go of its version."""
        lease.of.leases.discard(lease)
        if not lease.of.current and not lease.of.leases:
            async with self._lock:
                await self._retire(lease.adapter, lease.of)

    async def push(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> int:
        """Serve `tensors` over the adapter's matrices as its next version; the new version number."""
        check_weight_update(tensors, self.specs(adapter))
        async with self._lock:
            held = self._held(adapter)  # it may have been unloaded while this waited
            merged = dict(held.tensors)
            for name, tensor in tensors.items():
                # A copy: the server stages the next update in the tensors it passed here.
                merged[name] = tensor.detach().to("cpu", torch.float32, copy=True)
            version = await self._new_version(held.settings, merged, held.current.version + 1)
            old = held.current
            held.current, held.tensors = version, merged
            await self._supersede(adapter, held, old)
            return version.version

    async def load(self, load: AdapterLoad) -> AdapterInfo:
        if not self.max_adapters:
            raise AdaptersUnsupported("this server holds no named LoRA adapters (start it with max_adapters)")
        if load.path:
            saved = await asyncio.to_thread(lora.read_adapter, load.path)
        else:
            targets = load.targets or ",".join(self.settings.targets)
            saved = lora.AdapterFolder(lora.LoraSettings.parse(load.rank, load.alpha, targets), "", {})
        problem = self._fits(saved.settings)
        if problem:
            raise lora.LoraError(f"adapter {load.name!r} does not fit this server: {problem}")
        tensors = self._complete(saved)
        async with self._lock:
            held = self._adapters.get(load.name)
            if held is not None and not load.replace:
                raise AdapterExists(
                    f"this server holds an adapter {load.name!r} already (another run of that name, or this one "
                    "not unloaded: give the run another name, or replace it)"
                )
            if held is None and len(self._adapters) - 1 >= self.max_adapters:
                raise AdaptersFull(
                    f"this server holds {self.max_adapters} named adapters already (max_adapters): "
                    "unload one, or start it with a larger max_adapters"
                )
            version = await self._new_version(saved.settings, tensors, load.policy_version)
            self._adapters[load.name] = _Adapter(saved.settings, tensors, version)
            if held is not None:
                self._end_generations(load.name, held, "was replaced")
                for old in (held.current, *held.draining):
                    old.current = False
                    await self._retire(load.name, old, held)
            return next(info for info in self.infos() if info.name == load.name)

    async def unload(self, name: str) -> int:
        """Unload a named adapter; the number of its generations this ended."""
        if not name:
            raise UnknownAdapter("the default adapter cannot be unloaded; name an adapter LoadAdapter loaded")
        async with self._lock:
            held = self._held(name)
            del self._adapters[name]
            ended = self._end_generations(name, held, "was unloaded")
            for version in (held.current, *held.draining):
                version.current = False
                await self._retire(name, version, held)
            return ended

    # -- versions --------------------------------------------------------------------------------

    def _shapes(self, settings: lora.LoraSettings) -> dict[str, tuple[int, ...]]:
        """The matrices of an adapter of `settings`, PEFT's names and shapes (A [r, in], B [out, r])."""
        shapes = {}
        for module, (fan_in, fan_out) in self._modules.items():
            if lora.target_of(module, settings.targets):
                shapes[f"{module}.lora_A.weight"] = (settings.rank, fan_in)
                shapes[f"{module}.lora_B.weight"] = (fan_out, settings.rank)
        return shapes

    def _fits(self, settings: lora.LoraSettings) -> str:
        """Why an adapter of `settings` cannot be held here; "" when it can."""
        if settings.rank > self.settings.rank:
            return f"its rank {settings.rank} is above the server's lora_rank {self.settings.rank}"
        outside = [t for t in settings.targets if t not in self.settings.targets]
        if outside:
            served = ",".join(self.settings.targets)
            return f"it adapts {', '.join(outside)}, which the server's lora_targets ({served}) leave out"
        return ""

    def _complete(self, saved: lora.AdapterFolder) -> dict[str, torch.Tensor]:
        """Every matrix of the adapter, fp32: the folder's (exactly the adapter's, each of its shape),
        or zero for an adapter given by its shape alone."""
        shapes = self._shapes(saved.settings)
        if not saved.tensors:
            return {name: torch.zeros(shape) for name, shape in shapes.items()}
        for name, tensor in saved.tensors.items():
            if name not in shapes:
                raise lora.LoraError(f"the adapter holds {name!r}, which its targets do not adapt on this model")
            if tuple(tensor.shape) != shapes[name]:
                raise lora.LoraError(
                    f"adapter matrix {name} has shape {list(tensor.shape)}, this model's is {list(shapes[name])}"
                )
        missing = sorted(set(shapes) - set(saved.tensors))
        if missing:
            raise lora.LoraError(f"the adapter lacks {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
        return {name: saved.tensors[name].to(torch.float32) for name in shapes}

    async def _new_version(
        self, settings: lora.LoraSettings, tensors: dict[str, torch.Tensor], version: int
    ) -> _Version:
        """The adapter written as a new folder and loaded under a new name."""
        lora_id = next(self._ids)
        name = f"polar-{self._token}-{lora_id}"
        served = ServedVersion(name, lora_id, self._root / name)
        await asyncio.to_thread(
            lora.save_adapter_tensors, served.folder, tensors.items(), settings, str(self._model_folder)
        )
        try:
            await self._load(served)
        except BaseException:
            shutil.rmtree(served.folder, ignore_errors=True)
            raise
        return _Version(served, version)

    async def _supersede(self, name: str, held: _Adapter, old: _Version) -> None:
        old.current = False
        held.draining.append(old)
        await self._retire(name, old, held)

    async def _retire(self, name: str, version: _Version, held: _Adapter | None = None) -> None:
        """Unload a version no generation runs on any more, and remove its folder (called locked)."""
        if version.leases or version.current:
            return
        held = held or self._adapters.get(name)
        if held is not None and version in held.draining:
            held.draining.remove(version)
        if not version.served.folder.exists():
            return  # retired already
        await self._unload(version.served)
        shutil.rmtree(version.served.folder, ignore_errors=True)

    @staticmethod
    def _end_generations(name: str, held: _Adapter, why: str) -> int:
        """Stop the generations of every version of `held`; how many there were."""
        leases = [lease for version in (held.current, *held.draining) for lease in version.leases]
        for lease in leases:
            lease.ended = f"LoRA adapter {name!r} {why} while this generation ran"
            if lease.stop is not None:
                lease.stop()
        return len(leases)


class FolderAdapterEngine(Engine):
    """An engine whose adapters are `HeldAdapters` (`_held`; None when it serves none): the Engine
    contract's adapter calls answered from them."""

    _held: HeldAdapters | None = None

    def adapters(self) -> list[AdapterInfo]:
        return self._held.infos() if self._held is not None else []

    def adapter_version(self, adapter: str) -> int:
        if self._held is None:
            return super().adapter_version(adapter)
        return self._held.version(adapter)

    def adapter_specs(self, adapter: str) -> Mapping[str, ParameterSpec]:
        if self._held is None:
            return super().adapter_specs(adapter)
        return self._held.specs(adapter)

    async def apply_adapter(self, adapter: str, tensors: dict[str, torch.Tensor]) -> int:
        if self._held is None:
            return await super().apply_adapter(adapter, tensors)
        return await self._held.push(adapter, tensors)

    async def load_adapter(self, load: AdapterLoad) -> AdapterInfo:
        if self._held is None or not self._held.max_adapters:
            return await super().load_adapter(load)
        return await self._held.load(load)

    async def unload_adapter(self, name: str) -> int:
        if self._held is None:
            return await super().unload_adapter(name)
        return await self._held.unload(name)
