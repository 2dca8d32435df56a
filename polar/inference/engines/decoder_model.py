"""Llama, Qwen2 and Qwen3 causal LMs built from a model folder's config.json and safetensors,
without transformers.

The torch engine's DecoderRunner runs a model through its submodules alone, so this module builds
the tree transformers' LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM build, under the same
names (state-dict names, tied embeddings and parameter counts are theirs: weight updates and LoRA
targets name them), with the same RMSNorm and rotary computations. Importing transformers and
loading through `from_pretrained` cost an engine start about 5 s of CPU; this costs a few hundredths.
A folder it does not build the same way (another architecture, activation or rope type, a
quantization, no safetensors, a tensor it would not place) gives None, and the engine loads it
through transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

# transformers' defaults for what a config.json may leave out, per model type.
_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
# What every config.json save_pretrained writes must say for this module to build the model.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Checkpoint entries that are no parameter: older checkpoints saved the rotary frequencies.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class DecoderConfig:
    """What the tree and DecoderRunner read of config.json, under transformers' names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    use_sliding_window: bool = False

    @classmethod
    def read(cls, config: dict) -> DecoderConfig | None:
        """The config of a model this module builds as transformers does; None for any other."""
        model_type = config.get("model_type")
        defaults = _DEFAULTS.get(model_type)
        rope = _rope_parameters(config)
        if (
            defaults is None
            or config.get("hidden_act", "silu") != "silu"
            or config.get("quantization_config")
            or rope is None
            or rope.get("rope_type", rope.get("type", "default")) != "default"
            or rope.get("partial_rotary_factor", 1.0) != 1.0
        ):
            return None
        if not all(key in config for key in _REQUIRED):
            return None  # transformers' defaults for these differ by release: it reads such a folder itself
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads
        head_dim = config.get("head_dim", defaults["head_dim"]) or config["hidden_size"] // heads
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=config.get("max_position_embeddings", defaults["max_position_embeddings"]),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2's q, k and v projections always have a bias and its o projection never; Llama's
            # and Qwen3's follow attention_bias.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            use_sliding_window=bool(config.get("use_sliding_window", False)),
        )


def _rope_parameters(config: dict) -> dict | None:
    """transformers 5's rope_parameters, or what older config.json files say (rope_theta beside a
    rope_scaling); None where they name several (per layer type)."""
    parameters = config.get("rope_parameters")
    if parameters is None:
        parameters = dict(config.get("rope_scaling") or {})
        if "rope_theta" in config:
            parameters["rope_theta"] = config["rope_theta"]
    return parameters if isinstance(parameters, dict) and "rope_theta" in parameters else None


class _Linear(nn.Linear):
    """An nn.Linear whose weights come from the checkpoint: initialising them would be wasted, and
    on the meta device torch's initialisers import torch._dynamo (seconds of CPU)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """An nn.Embedding whose weights come from the checkpoint (see _Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # transformers' order of operations: the mean square in fp32, the weight in the input's dtype.
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin [b, q, head_dim] of positions [b, q], in the dtype of the tensor passed with them."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.inv_freq = nn.Buffer(inv_freq.to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype=x.dtype), angles.sin().to(dtype=x.dtype)


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = _Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = _Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """The projections (and Qwen3's per-head norms); DecoderRunner computes the attention."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        queries, keys = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.q_proj = _Linear(config.hidden_size, queries, bias=config.qkv_bias)
        self.k_proj = _Linear(config.hidden_size, keys, bias=config.qkv_bias)
        self.v_proj = _Linear(config.hidden_size, keys, bias=config.qkv_bias)
        self.o_proj = _Linear(queries, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder (`model`) and the output head (`lm_head`, the input embedding where tied)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def load_decoder_model(folder: Path, dtype: torch.dtype, device: torch.device) -> CausalLM | None:
    """The model in `folder` with its parameters in `dtype` on `device`, in inference mode; None
    where this module does not build it (the caller then loads it through transformers)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = DecoderConfig.read(json.loads(config_file.read_text(encoding="utf-8")))
    tensors = _read_safetensors(folder)
    if config is None or tensors is None:
        return None
    # Built on the meta device, then given the checkpoint's tensors: no memory or time is spent
    # initialising weights that are replaced at once.
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {name for name, _ in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        tensors.pop("lm_head.weight", None)  # some tied checkpoints save the shared matrix twice
    tensors = {name: t for name, t in tensors.items() if not name.endswith(_IGNORED_SUFFIXES)}
    if set(tensors) != expected:
        return None
    state = {}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(model.get_parameter(name).shape):
            return None
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, device)
    return model.eval().requires_grad_(False)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of the folder's model.safetensors, or of the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(folder / shard))
    return tensors
