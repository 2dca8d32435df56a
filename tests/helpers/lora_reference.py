"""What an engine serving smollm2-135m plus a LoRA adapter must compute: random adapters of the
shapes lora.attach makes, and the logprobs of a Hugging Face forward of the base with an adapter merged
into its weights (W + s·B·A), for the vLLM tier's adapter tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from polar import lora
from polar.inference import models

MODEL = "smollm2-135m"


def base_model():
    return AutoModelForCausalLM.from_pretrained(models.resolve_model(MODEL), dtype=torch.float32).eval()


def adapter_shapes(settings: lora.LoraSettings) -> dict[str, tuple[int, ...]]:
    """The matrices of an adapter of `settings` on the model: those lora.attach makes."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models.resolve_model(MODEL)))
    lora.attach(model, settings)
    return {name: tuple(p.shape) for name, p in lora.adapter_parameters(model)}


def random_adapter(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Matrices that move the model's greedy tokens (a trained adapter moves it less)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.05 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}


@torch.no_grad()
def merged_logprobs(
    base, settings: lora.LoraSettings, adapter: dict, prompt: list[int], tokens: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of `tokens` after `prompt` under `temperature`, from `base` with `adapter` merged into
    its weights; `base` is left as it was."""
    modules = {name.removesuffix(".lora_A.weight") for name in adapter if name.endswith(".lora_A.weight")}
    originals = {m: base.get_submodule(m).weight.clone() for m in modules}
    for m in modules:
        delta = adapter[f"{m}.lora_B.weight"] @ adapter[f"{m}.lora_A.weight"]
        base.get_submodule(m).weight.add_(settings.scaling * delta)
    threads = torch.get_num_threads()
    # One thread: vLLM's worker keeps its OpenMP threads spinning on the cores, and a forward that
    # competes with them on two threads took 10 s here instead of 0.5 s on one.
    torch.set_num_threads(1)
    try:
        logits = base(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    finally:
        torch.set_num_threads(threads)
        for m, weight in originals.items():
            base.get_submodule(m).weight.copy_(weight)
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
