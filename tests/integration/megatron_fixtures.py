"""Tiny Hugging Face models, a word-level tokenizer and packed micro-batches for the megatron
backend's tests (CPU, fp32), shared by the CPU and GPU tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainer.batches import TrainSequence, pack

VOCAB = 300  # over 256: at TP=2 both vocabulary slices (256 rows each, padded) hold real tokens


def tiny_config(model_type: str, tied: bool):
    """A 2-layer model of the family: GQA (4 query heads, 2 KV heads), head_dim 16, hidden 32."""
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
    )


def save_tiny_model(folder: Path, model_type: str = "qwen3", tied: bool = False, seed: int = 0) -> Path:
    """A random tiny model saved as a Hugging Face folder (safetensors, config, tokenizer).

    Every parameter, norms included, is random: a norm weight loaded into the wrong place (or not at
    all) changes the logits.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tied), dtype=torch.float32)
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
