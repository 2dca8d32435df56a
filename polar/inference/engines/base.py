"""The contract between the inference servicer and an engine.

An engine turns prompt token ids into sampled token ids with log-probabilities. The servicer
(polar/inference/server.py) owns everything protocol-shaped: validation, pause/resume, chunk
assembly of weight updates, gRPC codes. An engine owns the model and the batching.

Records here mirror the protobuf messages of protos/polar/v1/inference.proto, without depending on
the generated classes, so engines stay testable on their own.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import torch

from polar import lora
from polar.config import DEFAULT_LORA_TARGETS
from polar.inference.constraints import OutputConstraint
from polar.lora import is_adapter_name


class FinishReason(enum.Enum):
    """Why a generation ended; values match polar.v1.FinishReason."""

    STOP = 1  # a stop token (EOS or one of stop_token_ids) was sampled; it is the last token
    LENGTH = 2  # max_tokens were sampled
    CONTEXT_LENGTH = 3  # prompt + sampled tokens filled the context window
    ABORTED = 4  # the caller went away
    ERROR = 5  # the engine failed


@dataclass(frozen=True)
class SamplingConfig:
    """Validated sampling parameters (see SamplingParams in common.proto for the meaning of each)."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = no nucleus truncation
    top_k: int = 0  # 0 = no top-k truncation
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # None = a fresh random seed
    ignore_eos: bool = False
    constraint: OutputConstraint | None = None  # None = unconstrained (polar/inference/constraints.py)


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation: prompt ids are in range and prompt + max_tokens fits the context."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig
    adapter: str = ""  # the LoRA adapter to sample with: a loaded name, or "" for the default weights


@dataclass(frozen=True)
class TokenChunk:
    """Tokens sampled by one policy version, in order, each with its logprob (see Generate in
    inference.proto for the exact distribution)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int


@dataclass(frozen=True)
class GenerationEnd:
    """The last item of every generation stream."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float  # from submission until the first decode step
    error: str = ""  # set with FinishReason.ERROR
    cached_prompt_tokens: int = 0  # prompt tokens taken from the engine's prefix cache, not computed


@dataclass(frozen=True)
class ModelDescription:
    """What GetModelInfo reports, minus the live fields (policy version, paused)."""

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context_length: int
    engine: str
    end_of_turn_token_id: int = -1
    bos_token_id: int = -1
    chat_template: str = ""
    dtype: str = ""
    device: str = ""
    parameter_count: int = 0
    tokenizer_path: str = ""
    constrained_decoding: bool = False  # the engine applies SamplingConfig.constraint


@dataclass(frozen=True)
class ParameterSpec:
    """Shape and dtype a weight update must match for one named parameter."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter an engine holds (AdapterInfo in inference.proto)."""

    name: str  # "" = the default adapter
    rank: int
    alpha: float
    targets: tuple[str, ...]
    policy_version: int


@dataclass(frozen=True)
class AdapterLoad:
    """A validated LoadAdapter request: a PEFT folder, or a zero adapter of rank, alpha and targets."""

    name: str
    path: str = ""
    rank: int = 0
    alpha: float = 0.0
    targets: str = ""  # comma-separated; "" = the server's
    policy_version: int = 0
    replace: bool = False


class UnknownAdapter(LookupError):
    """A Generate call or weight update naming an adapter the engine does not hold (NOT_FOUND)."""


class AdaptersUnsupported(RuntimeError):
    """LoadAdapter to an engine that holds no named adapters (FAILED_PRECONDITION)."""


class AdapterExists(RuntimeError):
    """LoadAdapter of a name held, without replace (ALREADY_EXISTS)."""


class AdaptersFull(RuntimeError):
    """LoadAdapter while max_adapters adapters are held (RESOURCE_EXHAUSTED)."""


class WeightsFixed(RuntimeError):
    """The engine's weights cannot be updated at all (Engine.fixed_weights says why)."""


class WeightUpdateError(ValueError):
    """A weight update that names unknown parameters or has the wrong shapes; nothing was applied."""


def unknown_parameter(name: str, specs: Mapping[str, ParameterSpec]) -> str:
    """Why `name` is no parameter of an update to `specs`, saying so when one side is a LoRA adapter
    and the other is not (a trainer and a server set up differently)."""
    serves_adapter = any(is_adapter_name(n) for n in specs)
    if is_adapter_name(name) and not serves_adapter:
        return f"unknown parameter {name!r}: the trainer sends a LoRA adapter, and this server serves none (lora_rank)"
    if serves_adapter and not is_adapter_name(name):
        return f"unknown parameter {name!r}: this server serves a LoRA adapter and takes updates of its matrices alone"
    return f"unknown parameter {name!r}"


def check_weight_update(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ParameterSpec]) -> None:
    """Raise WeightUpdateError unless the update is not empty and each tensor names one of `specs`, with
    its shape, in a floating-point dtype (cast to the engine's dtype when applied). Engines call it
    before changing anything, so a refused update leaves the weights as they were."""
    if not tensors:
        raise WeightUpdateError("a weight update needs at least one tensor")
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        spec = specs.get(name)
        if spec is None:
            raise WeightUpdateError(f"{unknown_parameter(name, specs)} (tensor of shape {shape})")
        if shape != spec.shape:
            raise WeightUpdateError(f"parameter {name!r} has shape {spec.shape}, the update has shape {shape}")
        if not tensor.dtype.is_floating_point:
            raise WeightUpdateError(f"parameter {name!r}: update dtype {tensor.dtype} is not floating point")


class Engine(abc.ABC):
    """A model that samples. Implementations: torch, vllm, scripted, upstream."""

    description: ModelDescription
    # Why UpdateWeights can never apply to this engine (it serves weights another server holds);
    # "" = updates apply. The servicer refuses such updates with FAILED_PRECONDITION.
    fixed_weights: str = ""

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights in use: 0 as loaded, +1 per applied update."""

    async def start(self) -> None:
        """Acquire resources (threads, devices). Called once before the first generate."""

    async def stop(self) -> None:
        """Release resources; generations still running end with FinishReason.ABORTED."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        """Stream TokenChunks as they are sampled, then exactly one GenerationEnd.

        Requests running at the same time are batched. Closing the iterator early (aclose, or the
        consuming task being cancelled) frees the request's slot at once.
        """

    @abc.abstractmethod
    def parameter_specs(self) -> Mapping[str, ParameterSpec]:
        """Every parameter a weight update may replace, by state-dict name."""

    @abc.abstractmethod
    async def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Replace the named parameters at once, between two decode steps; return the new version.

        Raises WeightUpdateError (and changes nothing) for unknown names or wrong shapes.
        """

    async def apply_staged(self, tensors: dict[str, torch.Tensor]) -> int:
        """Apply an update the server staged (each tensor in its parameter's shape and dtype), as
        update_weights does; return the new version. An engine may take a staged tensor's memory
        as its parameter's instead of copying it; it then puts the memory that tensor replaced
        into `tensors` under the same name, for the server to stage the next update in."""
        return await self.update_weights(tensors)

    # Named LoRA adapters (inference.proto's LoadAdapter): an engine that holds none keeps these.
    max_adapters: int = 0

    def adapters(self) -> list[AdapterInfo]:
        """The adapters held: the default one first when there is one, then the named ones."""
        return []

    def adapter_version(self, adapter: str) -> int:
        """The policy version of `adapter` ("" = the default weights); UnknownAdapter if not held."""
        if adapter:
            raise UnknownAdapter(f"this server holds no LoRA adapter {adapter!r} (it serves none by name)")
        return self.policy_version

    def adapter_specs(self, adapter: str) -> Mapping[str, ParameterSpec]:
        """What an update of the named `adapter` may replace; UnknownAdapter if not held."""
        self.adapter_version(adapter)
        return self.parameter_specs()

    async def apply_adapter(self, adapter: str, tensors: dict[str, torch.Tensor]) -> int:
        """apply_staged for the named `adapter`: its matrices alone; its new version."""
        self.adapter_version(adapter)
        return await self.apply_staged(tensors)

    async def load_adapter(self, load: AdapterLoad) -> AdapterInfo:
        raise AdaptersUnsupported(
            f"the {self.description.engine} engine holds no named LoRA adapters (a torch, vllm or upstream engine "
            "started with lora_rank and max_adapters does)"
        )

    async def unload_adapter(self, name: str) -> int:
        """Remove the named adapter; the number of its generations this ended."""
        raise UnknownAdapter(f"this server holds no LoRA adapter {name!r}")


@dataclass
class EngineOptions:
    """How to build an engine; fields that do not apply to an engine kind are ignored by it."""

    model: str = "tiny"  # "tiny", "smollm2-135m" or a Hugging Face model folder
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    dtype: str = "auto"  # "auto": float32 on cpu, bfloat16 on cuda
    max_batch_size: int = 64  # most sequences decoded in one step
    # torch engine: MiB of keys and values of computed token blocks kept for later calls that start
    # with the same tokens (polar/inference/engines/prefix_cache.py); 0 = no prefix cache
    prefix_cache_mib: int = 4096
    script: str = ""  # scripted engine: path of its JSON script
    # Version the loaded weights are served as: a trainer checkpoint's, so that versions keep counting
    # across a resumed run instead of starting again at 0.
    policy_version: int = 0
    # torch engine: a LoRA adapter served on top of the model (polar/lora.py): a PEFT adapter folder,
    # or with lora_rank > 0 a zero adapter of that shape (the model as it is until a push sets it)
    adapter: str = ""
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: str = DEFAULT_LORA_TARGETS
    # torch engine, with lora_rank: room for this many named adapters (LoadAdapter) beside the default
    # one, each of rank <= lora_rank on lora_targets, so that several runs share the server; 0 = none
    max_adapters: int = 0
    # torch engine on a GPU: give the keys' and values' memory back to the driver whenever no sequence
    # runs, so that a trainer on the same GPU steps in it; otherwise it is kept for the next calls
    release_idle_memory: bool = False
    extra: dict[str, str] = field(default_factory=dict)  # engine-specific settings


def default_adapter(options: EngineOptions) -> lora.AdapterFolder | None:
    """The adapter a server starts with: its folder's, or a zero one of the lora_ settings; None
    without either. max_adapters needs the lora_ settings: they are the shape every adapter fits in."""
    if options.adapter:
        return lora.read_adapter(options.adapter)
    if options.lora_rank:
        settings = lora.LoraSettings.parse(options.lora_rank, options.lora_alpha, options.lora_targets)
        return lora.AdapterFolder(settings, "", {})
    if options.max_adapters:
        raise lora.LoraError("max_adapters needs lora_rank: the largest rank an adapter on this server may have")
    return None
