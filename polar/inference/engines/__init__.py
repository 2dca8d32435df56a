"""Engines behind the inference service, and the factory that builds one by kind.

The torch, vLLM and upstream engines are imported only when asked for, so that `scripted` (and anything that
just needs the contract) does not pay for loading them, and so that a missing vLLM only matters to
those who choose it.
"""

from __future__ import annotations

from polar.inference.engines.base import (
    Engine,
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ModelDescription,
    ParameterSpec,
    SamplingConfig,
    TokenChunk,
    WeightsFixed,
    WeightUpdateError,
)

ENGINE_KINDS = ("torch", "vllm", "scripted", "upstream")

__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "EngineOptions",
    "FinishReason",
    "GenerationEnd",
    "GenerationRequest",
    "ModelDescription",
    "ParameterSpec",
    "SamplingConfig",
    "TokenChunk",
    "WeightUpdateError",
    "WeightsFixed",
    "create_engine",
]


def create_engine(kind: str, options: EngineOptions) -> Engine:
    """Build an engine of the given kind ("torch", "vllm", "scripted" or "upstream"); it is not started yet."""
    if kind == "torch":
        from polar.inference.engines.torch_engine import TorchEngine

        return TorchEngine(options)
    if kind == "vllm":
        from polar.inference.engines.vllm_engine import VLLMEngine

        return VLLMEngine(options)
    if kind == "scripted":
        from polar.inference.engines.scripted import ScriptedEngine

        return ScriptedEngine(options)
    if kind == "upstream":
        from polar.inference.engines.upstream import UpstreamEngine

        return UpstreamEngine(options)
    raise ValueError(f"unknown engine kind {kind!r}; expected one of: {', '.join(ENGINE_KINDS)}")
