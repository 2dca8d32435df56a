"""Tiny Hugging Face models, a word-level tokenizer, packed micro-batches and a spawned
tensor-parallel job for the megatron backend's tests, shared by the CPU and the GPU tier."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from trainer.batches import pack
from trainer.grpo import LossConfig
from trainer.sequences import TrainSequence

LOSS = LossConfig(clip_low=0.2, clip_high=0.28, importance_cap=2.0)
LR = 1e-3  # large enough that a wrongly mapped gradient moves a weight visibly
ATOL = 1e-5  # fp32, two implementations of the same model (summation orders differ)
# AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps, rounding-level
# differences in g change that element's step by a visible fraction. So one element may differ by up
# to 10% of a step, and the mean by 0.1%; a wrongly mapped gradient moves many elements a whole step
# (or two, the other way).
WEIGHT_MAX_STEPS, WEIGHT_MEAN_STEPS = 0.1, 1e-3


def assert_matches(reference, logprobs, result, weights, atol: float = ATOL) -> None:
    """Logprobs, loss, gradient norm, stats and updated weights equal the reference's (fp32)."""
    ref_logprobs, ref_result, ref_weights = reference
    for ours, theirs in zip(logprobs, ref_logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    assert result.loss == pytest.approx(ref_result.loss, abs=atol)
    assert result.grad_norm == pytest.approx(ref_result.grad_norm, rel=atol)
    assert result.stats["clip_fraction"] == pytest.approx(ref_result.stats["clip_fraction"])
    assert (result.tokens, result.trainable_tokens) == (ref_result.tokens, ref_result.trainable_tokens)
    assert set(weights) == set(ref_weights)
    for name, tensor in ref_weights.items():
        difference = (weights[name] - tensor).abs()
        assert float(difference.max()) <= WEIGHT_MAX_STEPS * LR, f"{name}: {float(difference.max())}"
        assert float(difference.mean()) <= WEIGHT_MEAN_STEPS * LR, f"{name}: {float(difference.mean())}"


VOCAB = 300  # over 256: at TP=2 both vocabulary slices (256 rows each, padded) hold real tokens


def tiny_config(model_type: str, tied: bool, **changes):
    """A 2-layer model of the family: GQA (4 query heads, 2 KV heads), head_dim 16, hidden 32; `changes`
    replace or add settings."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    return config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=50_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        **changes,
    )


def save_tiny_model(
    folder: Path, model_type: str = "qwen3", tied: bool = False, seed: int = 0, **config_changes
) -> Path:
    """A random tiny model saved as a Hugging Face folder (safetensors, config, tokenizer).

    Every parameter, norms included, is random: a norm weight loaded into the wrong place (or not at
    all) changes the logits.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tied, **config_changes), dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(folder)
    return folder


def sample_sequences(seed: int = 0, lengths=(23, 9, 31, 14), temperatures=(1.0, 0.7, 1.3, 0.0)) -> list[TrainSequence]:
    """Traces with a prompt, then sampled spans (mask 1) around an interstitial span (mask 0)."""
    rng = np.random.default_rng(seed)
    sequences = []
    for index, (length, temperature) in enumerate(zip(lengths, temperatures)):
        mask = np.zeros(length, dtype=bool)
        mask[length // 3 : length // 3 * 2] = True
        mask[length - 3 :] = True
        sequences.append(
            TrainSequence(
                name=f"s{index}/t0",
                token_ids=rng.integers(0, VOCAB, length).astype(np.int64),
                loss_mask=mask,
                behaviour_logprobs=np.where(mask, -rng.uniform(0.5, 4.0, length), 0).astype(np.float32),
                advantage=float(rng.normal()),
                token_weight=1.0 / (4 * int(mask.sum())),
                temperature=np.full(length, temperature, dtype=np.float32),
                top_p=np.ones(length, dtype=np.float32),
                top_k=np.zeros(length, dtype=np.int32),
            )
        )
    return sequences


def micro_batches(max_tokens: int = 48):
    """The sample traces packed into several one-row micro-batches (more than one trace per row)."""
    return pack(sample_sequences(), max_tokens)


def torch_backend_run(folder: Path, device: str = "cpu", dtype: str = "float32", max_tokens: int = 48):
    """The torch backend on the tiny model: (logprobs, the update's result, the weights after it)."""
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    backend = TorchBackend(TorchBackendOptions(model=str(folder), device=device, dtype=dtype, lr=LR))
    batches = micro_batches(max_tokens)
    logprobs = backend.logprobs(batches)
    result = backend.update(batches, LOSS)
    return logprobs, result, {name: t.cpu().clone() for name, t in backend.hf_weights()}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tp_rank(
    rank: int,
    world: int,
    port: int,
    folder: str,
    out: str,
    dtype: str,
    recompute: str,
    fused_swiglu: bool,
    fused_rope: bool,
    tp_size: int,
    max_tokens: int,
    recompute_above: int,
    adapter: str,
) -> None:
    """One rank of a job, as torchrun would start it: rank 0 drives the backend, the rest follow.
    With an adapter, rank 0 also records the adapters' whole gradients as the optimizer gets them."""
    from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions, leave_job

    gradients = {}
    if adapter:
        MegatronBackend._step = _gathering_adapter_gradients(MegatronBackend._step, gradients)

    # recompute "auto" on a device small enough that micro-batches over `recompute_above` tokens
    # recompute: what each forward was set to is recorded.
    granularities = []
    if recompute_above:
        set_recompute = MegatronBackend._set_recompute
        MegatronBackend.recomputes = lambda self, tokens: tokens > recompute_above

        def recording(self, tokens: int) -> None:
            set_recompute(self, tokens)
            granularities.append((tokens, self.model.config.recompute_granularity))

        MegatronBackend._set_recompute = recording

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    backend = MegatronBackend(
        MegatronBackendOptions(
            model=folder,
            tp_size=tp_size,
            dtype=dtype,
            lr=LR,
            recompute=recompute,
            fused_swiglu=fused_swiglu,
            fused_rope=fused_rope,
            adapter=adapter,
        )
    )
    if rank != 0:
        backend.follow()
        return
    out = Path(out)
    initial = {name: t.cpu().clone() for name, t in backend.hf_weights()}
    batches = micro_batches(max_tokens)
    logprobs = backend.logprobs(batches)
    result = backend.update(batches, LOSS)
    weights = {name: t.cpu().clone() for name, t in backend.hf_weights()}
    backend.save(out / "saved", out / "optimizer.pt")
    backend.load_optimizer(out / "optimizer.pt")
    backend.close()
    leave_job()
    torch.save(
        {
            "logprobs": logprobs,
            "result": result,
            "initial": initial,
            "weights": weights,
            "gradients": gradients,
            "granularities": granularities,
        },
        out / "rank0.pt",
    )


def _gathering_adapter_gradients(step, gradients: dict):
    """A MegatronBackend._step that first puts each adapter matrix's whole gradient (PEFT name) in
    `gradients` on rank 0, gathered from the tensor-parallel ranks like its weight (every rank runs
    it). With data parallelism the gradients live in Megatron's buffers: none are recorded."""
    import torch.distributed as dist

    from trainer.backends.megatron.runtime import tp_group

    def gathering(self) -> None:
        for matrix in self.adapters.values() if self.replicated is None else ():
            grad = self.trained[matrix.megatron].grad.contiguous()
            parts = [grad]
            if matrix.split is not None and self.parallel.tp_size > 1:
                parts = (
                    [torch.empty_like(grad) for _ in range(self.parallel.tp_size)] if self.parallel.is_leader else None
                )
                dist.gather(grad, parts, dst=0, group=tp_group())
            if self.parallel.is_leader:
                gradients[matrix.hf] = matrix.join(parts).cpu().clone()
        step(self)

    return gathering


def run_tensor_parallel(
    world: int,
    folder: Path,
    out: Path,
    dtype: str,
    recompute: str = "none",
    fused_swiglu: bool = False,
    tp_size: int = 0,
    max_tokens: int = 48,
    fused_rope: bool = False,
    recompute_above: int = 0,
    adapter: str = "",
) -> dict:
    """Spawn a `world`-rank job on the tiny model at `folder` (`tp_size` ranks per tensor-parallel
    group, 0 = all; the rest data parallel) over `micro_batches(max_tokens)`, training the LoRA
    `adapter` folder if given; rank 0's logprobs, update result, weights before and after the update
    and (with an adapter) the adapters' gradients (its saved model and optimizer are in `out`)."""
    job = (
        world,
        free_port(),
        str(folder),
        str(out),
        dtype,
        recompute,
        fused_swiglu,
        fused_rope,
        tp_size,
        max_tokens,
        recompute_above,
        adapter,
    )
    spawn_ranks(_tp_rank, job, world)
    return torch.load(out / "rank0.pt", weights_only=False)


def _scoring_rank(
    rank: int, world: int, port: int, model: str, out: str, batch_sets: list, update_batches: list
) -> None:
    """One rank of a tensor-parallel job over given micro-batches: rank 0 scores each list of
    `batch_sets`, takes one update on `update_batches` and saves what it got; the others follow."""
    from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions, leave_job

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    backend = MegatronBackend(MegatronBackendOptions(model=model, tp_size=world, dtype="float32", lr=LR))
    if rank != 0:
        backend.follow()
        return
    logprobs = [backend.logprobs(batches) for batches in batch_sets]
    result = backend.update(update_batches, LOSS)
    weights = {name: t.cpu().clone() for name, t in backend.hf_weights()}
    backend.close()
    leave_job()
    torch.save({"logprobs": logprobs, "result": result, "weights": weights}, Path(out) / "rank0.pt")


def score_tensor_parallel(world: int, model: str, out: Path, batch_sets: list, update_batches: list) -> dict:
    """Spawn a `world`-rank tensor-parallel job on `model`: rank 0's logprobs of each list of
    micro-batches in `batch_sets`, then its update result and weights after one update on
    `update_batches`."""
    job = (world, free_port(), model, str(out), batch_sets, update_batches)
    spawn_ranks(_scoring_rank, job, world)
    return torch.load(out / "rank0.pt", weights_only=False)
