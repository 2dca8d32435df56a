"""The megatron backend: a Megatron-Core GPT model over the ranks of a torchrun job, tensor parallel
within groups of `tp_size` ranks and data parallel across those groups.

Rank 0 talks to the training loop and announces each call to the other ranks, which follow in
lockstep. How replicas, the optimizer, logprobs and the gradient norm work: docs/design/megatron.md.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from polar import lora
from polar.config import DEFAULT_LORA_TARGETS
from trainer.backends.base import (
    Backend,
    BackendError,
    UpdateAborted,
    UpdateResult,
    activation_bytes,
    device_memory,
    recompute_activations,
    shared_options,
)
from trainer.backends.megatron import lora as megatron_lora
from trainer.backends.megatron.convert import (
    hf_names,
    hf_to_megatron,
    layer_of,
    megatron_names,
    megatron_to_hf,
    replicated,
)
from trainer.backends.megatron.logprobs import (
    check_untruncated,
    vocab_parallel_logprobs,
)
from trainer.backends.megatron.lora import AdapterMatrix
from trainer.backends.megatron.model import (
    ModelShape,
    UnsupportedModel,
    build_model,
    selected_logits,
)
from trainer.backends.megatron.runtime import (
    MegatronUnavailable,
    cuda_names_on_cpu,
    init_parallel,
    tp_group,
)
from trainer.batches import MicroBatch
from trainer.bf16_adamw import StochasticRoundingAdamW
from trainer.grpo import LossConfig, LossStats, constrained_logits

if TYPE_CHECKING:
    from polar.config import TrainerConfig

SHARD_BYTES = 2 * 1024**3  # safetensors files a saved model is split into


@dataclass(frozen=True)
class MegatronBackendOptions:
    """How to build the megatron backend (the [trainer] settings it reads)."""

    model: str  # "tiny", "smollm2-135m" or a Hugging Face folder (the same path on every node)
    tp_size: int = 0  # ranks per tensor-parallel group; 0 = every rank of the job (no data parallelism)
    dtype: str = "auto"  # "auto": bf16 on a GPU, fp32 on a CPU
    lr: float = 1e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # "none", "selective" (core attention) or "full" (whole layers), CUDA only; "auto": "full" on CUDA
    # when a micro-batch's activations would not fit comfortably (base.recompute_activations), else none
    recompute: str = "auto"
    fused_swiglu: bool = False  # SwiGLU through torch.compile (CUDA only; needs Triton and a C compiler)
    fused_rope: bool = False  # RoPE through torch.compile (CUDA only; likewise)
    reference_model: bool = False  # keep a frozen copy of the starting weights (for the KL term)
    seed: int = 0
    cpu_threads: int = 0  # 0 = torch's default
    max_tokens_per_microbatch: int = 0  # 0 = the model's context length
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank on lora_targets (megatron/lora.py); 0 = every weight
    lora_alpha: float = 32.0
    lora_targets: str = DEFAULT_LORA_TARGETS  # comma-separated module names
    adapter: str = ""  # a PEFT adapter folder to start from (a checkpoint's); its settings replace the three above


def options_from_config(config: TrainerConfig, model: str) -> MegatronBackendOptions:
    """The backend's options from the [trainer] section: the same on every rank;
    gradient_checkpointing recomputes whole layers; SwiGLU and RoPE are compiled on a GPU. With LoRA,
    `model` may be an adapter folder (a checkpoint's) over the [trainer] model."""
    from polar.lora import is_adapter_folder

    cuda = torch.cuda.is_available()
    adapter = model if config.lora_rank and is_adapter_folder(model) else ""
    return MegatronBackendOptions(
        model=config.model if adapter else model,
        adapter=adapter,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_targets=config.lora_targets,
        tp_size=config.tensor_parallel,
        recompute={"on": "full", "off": "none", "auto": "auto"}[config.gradient_checkpointing],
        fused_swiglu=cuda,
        fused_rope=cuda,
        **shared_options(config),
    )


def release_followers() -> None:
    """On rank 0: end the other ranks' `follow()` loops (the run is over, or failed before any call)."""
    if dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() > 1:
        dist.broadcast_object_list([("close", ())], src=0)


def leave_job() -> None:
    """This rank is done with the job: its process group goes before the process does, or the
    group's threads, still alive at exit, can abort it (SIGABRT, "terminate called without an active
    exception", seen on gloo)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class HFWeights:
    """What `hf_weights` returns: the model's HF tensors, iterated once (each layer gathered from the
    ranks as the iteration reaches it), and sized, so weight sync can send the tensor count before any
    tensor exists."""

    def __init__(self, backend: MegatronBackend) -> None:
        self._backend = backend

    def __len__(self) -> int:
        backend = self._backend
        return len(backend.adapters) if backend.lora is not None else len(hf_names(backend.shape))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        backend = self._backend
        backend._announce("hf_weights")
        if backend.lora is None:
            yield from backend._hf_weights()
            return
        # The fp32 adapters go to the inference servers in the compute dtype, as the torch backend's do.
        for name, tensor in backend._hf_weights():
            yield name, tensor.to(backend.dtype)


class MegatronBackend(Backend):
    name = "megatron"

    def __init__(self, options: MegatronBackendOptions) -> None:
        """Load `options.model` onto every rank (each rank of the job constructs one)."""
        from transformers import AutoConfig, AutoTokenizer

        from polar.inference.models import ModelNotFoundError, resolve_model

        if options.cpu_threads > 0:
            torch.set_num_threads(options.cpu_threads)
        try:
            self.parallel = init_parallel(options.tp_size)
        except (ValueError, MegatronUnavailable) as exc:
            raise BackendError(str(exc)) from None
        torch.manual_seed(options.seed)
        self.options = options
        self.device = self.parallel.device
        dtypes = {
            "auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
        }
        if options.dtype not in dtypes:
            raise BackendError(f"dtype must be one of {', '.join(dtypes)}, got {options.dtype!r}")
        self.dtype = dtypes[options.dtype]
        if options.recompute not in ("none", "auto") and self.device.type != "cuda":
            raise BackendError("recomputation needs CUDA: Megatron's checkpointing saves and restores CUDA's RNG state")
        for name in ("fused_swiglu", "fused_rope"):
            if getattr(options, name) and self.device.type != "cuda":
                raise BackendError(f"{name} needs CUDA")
        # Rank 0's choice (a checkpoint of the run, say) is every rank's.
        choice = [options.model, options.adapter]
        if self.parallel.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        adapter = choice[1]
        try:
            self.folder = resolve_model(choice[0])
        except ModelNotFoundError as exc:
            raise BackendError(str(exc)) from None
        self.hf_config = AutoConfig.from_pretrained(self.folder)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder) if self.parallel.is_leader else None
        try:
            self.shape = ModelShape.from_hf_config(self.hf_config)
            self.microbatch_tokens = options.max_tokens_per_microbatch or self.shape.max_position_embeddings
            self.model = self._build()
        except UnsupportedModel as exc:
            raise BackendError(f"cannot build {options.model!r} with Megatron: {exc}") from None
        self.parameters = dict(self.model.named_parameters())  # the base model's
        self._load_hf_folder(self.folder)
        self.lora, self.adapters = self._attach_adapters(options, adapter)
        self.trained = {  # what the optimizer updates: the adapters with LoRA, else every parameter
            name: parameter for name, parameter in self.model.named_parameters() if parameter.requires_grad
        }
        self.model.train()
        self.reference = None
        if options.reference_model and self.lora is None:
            self.reference = self._build()
            self.reference.load_state_dict(self.model.state_dict())
            self.reference.eval().requires_grad_(False)
        cuda = self.device.type == "cuda"
        self.replicated = None  # Megatron's DistributedDataParallel wrapper, with several replicas
        self._reducing = False  # this update's reduce-scatter has started (this rank's last backward ran)
        if self.parallel.dp_size > 1:
            self.replicated, self.optimizer = self._distributed_optimizer()
        elif self.dtype == torch.bfloat16 and self.lora is None:  # adapters are fp32
            self.optimizer = StochasticRoundingAdamW(
                self.trained.values(),
                lr=options.lr,
                betas=(options.adam_beta1, options.adam_beta2),
                weight_decay=options.weight_decay,
            )
        else:
            self.optimizer = torch.optim.AdamW(
                self.trained.values(),
                lr=options.lr,
                betas=(options.adam_beta1, options.adam_beta2),
                weight_decay=options.weight_decay,
                # One kernel for the whole step on a GPU; the CPU has no fused AdamW.
                fused=cuda or None,
                foreach=None if cuda else True,
            )
        padded = self.shape.padded_vocab_size(self.parallel.tp_size)
        self.vocab_start = self.parallel.tp_rank * padded // self.parallel.tp_size

    def _attach_adapters(
        self, options: MegatronBackendOptions, adapter: str
    ) -> tuple[lora.LoraSettings | None, dict[str, AdapterMatrix]]:
        """With LoRA: the base frozen, the adapters attached (loaded from `adapter`, else new), their
        settings and matrices (by Megatron name). Without: (None, {})."""
        if not options.lora_rank and not adapter:
            return None, {}
        tp_rank, tp_size = self.parallel.tp_rank, self.parallel.tp_size
        try:
            saved = lora.read_adapter(adapter) if adapter else None
            settings = (
                saved.settings
                if saved
                else lora.LoraSettings.parse(options.lora_rank, options.lora_alpha, options.lora_targets)
            )
            self.model.requires_grad_(False)
            matrices = megatron_lora.attach(self.model, self.shape, settings, tp_size)
            tensors = saved.tensors if saved else megatron_lora.initial_adapters(matrices, options.seed)
            megatron_lora.load_shards(dict(self.model.named_parameters()), matrices, tensors, tp_rank, tp_size)
        except lora.LoraError as exc:
            raise BackendError(str(exc)) from None
        return settings, {matrix.megatron: matrix for matrix in matrices}

    def _distributed_optimizer(self):
        """The loaded model in Megatron's DistributedDataParallel, and a DistributedOptimizer over it
        (AdamW as in the torch backend: weight decay on every parameter, eps 1e-8)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        options = self.options
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False,  # gradients accumulate in the model's dtype, as with one replica
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
        )
        # The wrapper copies the (loaded) weights into its contiguous buffer and keeps the same
        # Parameter objects, so self.parameters stays valid; the optimizer's fp32 main weights are
        # taken from the loaded values.
        replicated = DistributedDataParallel(self.model.config, ddp_config, self.model)
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=options.lr,
            weight_decay=options.weight_decay,
            adam_beta1=options.adam_beta1,
            adam_beta2=options.adam_beta2,
            adam_eps=1e-8,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=True,
            clip_grad=0.0,  # _clip_gradients clips, with the norm it reports
        )
        with cuda_names_on_cpu():
            chained = get_megatron_optimizer(optimizer_config, [replicated], config_overrides={})
        # A chain of one (dense parameters only: no experts).
        (optimizer,) = chained.chained_optimizers
        return replicated, optimizer

    def recomputes(self, tokens: int) -> bool:
        if self.options.recompute != "auto":
            return self.options.recompute == "full"
        if self.device.type != "cuda":
            return False  # only CUDA can recompute (see __init__)
        shape = self.shape
        # Tensor parallelism splits the MLP's and the attention's activations over the group's ranks.
        per_token = activation_bytes(
            tokens=1,
            layers=shape.num_layers,
            hidden=shape.hidden_size,
            intermediate=shape.ffn_hidden_size,
            element_bytes=self.dtype.itemsize,
        )
        return recompute_activations(
            "auto", activations=tokens * per_token // self.parallel.tp_size, device_memory=device_memory(self.device)
        )

    def _set_recompute(self, tokens: int) -> None:
        """With recompute "auto", the model is built to recompute whole layers, and Megatron's
        TransformerBlock reads `recompute_granularity` at every forward: each micro-batch sets it."""
        if self.options.recompute == "auto" and self.device.type == "cuda":
            self.model.config.recompute_granularity = "full" if self.recomputes(tokens) else None

    def _build(self):
        options = self.options
        recompute = options.recompute
        if recompute == "auto":
            recompute = "full" if self.device.type == "cuda" else "none"
        return build_model(
            self.shape,
            self.parallel.tp_size,
            self.dtype,
            self.device,
            recompute,
            options.fused_swiglu,
            options.fused_rope,
        )

    @property
    def model_description(self) -> dict[str, object]:
        return {
            "model_type": self.shape.model_type,
            "vocab_size": self.shape.vocab_size,
            "hidden_size": self.shape.hidden_size,
            "num_hidden_layers": self.shape.num_layers,
            "lora_rank": self.lora.rank if self.lora else 0,
        }

    # -- loading --------------------------------------------------------------------------------------

    def _load_hf_folder(self, folder: Path) -> None:
        """Every rank reads the tensors of its shard from the safetensors files, a layer at a time."""
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            where = {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", framework="pt") as handle:
                where = dict.fromkeys(handle.keys(), folder / "model.safetensors")
        else:
            raise BackendError(f"{folder} has no safetensors weights (model.safetensors or its index)")
        loaded = set()
        names = sorted(where, key=lambda name: (layer_of(name) is not None, layer_of(name) or 0))
        for _, group in groupby(names, key=layer_of):
            tensors = {}
            for name in group:
                with safe_open(where[name], framework="pt") as handle:
                    tensors[name] = handle.get_tensor(name)
            try:
                converted = hf_to_megatron(tensors, self.shape, self.parallel.tp_rank, self.parallel.tp_size)
            except KeyError as exc:
                raise BackendError(f"{folder}: {exc.args[0]}") from None
            with torch.no_grad():
                for name, value in converted.items():
                    parameter = self.parameters[name]
                    if parameter.shape != value.shape:
                        raise BackendError(
                            f"{folder}: {name} is {tuple(value.shape)} on this rank, the model "
                            f"expects {tuple(parameter.shape)}"
                        )
                    parameter.copy_(value)
            loaded.update(converted)
        missing = set(self.parameters) - loaded
        if missing:
            raise BackendError(
                f"{folder} lacks the weights of {', '.join(sorted(missing)[:3])} ({len(missing)} in all)"
            )

    # -- the leader's announcements and the followers' loop -------------------------------------------

    def _announce(self, command: str, *args) -> None:
        if self.parallel.world_size > 1:
            dist.broadcast_object_list([(command, args)], src=0)

    def _agree(self, flag: bool) -> bool:
        """Rank 0's flag, on every rank."""
        if self.parallel.world_size == 1:
            return flag
        value = torch.tensor([flag], dtype=torch.int32, device=self.device)
        dist.broadcast(value, src=0)
        return bool(value.item())

    def follow(self) -> None:
        """On every rank but 0: run what rank 0 announces until it calls `close`."""
        if self.parallel.is_leader:
            raise RuntimeError("rank 0 leads; only the other ranks follow")

        def send_weights() -> None:
            for _ in self._hf_weights():  # the gathers happen as rank 0 iterates; nothing comes here
                pass

        handlers = {
            "logprobs": self._logprobs,
            "update": self._update,
            "hf_weights": send_weights,
            "save": lambda: self._save(None, None),
            "load_optimizer": lambda: self._load_optimizer(None),
        }
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            command, args = box[0]
            if command == "close":
                leave_job()
                return
            try:
                handlers[command](*args)
            except UpdateAborted:
                pass

    def close(self) -> None:
        """Release the followers (rank 0, once the run is over)."""
        release_followers()

    # -- scoring and learning ---------------------------------------------------------------------

    def _check(self, batches: Sequence[MicroBatch]) -> None:
        for batch in batches:
            mask = batch.loss_mask
            check_untruncated(self.shape.vocab_size, batch.temperature[mask], batch.top_k[mask], batch.top_p[mask])

    def _target_logprobs(self, model, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [K] of the trainable targets, their flat indices [K] into [R * L])."""
        batch = batch.to(self.device)
        if model is self.model:
            self._set_recompute(batch.input_ids.numel() if torch.is_grad_enabled() else 0)
        keep = batch.loss_mask.reshape(-1).nonzero().squeeze(-1)  # [K]
        parents = [batch.row_parents(row) for row in range(len(batch.sequence_lengths))]
        logits = selected_logits(
            model, batch.input_ids, batch.position_ids, batch.sequence_lengths, parents, keep
        )  # [K, V/tp]
        if batch.constraint_index is not None:  # each rank masks its own vocabulary slice
            logits = constrained_logits(
                logits, keep, batch.constraint_index, batch.constraint_allowed, vocab_start=self.vocab_start
            )
        values = vocab_parallel_logprobs(
            logits,
            batch.targets.reshape(-1)[keep],
            batch.temperature.reshape(-1)[keep],
            vocab_start=self.vocab_start,
            vocab_size=self.shape.vocab_size,
            group=tp_group() if self.parallel.tp_size > 1 else None,
        )
        return values, keep

    def logprobs(self, batches: Sequence[MicroBatch], *, reference: bool = False) -> list[torch.Tensor]:
        if reference and self.reference is None and self.lora is None:
            raise BackendError("no reference model was kept (kl_coef is 0)")
        self._check(batches)
        self._announce("logprobs", batches, reference)
        return self._logprobs(batches, reference)

    def _logprobs(self, batches: Sequence[MicroBatch], reference: bool = False) -> list[torch.Tensor]:
        """Every replica scores its share; rank 0 returns all of them (the others, only their own).
        With LoRA the reference policy is the base model: the adapters left out."""
        if reference and self.lora is not None:
            with self._adapters_disabled():
                return self._logprobs(batches)
        model = self.reference if reference else self.model
        dp_size, dp_rank = self.parallel.dp_size, self.parallel.dp_rank
        if dp_size == 1:
            return self._score(model, batches)
        mine = list(range(dp_rank, len(batches), dp_size))
        scored = dict(zip(mine, self._score(model, [batches[i] for i in mine])))
        everyone = [None] * self.parallel.world_size if self.parallel.is_leader else None
        dist.gather_object(scored if self.parallel.tp_rank == 0 else {}, everyone, dst=0)
        if everyone is None:
            return list(scored.values())
        for part in everyone:
            scored.update(part)
        return [scored[i] for i in range(len(batches))]

    def update(
        self,
        batches: Sequence[MicroBatch],
        loss_config: LossConfig,
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> UpdateResult:
        if loss_config.kl_coef > 0 and self.reference is None and self.lora is None:
            raise BackendError("kl_coef > 0 needs the reference model (reference_model = true)")
        self._check(batches)
        self._announce("update", batches, loss_config, old_logprobs)
        return self._update(batches, loss_config, old_logprobs, should_stop)

    def _update(self, batches, loss_config, old_logprobs, should_stop=lambda: False) -> UpdateResult:
        return self._run_update(batches, loss_config, old_logprobs, should_stop)

    @contextlib.contextmanager
    def _adapters_disabled(self) -> Iterator[None]:
        layers = list(megatron_lora.layer_adapters(self.model))
        for layer in layers:
            layer.enabled = False
        try:
            yield
        finally:
            for layer in layers:
                layer.enabled = True

    def _reference_logprobs(self, batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        return self._logprobs(batches, reference=True)  # every rank is already in this call

    def _stop_agreed(self, stop: bool) -> bool:
        return self._agree(self.parallel.is_leader and stop)

    def _learning_rounds(self, count: int) -> list[int | None]:
        """Micro-batches dealt round-robin to the replicas; a replica with one fewer sits out the
        first round, so that every replica's last micro-batch is in the last round."""
        dp_size = self.parallel.dp_size
        mine = list(range(self.parallel.dp_rank, count, dp_size))
        return [None] * (math.ceil(count / dp_size) - len(mine)) + mine

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        if self.replicated is None or last:
            loss.backward()  # the last one fills the buckets, which start their reduce-scatter
            self._reducing = self.replicated is not None
            return
        with self.replicated.no_sync():
            loss.backward()

    def _combine(self, losses, stats, tokens, trainable):
        """Every replica's micro-batches, gathered on rank 0 (the first rank of each replica speaks
        for it)."""
        if self.replicated is None:
            return super()._combine(losses, stats, tokens, trainable)
        part = {i: (losses[i], _stats_on_cpu(stats[i])) for i in losses} if self.parallel.tp_rank == 0 else {}
        everyone = [None] * self.parallel.world_size if self.parallel.is_leader else None
        dist.gather_object((part, tokens, trainable), everyone, dst=0)
        if everyone is None:
            return super()._combine(losses, stats, tokens, trainable)
        merged, tokens, trainable = {}, 0, 0
        for rank, (items, rank_tokens, rank_trainable) in enumerate(everyone):
            merged.update(items)
            if rank % self.parallel.tp_size == 0:
                tokens += rank_tokens
                trainable += rank_trainable
        order = sorted(merged)
        return [merged[i][0] for i in order], [merged[i][1] for i in order], tokens, trainable

    def _zero_grad(self) -> None:
        if self.replicated is not None:
            self.replicated.zero_grad_buffer()
        with cuda_names_on_cpu():
            self.optimizer.zero_grad(set_to_none=True)

    def _step(self) -> None:
        if self.replicated is None:
            self.optimizer.step()
            return
        with cuda_names_on_cpu():
            self.optimizer.step_with_ready_grads()  # steps this rank's slice, then all-gathers the weights

    def _clip_gradients(self) -> float:
        if self.replicated is not None:
            return self._clip_distributed_gradients()
        return self._clip_local_gradients()

    def _clip_distributed_gradients(self) -> float:
        """Finish the reduce-scatter (a replica with no micro-batch starts its share now, in the
        buckets' order), sum the QK-norm gradients over each tensor-parallel group (Megatron's
        finalize_model_grads), then clip this rank's fp32 slice by the whole model's norm."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if not self._reducing:
            self.replicated.start_grad_sync()
        self._reducing = False
        finalize_model_grads([self.replicated])
        with cuda_names_on_cpu():
            self.optimizer.prepare_grads()  # this rank's slice of the gradients, into the fp32 main grads
            total = float(self.optimizer.get_grad_norm())
            clip = self.options.grad_clip
            if clip > 0 and total > clip and math.isfinite(total):
                clip_grad_by_total_norm_fp32(self.optimizer.get_parameters(), clip, total)
        return total

    def _clip_local_gradients(self) -> float:
        """Sum the QK-norm gradients over ranks, then clip by the whole model's gradient norm."""
        with_grad = {name: p for name, p in self.trained.items() if p.grad is not None}
        tp = self.parallel.tp_size > 1
        if tp:
            for name, parameter in with_grad.items():
                if "q_layernorm" in name or "k_layernorm" in name:
                    dist.all_reduce(parameter.grad, group=tp_group())

        def square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
            """Sum of squares of the gradients' entries, accumulated in fp32."""
            if not grads:
                return torch.zeros((), dtype=torch.float32, device=self.device)
            return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()

        sharded = square_sum([p.grad for name, p in with_grad.items() if not self._replicated(name)])
        duplicated = square_sum([p.grad for name, p in with_grad.items() if self._replicated(name)])
        if tp:
            dist.all_reduce(sharded, group=tp_group())
        total = float((sharded + duplicated).sqrt())
        clip = self.options.grad_clip
        if clip > 0 and total > clip and math.isfinite(total):
            torch._foreach_mul_([p.grad for p in with_grad.values()], clip / (total + 1e-6))
        return total

    def _replicated(self, name: str) -> bool:
        """Whether every tensor-parallel rank holds the whole parameter (its gradient too)."""
        matrix = self.adapters.get(name)
        return replicated(name) if matrix is None else matrix.split is None

    # -- weights ----------------------------------------------------------------------------------

    def hf_weights(self) -> HFWeights:
        return HFWeights(self)

    def _hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole HF tensors on rank 0, a layer at a time: each layer's shards are gathered from the
        ranks of its tensor-parallel group, converted, yielded, and dropped before the next layer is
        gathered. The other replicas hold the same weights and take no part. With LoRA: the adapter
        matrices alone, under PEFT's names and in its shapes."""
        tp_size = self.parallel.tp_size
        if self.parallel.dp_rank != 0:
            return
        if self.lora is not None:
            yield from self._adapter_weights()
            return
        for _, names in groupby(megatron_names(self.shape), key=layer_of):
            local = {name: self.parameters[name].detach() for name in names}
            if tp_size == 1:
                shards = [local]
            else:
                shards = [{} for _ in range(tp_size)]
                for name, tensor in local.items():
                    tensor = tensor.contiguous()
                    parts = [torch.empty_like(tensor) for _ in range(tp_size)] if self.parallel.is_leader else None
                    dist.gather(tensor, parts, dst=0, group=tp_group())
                    if parts is not None:
                        for shard, part in zip(shards, parts):
                            shard[name] = part
            if self.parallel.is_leader:
                yield from megatron_to_hf(shards, self.shape).items()

    def _adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole adapter matrices on rank 0, one at a time: each split one gathered from the ranks of
        its tensor-parallel group (the others are rank 0's own)."""
        tp_size = self.parallel.tp_size
        for matrix in self.adapters.values():
            local = self.trained[matrix.megatron].detach()
            parts = [local]
            if matrix.split is not None and tp_size > 1:
                local = local.contiguous()
                parts = [torch.empty_like(local) for _ in range(tp_size)] if self.parallel.is_leader else None
                dist.gather(local, parts, dst=0, group=tp_group())
            if self.parallel.is_leader:
                yield matrix.hf, matrix.join(parts)

    def save(self, model_folder: Path, optimizer_file: Path) -> None:
        """The Hugging Face folder, or with LoRA the adapter's PEFT folder (over the base's folder)."""
        self._announce("save")
        self._save(model_folder, optimizer_file)

    def _save(self, model_folder: Path | None, optimizer_file: Path | None) -> None:
        leader = self.parallel.is_leader
        if self.lora is not None:
            tensors = list(self._hf_weights())  # rank 0's; the other ranks take part in the gathers
            if leader:
                lora.save_adapter_tensors(model_folder, tensors, self.lora, base_model=str(self.folder))
        else:
            self._save_model(model_folder)
        states = [None] * self.parallel.world_size if leader else None
        state = _on_cpu(self._optimizer_state())  # pickled between ranks: no device tensors
        if self.parallel.world_size > 1:
            dist.gather_object(state, states, dst=0)
        else:
            states = [state]
        if leader:
            torch.save(
                {"tp_size": self.parallel.tp_size, "dp_size": self.parallel.dp_size, "ranks": states}, optimizer_file
            )

    def _save_model(self, model_folder: Path | None) -> None:
        """The whole model as a Hugging Face folder on rank 0 (sharded safetensors, config, tokenizer)."""
        from safetensors.torch import save_file

        leader = self.parallel.is_leader
        if leader:
            model_folder.mkdir(parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        pending: dict[str, torch.Tensor] = {}  # the next file's tensors, on the CPU: at most SHARD_BYTES

        def write_pending() -> None:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(pending, model_folder / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(pending, file))
            pending.clear()

        total = 0
        for name, tensor in self._hf_weights():  # yields on rank 0 only
            if pending and sum(t.nbytes for t in pending.values()) + tensor.nbytes > SHARD_BYTES:
                write_pending()
            pending[name] = tensor.to("cpu", copy=True).contiguous()
            total += tensor.nbytes
        if leader:
            if pending:
                write_pending()
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (model_folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            self.hf_config.save_pretrained(model_folder)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(model_folder)

    def _optimizer_state(self) -> dict:
        """This rank's optimizer state. With several replicas: the AdamW state of its slice and the
        slice's fp32 main weights (a bf16 model's weights are their rounding)."""
        if self.replicated is None:
            return self.optimizer.state_dict()
        main = [[tensor.detach() for tensor in group] for group in self.optimizer.shard_fp32_from_float16_groups]
        return {"adam": self.optimizer.optimizer.state_dict(), "main": main}

    def _restore_optimizer_state(self, state: dict) -> None:
        if self.replicated is None:
            self.optimizer.load_state_dict(state)
            return
        self.optimizer.optimizer.load_state_dict(state["adam"])
        with torch.no_grad():
            for group, saved in zip(self.optimizer.shard_fp32_from_float16_groups, state["main"], strict=True):
                for tensor, value in zip(group, saved, strict=True):
                    tensor.copy_(value)

    def load_optimizer(self, optimizer_file: Path) -> None:
        try:
            saved = torch.load(optimizer_file, map_location="cpu", weights_only=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise BackendError(f"cannot restore the optimizer state {optimizer_file}: {exc}") from None
        layout = (self.parallel.tp_size, self.parallel.dp_size)
        saved_layout = (saved.get("tp_size"), saved.get("dp_size", 1)) if isinstance(saved, dict) else None
        if saved_layout != layout:
            described = (
                f"{saved_layout[0]} tensor-parallel ranks x {saved_layout[1]} replicas"
                if saved_layout
                else "no known layout"
            )
            raise BackendError(
                f"{optimizer_file} holds the optimizer state of a megatron backend with {described}; "
                f"this one has {layout[0]} x {layout[1]}"
            )
        self._announce("load_optimizer")
        self._load_optimizer(saved["ranks"])

    def _load_optimizer(self, states: list | None) -> None:
        mine = [None]
        if self.parallel.world_size > 1:
            dist.scatter_object_list(mine, states, src=0)
        else:
            mine = states
        try:
            self._restore_optimizer_state(mine[0])
        except (ValueError, RuntimeError, KeyError) as exc:
            raise BackendError(f"cannot restore the optimizer state: {exc}") from None


def _stats_on_cpu(stats: LossStats) -> LossStats:
    return LossStats(**{field.name: getattr(stats, field.name).cpu() for field in fields(stats)})


def _on_cpu(value):
    """A nested state dict with every tensor moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_on_cpu(item) for item in value]
    return value
