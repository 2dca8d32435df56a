"""transformers' model of a torch engine's folder holding the engine's current parameters: the
independent forward that the engine's outputs are checked against (the engine builds its own module
tree, polar/inference/engines/decoder_model.py, and has no forward of its own)."""

from __future__ import annotations

import torch


def transformers_twin(engine) -> torch.nn.Module:
    """The engine's model as transformers builds it, with the engine's parameters (weight updates
    included), in their dtype and on their device."""
    from transformers import AutoModelForCausalLM

    parameter = next(engine.model.parameters())
    model = AutoModelForCausalLM.from_pretrained(engine.description.tokenizer_path, dtype=parameter.dtype)
    model.load_state_dict(engine.model.state_dict(), strict=True)
    return model.to(parameter.device).eval().requires_grad_(False)
