"""The contract between the training loop and a backend that holds the model.

The loop (trainer/loop.py) owns everything that is not the model: which groups to train on, their
advantages and token weights (trainer/grpo.py), the packing into micro-batches (trainer/batches.py),
weight sync and checkpoints. A backend owns the weights and the optimizer and does three things with
micro-batches: score them (`logprobs`), learn from them (`update`), and hand out its weights under
Hugging Face names (`hf_weights`, for the inference servers and for checkpoints).

Every backend computes the same quantities: per-target log-probabilities under exactly the sampling
distribution the inference engine drew each token from (`grpo.token_logprobs`), and the GRPO loss of
`grpo.policy_loss` summed over micro-batches whose token weights are already normalised over the
update, so accumulating their gradients gives the exact gradient of the whole update.

    torch      one process, CPU or one GPU, any Hugging Face causal LM (torch_backend.py)
    megatron   Megatron-Core, tensor and data parallel over the ranks of a torchrun job; Llama / Qwen2 /
               Qwen3 (megatron/)
"""

from __future__ import annotations

import abc
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.batches import MicroBatch
from trainer.grpo import LossConfig, LossStats, merge_stats, policy_loss


def shared_options(config) -> dict[str, object]:
    """The [trainer] settings every backend's options take under the same names (a TrainerConfig)."""
    return {
        "dtype": config.dtype,
        "lr": config.lr,
        "adam_beta1": config.adam_beta1,
        "adam_beta2": config.adam_beta2,
        "weight_decay": config.weight_decay,
        "grad_clip": config.grad_clip,
        "reference_model": config.kl_coef > 0,  # the KL term needs the frozen starting policy
        "seed": config.seed,
        "cpu_threads": config.cpu_threads,
        "max_tokens_per_microbatch": config.max_tokens_per_microbatch,
    }


def activation_bytes(*, tokens: int, layers: int, hidden: int, intermediate: int, element_bytes: int) -> int:
    """About what the backward pass keeps of a micro-batch of `tokens` tokens when nothing is
    recomputed: per token and layer, some ten hidden-sized tensors (norms, q/k/v, the attention's
    output, the residuals) and four MLP-sized ones (gate, up, the activation, their product), in the
    compute dtype. SmolLM2-135M on a CPU in fp32 kept 0.9 MB a token measured, against 1.4 MB here:
    an upper bound is what the choice below needs."""
    return tokens * layers * (10 * hidden + 4 * intermediate) * element_bytes


def recompute_activations(setting: str, *, activations: int, device_memory: int) -> bool:
    """Whether a micro-batch whose activations take `activations` bytes recomputes them in the
    backward pass (`gradient_checkpointing`): "on" or "off" as said; "auto" when they would take more
    than a quarter of the device's memory (the weights, gradients and AdamW's two moments, the logits
    and the inference servers beside the trainer need the rest), since recomputing costs about a third
    more time. Backends decide per micro-batch, so small ones never pay it."""
    if setting not in ("auto", "on", "off"):
        raise BackendError(f"gradient_checkpointing must be auto, on or off, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    return activations > device_memory // 4


def device_memory(device: torch.device) -> int:
    """Bytes of memory of a GPU, or of this machine for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class BackendError(RuntimeError):
    """The backend cannot start or load what it was given (a missing model, a checkpoint of another
    model); the message says which."""


class UpdateAborted(Exception):
    """`update` was asked to stop between micro-batches; the weights and optimizer are untouched."""


@dataclass(frozen=True)
class UpdateResult:
    """What one optimizer update did."""

    loss: float  # the update's GRPO loss (sum over its micro-batches)
    grad_norm: float  # total gradient norm before clipping
    stats: dict[str, float] = field(default_factory=dict)  # grpo.merge_stats of the micro-batches
    tokens: int = 0  # real tokens forwarded
    trainable_tokens: int = 0  # tokens with a loss
    seconds: float = 0.0


class Backend(abc.ABC):
    """A model and its optimizer; see the module docstring for the contract."""

    name: str  # "torch" or "megatron"
    # Tokens computed in one forward pass: [trainer] max_tokens_per_microbatch, or with 0 the model's
    # context length, the longest trace the model can hold.
    microbatch_tokens: int

    def recomputes(self, tokens: int) -> bool:
        """Whether a micro-batch of `tokens` tokens recomputes its activations in the backward pass."""
        return False

    @property
    @abc.abstractmethod
    def model_description(self) -> dict[str, object]:
        """What a checkpoint records to recognise the model later: at least "model_type",
        "vocab_size", "hidden_size" and "num_hidden_layers"."""

    @abc.abstractmethod
    def logprobs(self, batches: Sequence[MicroBatch], *, reference: bool = False) -> list[torch.Tensor]:
        """Per-target log-probabilities [R, L] of each micro-batch under the current weights (or the
        frozen reference policy), without gradients; 0 where the micro-batch has no target."""

    @abc.abstractmethod
    def update(
        self,
        batches: Sequence[MicroBatch],
        loss_config: LossConfig,
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> UpdateResult:
        """One optimizer update over the micro-batches (gradients accumulated, clipped, stepped).

        `old_logprobs` are the policy's logprobs at the start of the step (`logprobs` before any
        update of the step); None means this is the step's only update, so they equal the current
        ones and come from the same forward pass. `should_stop` is asked between micro-batches: when
        it answers True the gradients are dropped and UpdateAborted is raised.
        """

    # -- the update every backend runs, over its hooks -----------------------------------------------

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device

    def _target_logprobs(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(differentiable logprobs [K] of the batch's trainable targets, their flat indices [K] into
        the batch's [R * L] positions)."""
        raise NotImplementedError

    def _score(self, model: torch.nn.Module, batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """`logprobs` of `model` (the policy or the reference): [R, L] per micro-batch, on the CPU."""
        results = []
        with torch.no_grad():
            for batch in batches:
                values, flat = self._target_logprobs(model, batch)
                out = torch.zeros(batch.input_ids.numel(), dtype=torch.float32, device=self.device)
                out[flat] = values
                results.append(out.view(batch.input_ids.shape).cpu())
        return results

    def _reference_logprobs(self, batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """The frozen reference policy's logprobs, as `logprobs(reference=True)` gives them."""
        return self.logprobs(batches, reference=True)

    def _stop_agreed(self, stop: bool) -> bool:
        """Whether to stop now, the same answer in every process of the backend."""
        return stop

    def _clip_gradients(self) -> float:
        """Clip the accumulated gradients to the configured norm; the norm before clipping."""
        raise NotImplementedError

    def _learning_rounds(self, count: int) -> list[int | None]:
        """The micro-batches (indices into the update's `count`) this process learns from, one per
        round; None for a round it sits out. Every process of a backend runs the same number of
        rounds, since the stop checks between rounds are collective. One process learns from all."""
        return list(range(count))

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradients of one micro-batch's loss; `last`: this process's last one."""
        loss.backward()

    def _combine(
        self, losses: dict[int, float], stats: dict[int, LossStats], tokens: int, trainable: int
    ) -> tuple[list[float], list[LossStats], int, int]:
        """This process's per-micro-batch losses and stats (by index) and counts, as the whole
        update's (losses and stats in micro-batch order); what the caller gets is the leader's."""
        return [losses[i] for i in sorted(losses)], [stats[i] for i in sorted(stats)], tokens, trainable

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _step(self) -> None:
        self.optimizer.step()

    def _run_update(
        self,
        batches: Sequence[MicroBatch],
        loss_config: LossConfig,
        old_logprobs: Sequence[torch.Tensor] | None,
        should_stop: Callable[[], bool],
    ) -> UpdateResult:
        """Accumulate the GRPO loss's gradients over the micro-batches, clip, step (see `update`)."""
        started = time.perf_counter()
        references = self._reference_logprobs(batches) if loss_config.kl_coef > 0 else None
        self._zero_grad()
        losses: dict[int, float] = {}
        all_stats: dict[int, LossStats] = {}
        tokens, trainable = 0, 0
        rounds = self._learning_rounds(len(batches))
        mine = [index for index in rounds if index is not None]
        for index in rounds:
            if self._stop_agreed(should_stop()):
                self._zero_grad()
                raise UpdateAborted
            if index is None:
                continue
            batch = batches[index]
            values, flat = self._target_logprobs(self.model, batch)

            def at_targets(tensor: torch.Tensor) -> torch.Tensor:
                return tensor.to(self.device).reshape(-1)[flat].float()  # [R, L] -> [K]

            loss, stats = policy_loss(
                values,
                values.detach() if old_logprobs is None else at_targets(old_logprobs[index]),
                at_targets(batch.behaviour_logprobs),
                at_targets(batch.advantages),
                at_targets(batch.token_weights),
                loss_config,
                ref_logprobs=None if references is None else at_targets(references[index]),
            )
            self._backward(loss, last=index == mine[-1])
            losses[index] = float(loss.detach())
            all_stats[index] = stats
            tokens += batch.tokens
            trainable += batch.trainable_tokens
        grad_norm = self._clip_gradients()
        if self._stop_agreed(should_stop()):
            self._zero_grad()
            raise UpdateAborted
        # A non-finite gradient would turn every weight it touches into NaN, on the inference servers
        # too once synced: the update is skipped instead, and reported.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self._step()
        self._zero_grad()
        if self.device.type == "cuda":
            # The activations' memory goes back to the driver: an inference engine on the same GPU
            # samples the next rollouts in it (its keys and values), as colocated trainers share a card.
            torch.cuda.empty_cache()
        loss_values, stats_list, tokens, trainable = self._combine(losses, all_stats, tokens, trainable)
        return UpdateResult(
            loss=sum(loss_values),
            grad_norm=grad_norm,
            stats={**(merge_stats(stats_list) if stats_list else {}), "updates_skipped": float(skipped)},
            tokens=tokens,
            trainable_tokens=trainable,
            seconds=time.perf_counter() - started,
        )

    @abc.abstractmethod
    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every parameter under its Hugging Face state-dict name, one tensor at a time (tied weights
        once), detached; for weight sync and checkpoints. Iterated once; a sized iterable where the
        backend knows the count up front."""

    @abc.abstractmethod
    def save(self, model_folder: Path, optimizer_file: Path) -> None:
        """Write the model as a Hugging Face folder (safetensors, config, tokenizer) that
        transformers and `polar serve inference --model` load, and the optimizer state."""

    @abc.abstractmethod
    def load_optimizer(self, optimizer_file: Path) -> None:
        """Restore the optimizer state that `save` wrote."""
