"""The megatron trainer backend: Megatron-Core, tensor and data parallel, started with torchrun.

    runtime.py    process groups (tensor x data parallel), devices, running Megatron on a CPU (gloo)
    model.py      the GPT model from a Hugging Face config; Polar's layer spec (RoPE + SDPA attention); packing
    convert.py    Hugging Face <-> Megatron weights, tensor-parallel sharding (pure functions)
    logprobs.py   vocabulary-parallel per-token logprobs (the full vocabulary is never gathered)
    lora.py       LoRA adapters split like the layers they adapt, under PEFT's names and shapes
    backend.py    MegatronBackend: the Backend contract; rank 0 leads, the other ranks follow
    launch.py     the torchrun entry point: rank 0 serves the trainer, the other ranks follow

Importing this package does not import megatron-core; building a backend does (MegatronUnavailable
when it is not installed).
"""

from trainer.backends.megatron.backend import (
    MegatronBackend,
    MegatronBackendOptions,
    leave_job,
    options_from_config,
    release_followers,
)
from trainer.backends.megatron.convert import hf_to_megatron, megatron_to_hf
from trainer.backends.megatron.logprobs import TruncatedSamplingError
from trainer.backends.megatron.model import ModelShape, UnsupportedModel
from trainer.backends.megatron.runtime import MegatronUnavailable

__all__ = [
    "MegatronBackend",
    "MegatronBackendOptions",
    "MegatronUnavailable",
    "ModelShape",
    "TruncatedSamplingError",
    "UnsupportedModel",
    "hf_to_megatron",
    "leave_job",
    "megatron_to_hf",
    "options_from_config",
    "release_followers",
]
