"""The torch engine's own Llama, Qwen2 and Qwen3 trees (polar/inference/engines/decoder_model.py)
hold what transformers loads from the same folder, under the same names, and DecoderRunner computes
the same logits over them as over transformers' model and as transformers' own forward; a folder
they would build otherwise is left to transformers, and the engine loads it that way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polar.inference.engines.decoder_model import CausalLM, load_decoder_model
from polar.inference.engines.llama import DecoderRunner
from polar.inference.models import resolve_model
from tests.helpers.trainer_backends import save_tiny_model

PROMPT = torch.tensor([5, 17, 3, 250, 99, 42, 7, 8, 120, 64, 1, 2, 33])
CPU = torch.device("cpu")


def transformers_model(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().requires_grad_(False)


def runner_logits(model, prompt: torch.Tensor = PROMPT, decode: int = 4) -> torch.Tensor:
    """The logits after a prefill of all but the last `decode` tokens, then after each next token
    but the last decoded one at a time: [decode, V], for positions len - decode - 1 ... len - 2."""
    runner = DecoderRunner(model, max_slots=1)
    cut = len(prompt) - decode
    with torch.inference_mode():
        rows = [runner.prefill([0], [prompt[:cut]], [0])]
        for position in range(cut, len(prompt) - 1):
            rows.append(runner.decode([int(prompt[position])], [position], [0]))
    return torch.cat(rows)


FAMILIES = [
    pytest.param("llama", False, {}, id="llama"),
    pytest.param("llama", True, {}, id="llama-tied"),
    pytest.param("llama", False, {"attention_bias": True, "mlp_bias": True}, id="llama-biases"),
    pytest.param("qwen2", False, {}, id="qwen2"),
    pytest.param("qwen2", True, {}, id="qwen2-tied"),
    pytest.param("qwen3", False, {}, id="qwen3"),
    pytest.param("qwen3", True, {"attention_bias": True}, id="qwen3-tied-bias"),
]


@pytest.mark.parametrize(("model_type", "tied", "changes"), FAMILIES)
def test_the_tree_holds_transformers_parameters_and_gives_its_logits(tmp_path, model_type, tied, changes):
    folder = save_tiny_model(tmp_path / "model", model_type, tied=tied, **changes)
    theirs, ours = transformers_model(folder), load_decoder_model(folder, torch.float32, CPU)
    assert isinstance(ours, CausalLM)
    their_parameters, our_parameters = dict(theirs.named_parameters()), dict(ours.named_parameters())
    assert list(our_parameters) == list(their_parameters)
    for name, parameter in their_parameters.items():
        assert torch.equal(our_parameters[name], parameter), name
        assert not our_parameters[name].requires_grad
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert ours.get_output_embeddings().weight.shape == theirs.get_output_embeddings().weight.shape

    ours_run = runner_logits(ours)
    # The same runner over either tree computes the same operations in the same order.
    torch.testing.assert_close(ours_run, runner_logits(theirs), atol=0, rtol=0)
    # And transformers' own forward agrees, up to summation order.
    with torch.no_grad():
        forward = theirs(PROMPT[None]).logits[0, len(PROMPT) - 5 : -1].float()
    torch.testing.assert_close(ours_run, forward, atol=1e-4, rtol=0)


def test_bf16_parameters_and_fp32_rotary_frequencies_as_transformers_loads_them(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "qwen3")
    theirs = transformers_model(folder, torch.bfloat16)
    ours = load_decoder_model(folder, torch.bfloat16, CPU)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq, atol=0, rtol=0)
    torch.testing.assert_close(runner_logits(ours), runner_logits(theirs), atol=0, rtol=0)


def test_older_config_files_name_the_rope_base_at_the_top(tmp_path):
    """rope_theta beside a null rope_scaling, as config.json files before transformers 5 say it."""
    folder = save_tiny_model(tmp_path / "model", "qwen2")
    config = json.loads((folder / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": theta, "rope_scaling": None}))
    ours = load_decoder_model(folder, torch.float32, CPU)
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, transformers_model(folder).model.rotary_emb.inv_freq)


def test_sharded_checkpoints_load_from_their_index(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, folder / shard, metadata={"format": "pt"})
    index = {"weight_map": {name: shard for shard, shard_names in shards.items() for name in shard_names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ours = load_decoder_model(folder, torch.float32, CPU)
    for name, tensor in tensors.items():
        assert torch.equal(ours.get_parameter(name), tensor), name


def _edit_config(folder: Path, **changes) -> None:
    """config.json with `changes` made (a None value removes the key)."""
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps({key: value for key, value in config.items() if value is not None}))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


NOT_BUILT = {
    "another architecture": lambda f: _edit_config(f, model_type="mistral"),
    "another activation": lambda f: _edit_config(f, hidden_act="gelu"),
    "an unsaid size": lambda f: _edit_config(f, intermediate_size=None),
    "scaled rope": lambda f: _edit_config(
        f,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "partial rotary": lambda f: _edit_config(f, rope_parameters={"rope_theta": 50000.0, "partial_rotary_factor": 0.5}),
    "a quantization": lambda f: _edit_config(f, quantization_config={"quant_method": "fp8"}),
    "a missing tensor": lambda f: _edit_tensors(f, lambda t: t.pop("model.norm.weight")),
    "an unknown tensor": lambda f: _edit_tensors(f, lambda t: t.update({"model.extra.weight": torch.zeros(2)})),
    "a tensor of another shape": lambda f: _edit_tensors(f, lambda t: t.update({"model.norm.weight": torch.ones(33)})),
    "no safetensors": lambda f: (f / "model.safetensors").rename(f / "weights.bin"),
}


@pytest.mark.parametrize("change", list(NOT_BUILT))
def test_a_folder_it_would_build_otherwise_is_left_to_transformers(tmp_path, change):
    folder = save_tiny_model(tmp_path / "model", "llama")
    assert load_decoder_model(folder, torch.float32, CPU) is not None
    NOT_BUILT[change](folder)
    assert load_decoder_model(folder, torch.float32, CPU) is None


def test_the_engine_loads_a_folder_the_tree_does_not_build_through_transformers(tmp_path):
    from transformers import PreTrainedModel

    from polar.inference.engines.base import EngineOptions
    from polar.inference.engines.torch_engine import TorchEngine

    built = save_tiny_model(tmp_path / "built", "llama")
    scaled = save_tiny_model(tmp_path / "scaled", "llama")
    NOT_BUILT["scaled rope"](scaled)
    assert isinstance(TorchEngine(EngineOptions(model=str(built), device="cpu")).model, CausalLM)
    engine = TorchEngine(EngineOptions(model=str(scaled), device="cpu"))
    assert isinstance(engine.model, PreTrainedModel)
    torch.testing.assert_close(runner_logits(engine.model), runner_logits(transformers_model(scaled)), atol=0, rtol=0)


def test_the_engine_starts_on_the_tiny_model_without_transformers():
    """What the tree is for: an inference server's start pays neither transformers nor what it brings."""
    resolve_model("tiny")  # built here: building it needs transformers
    program = (
        "import sys\n"
        "from polar.inference.engines.base import EngineOptions\n"
        "from polar.inference.engines.torch_engine import TorchEngine\n"
        "engine = TorchEngine(EngineOptions(model='tiny'))\n"
        "print(type(engine.model).__name__, type(engine._tokenizer).__name__,"
        " sorted({'transformers', 'torch._dynamo', 'sympy'} & set(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["CausalLM", "FileTokenizer", "[]"]
