"""The torch backend: one process, CPU or one GPU, any Hugging Face causal LM.

The model is the Hugging Face class itself, so its parameter names are the ones the inference
servers and checkpoints use. Its attention is trainer.tree_attention's, registered with transformers:
a packed micro-batch (one row of several traces, or of trees of pieces sharing a prompt) runs one
causal attention per piece over the piece and its ancestors, so traces in one row never attend to each
other and a shared prompt is computed once; a padded one (a trace per row, padding at its end) runs
plain causal attention, which never reads the padding. transformers builds no [L, L] mask for an
attention implementation it does not know. Logits are computed only at the positions that have a trainable target (`logits_to_keep`),
since prompts are most of a trace and the output layer is the widest matrix of a small model.

Mixed precision: the parameters, their gradients and AdamW's state are always fp32; the forward and
backward passes compute in `dtype` (bf16 on a GPU by default) under autocast. Parameters kept in bf16
would lose the update itself: AdamW moves a weight by about the learning rate per step, and at the
1e-5 to 1e-4 that RL fine-tuning uses that is below half of bf16's spacing for most weights, so
most of each step rounds away. Logprobs and the loss are always computed in fp32; the weights go to
the inference servers in the compute dtype.

LoRA (`lora_rank` > 0, polar/lora.py): every targeted projection gets an adapter, the base weights
are frozen, and the optimizer, the gradient clipping, the weight push and the checkpoint hold the
adapters alone. The reference policy of the KL term is the base model itself (the adapters switched
off), so no copy of the model is kept.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from polar import lora
from polar.config import DEFAULT_LORA_TARGETS
from trainer.backends.base import (
    Backend,
    BackendError,
    UpdateResult,
    activation_bytes,
    device_memory,
    recompute_activations,
)
from trainer.batches import MicroBatch
from trainer.grpo import LossConfig, constrained_logits, token_logprobs
from trainer.tree_attention import TREE_ATTENTION, TreeLayout, register_with_transformers


@dataclass(frozen=True)
class TorchBackendOptions:
    """How to build the torch backend (the [trainer] settings it reads)."""

    model: str  # "tiny", "smollm2-135m" or a Hugging Face folder
    device: str = "auto"
    dtype: str = "auto"
    lr: float = 1e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gradient_checkpointing: str = "auto"  # "auto", "on" or "off" (base.recompute_activations)
    max_tokens_per_microbatch: int = 0  # 0 = the model's context length
    reference_model: bool = False  # keep a frozen copy of the starting weights (for the KL term)
    seed: int = 0
    cpu_threads: int = 0  # 0 = torch's default
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank on lora_targets (polar/lora.py); 0 = every weight
    lora_alpha: float = 32.0
    lora_targets: str = DEFAULT_LORA_TARGETS  # comma-separated module names
    adapter: str = ""  # a PEFT adapter folder to start from (a checkpoint's); its settings replace the three above


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, options: TorchBackendOptions) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        from polar.inference.engines.torch_engine import resolve_device, resolve_dtype
        from polar.inference.models import ModelNotFoundError, resolve_model

        torch.manual_seed(options.seed)
        if options.cpu_threads > 0:
            torch.set_num_threads(options.cpu_threads)
        try:
            self.folder = resolve_model(options.model)
        except ModelNotFoundError as exc:
            raise BackendError(str(exc)) from None
        self.device = resolve_device(options.device)
        self.dtype = resolve_dtype(options.dtype, self.device)  # of the computation; parameters stay fp32
        self.options = options
        transformers_logging.disable_progress_bar()
        register_with_transformers()
        self.model = AutoModelForCausalLM.from_pretrained(
            self.folder, dtype=torch.float32, attn_implementation=TREE_ATTENTION
        )
        self.model.to(self.device).train()
        self.model.config.use_cache = False
        # transformers builds the input embedding with padding_idx = pad_token_id, whose row then never
        # gets a gradient. Packed micro-batches hold no padding, and SmolLM2's pad id is a real token
        # (<|im_end|>, which ends every turn): its embedding must learn like any other.
        self.model.get_input_embeddings().padding_idx = None
        self.lora = self._attach_adapters(options)
        config = self.model.config
        self.microbatch_tokens = options.max_tokens_per_microbatch or config.max_position_embeddings
        self._activations_per_token = activation_bytes(
            tokens=1,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            element_bytes=self.dtype.itemsize,
        )
        self._memory = device_memory(self.device)
        recompute_activations(options.gradient_checkpointing, activations=0, device_memory=self._memory)  # checks it
        # Layers that can recompute: transformers wraps each decoder layer once enabled, and reads the
        # layer's flag at every forward, so each micro-batch sets it (_set_recompute).
        self._recomputable: list[torch.nn.Module] = []
        if options.gradient_checkpointing != "off":
            # transformers renamed it (the old name warns); older 5.x releases have only the old one.
            enable = (
                getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            )
            enable()
            self._recomputable = [m for m in self.model.modules() if hasattr(m, "_gradient_checkpointing_func")]
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.reference = None
        if options.reference_model and self.lora is None:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self._trained(),
            lr=options.lr,
            betas=(options.adam_beta1, options.adam_beta2),
            weight_decay=options.weight_decay,
            foreach=True,
        )

    def _attach_adapters(self, options: TorchBackendOptions) -> lora.LoraSettings | None:
        """The adapters' settings once attached (and loaded from `options.adapter`); None without LoRA."""
        if not options.lora_rank and not options.adapter:
            return None
        try:
            saved = lora.read_adapter(options.adapter) if options.adapter else None
            settings = (
                saved.settings
                if saved
                else lora.LoraSettings.parse(options.lora_rank, options.lora_alpha, options.lora_targets)
            )
            self.model.requires_grad_(False)
            lora.attach(self.model, settings)  # fp32, as every trained parameter (see the module docstring)
            if saved:
                lora.load_adapter_tensors(self.model, saved.tensors)
        except lora.LoraError as exc:
            raise BackendError(str(exc)) from None
        return settings

    def _trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates: the adapters' with LoRA, else every one."""
        if self.lora is not None:
            return [parameter for _, parameter in lora.adapter_parameters(self.model)]
        return list(self.model.parameters())

    @property
    def model_description(self) -> dict[str, object]:
        config = self.model.config
        return {
            "model_type": config.model_type,
            "vocab_size": self.model.get_output_embeddings().weight.shape[0],
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
            "lora_rank": self.lora.rank if self.lora else 0,
        }

    # -- scoring and learning ---------------------------------------------------------------------

    def recomputes(self, tokens: int) -> bool:
        return recompute_activations(
            self.options.gradient_checkpointing,
            activations=tokens * self._activations_per_token,
            device_memory=self._memory,
        )

    def _set_recompute(self, tokens: int) -> None:
        recompute = self.recomputes(tokens)
        for module in self._recomputable:
            module.gradient_checkpointing = recompute

    def _target_logprobs(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [K] of the trainable targets, their flat indices [K] into [R * L])."""
        batch = batch.to(self.device)
        rows, length = batch.input_ids.shape
        if model is self.model:
            self._set_recompute(batch.input_ids.numel() if torch.is_grad_enabled() else 0)
        # Positions with a trainable target in any row: the only ones whose logits are needed.
        keep = batch.loss_mask.any(dim=0).nonzero().squeeze(-1)  # [P]
        # A packed row: its pieces (traces, or trees of them); padded rows: plain causal attention.
        layout = None
        if rows == 1:
            layout = [TreeLayout.from_pieces(batch.sequence_lengths[0], batch.row_parents(0), length)]
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            output = model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=None,
                logits_to_keep=keep,
                use_cache=False,
                tree_layout=layout,
            )
        logits = output.logits  # [R, P, V]
        selected = batch.loss_mask[:, keep]  # [R, P]
        flat = torch.arange(rows * length, device=self.device).view(rows, length)[:, keep][selected]  # [K]
        target_logits = logits[selected].float()  # [K, V]
        if batch.constraint_index is not None:
            target_logits = constrained_logits(target_logits, flat, batch.constraint_index, batch.constraint_allowed)
        values = token_logprobs(
            target_logits,
            batch.targets[:, keep][selected],
            batch.temperature[:, keep][selected],
            batch.top_k[:, keep][selected],
            batch.top_p[:, keep][selected],
        )
        return values, flat

    def logprobs(self, batches: Sequence[MicroBatch], *, reference: bool = False) -> list[torch.Tensor]:
        if reference and self.lora is not None:
            with lora.disabled(self.model):
                return self._score(self.model, batches)
        model = self.reference if reference else self.model
        if model is None:
            raise BackendError("no reference model was kept (kl_coef is 0)")
        return self._score(model, batches)

    def update(
        self,
        batches: Sequence[MicroBatch],
        loss_config: LossConfig,
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> UpdateResult:
        return self._run_update(batches, loss_config, old_logprobs, should_stop)

    def _clip_gradients(self) -> float:
        clip = self.options.grad_clip if self.options.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self._trained(), clip))

    # -- weights ----------------------------------------------------------------------------------

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, or with LoRA the adapter matrices alone (the base never changes)."""
        named = lora.adapter_parameters(self.model) if self.lora is not None else self.model.named_parameters()
        for name, parameter in named:
            yield name, parameter.detach().to(self.dtype)

    def save(self, model_folder: Path, optimizer_file: Path) -> None:
        """The Hugging Face folder, or with LoRA the adapter's PEFT folder (over the base's folder)."""
        if self.lora is not None:
            lora.save_adapter(model_folder, self.model, self.lora, base_model=str(self.folder))
        else:
            self.model.save_pretrained(model_folder, safe_serialization=True)
            self.tokenizer.save_pretrained(model_folder)
        torch.save(self.optimizer.state_dict(), optimizer_file)

    def load_optimizer(self, optimizer_file: Path) -> None:
        try:
            state = torch.load(optimizer_file, map_location=self.device, weights_only=True)
            self.optimizer.load_state_dict(state)
        except (OSError, ValueError, RuntimeError) as exc:
            raise BackendError(f"cannot restore the optimizer state {optimizer_file}: {exc}") from None
