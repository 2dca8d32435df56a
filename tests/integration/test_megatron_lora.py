"""LoRA in the megatron backend (CPU, gloo, fp32 as the other megatron tests) at TP=1, TP=2 and
TP=1 x DP=2.

A random adapter (B nonzero, else dL/dA is zero) is written by the torch backend in PEFT's layout.
The megatron backend trains it: its logprobs and loss equal those of the model with the adapter
merged, and the adapters' gradients, the gradient norm and the adapters after one step equal the
torch backend's on the same adapter and batch (tests/integration/test_lora_torch_backend.py shows
those are the chain rule applied to the merged weights' gradients). A push and a checkpoint hold
the adapter alone, under the torch backend's names and shapes; TP=2's equal TP=1's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'polar[megatron]')")

from polar import lora
from tests.helpers.trainer_backends import (
    ATOL,
    LOSS,
    LR,
    WEIGHT_MAX_STEPS,
    assert_matches,
    micro_batches,
    run_tensor_parallel,
    save_tiny_model,
)
from trainer.backends.base import BackendError
from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0
EVERY_PROJECTION = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# Some of each fused layer's projections only: the others' places in its output stay zero.
SOME_PROJECTIONS = "k_proj,o_proj,up_proj"


def write_random_adapter(folder: Path, model: Path, targets: str) -> Path:
    """A PEFT folder, written by the torch backend, of an adapter with random A and B."""
    backend = TorchBackend(
        TorchBackendOptions(
            model=str(model), device="cpu", dtype="float32", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets
        )
    )
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(backend.model):
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    backend.save(folder, folder.parent / "unused-optimizer.pt")
    return folder


def update_capturing_gradients(backend, names: dict[str, str], batches):
    """backend.update, and each adapter matrix's gradient (by PEFT name) as the optimizer got it;
    `names`: the backend's parameter name -> PEFT name."""
    gradients = {}
    step = backend._step
    parameters = dict(backend.model.named_parameters())

    def capture() -> None:
        gradients.update({hf: parameters[name].grad.clone() for name, hf in names.items()})
        step()

    backend._step = capture
    return backend.update(batches, LOSS), gradients


def torch_lora_run(model: Path, adapter: Path):
    """The torch backend training `adapter`: (logprobs, result, adapters after the step), gradients."""
    backend = TorchBackend(
        TorchBackendOptions(model=str(model), device="cpu", dtype="float32", lr=LR, adapter=str(adapter))
    )
    batches = micro_batches()
    logprobs = backend.logprobs(batches)
    names = {name: name for name, _ in lora.adapter_parameters(backend.model)}
    result, gradients = update_capturing_gradients(backend, names, batches)
    return (logprobs, result, {name: t.clone() for name, t in backend.hf_weights()}), gradients


def merged_run(model: Path, adapter: Path, out: Path):
    """Logprobs and the update's loss of the plain model with the adapter merged (torch backend)."""
    lora.write_merged_model(adapter, out, base_model=str(model))
    backend = TorchBackend(TorchBackendOptions(model=str(out), device="cpu", dtype="float32", lr=LR))
    batches = micro_batches()
    return backend.logprobs(batches), backend.update(batches, LOSS).loss


def assert_same_adapters(ours: dict, theirs: dict, atol: float = 0.0) -> None:
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, name
        torch.testing.assert_close(ours[name], tensor, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize(
    "model_type,tied,targets", [("qwen3", False, EVERY_PROJECTION), ("qwen2", True, SOME_PROJECTIONS)]
)
def test_tp1_trains_the_adapter_as_the_torch_backend_does(tmp_path, model_type, tied, targets):
    folder = save_tiny_model(tmp_path / "model", model_type, tied)
    adapter = write_random_adapter(tmp_path / "adapter", folder, targets)
    merged_logprobs, merged_loss = merged_run(folder, adapter, tmp_path / "merged")
    reference, reference_gradients = torch_lora_run(folder, adapter)

    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", lr=LR, adapter=str(adapter)))
    assert backend.model_description["lora_rank"] == RANK
    initial = dict(backend.hf_weights())
    assert_same_adapters(initial, dict(lora.read_adapter(adapter).tensors))
    batches = micro_batches()
    logprobs = backend.logprobs(batches)
    for ours, theirs in zip(logprobs, merged_logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    names = {matrix.megatron: matrix.hf for matrix in backend.adapters.values()}
    result, gradients = update_capturing_gradients(backend, names, batches)
    assert result.loss == pytest.approx(merged_loss, abs=ATOL)
    assert set(gradients) == set(reference_gradients)
    for name, gradient in reference_gradients.items():
        assert float(gradient.abs().max()) > 0, name  # the test can see a wrongly mapped gradient
        torch.testing.assert_close(gradients[name], gradient, atol=1e-6, rtol=1e-4, msg=name)
    assert_matches(reference, logprobs, result, dict(backend.hf_weights()))

    # The optimizer holds the adapters alone; the base did not move.
    trained = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert trained == {id(backend.trained[name]) for name in names}
    assert all(not p.requires_grad for name, p in backend.parameters.items())

    backend.save(tmp_path / "saved", tmp_path / "optimizer.pt")
    saved = lora.read_adapter(tmp_path / "saved")
    assert saved.settings == lora.read_adapter(adapter).settings
    assert_same_adapters(dict(saved.tensors), dict(backend.hf_weights()))
    reloaded = MegatronBackend(
        MegatronBackendOptions(model=str(folder), dtype="float32", lr=LR, adapter=str(tmp_path / "saved"))
    )
    reloaded.load_optimizer(tmp_path / "optimizer.pt")
    assert reloaded.optimizer.state_dict()["state"][0]["step"] == 1


def test_tp2_on_gloo_trains_the_adapter_as_tp1_does(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "qwen3", False)
    adapter = write_random_adapter(tmp_path / "adapter", folder, EVERY_PROJECTION)
    reference, reference_gradients = torch_lora_run(folder, adapter)
    tp1 = run_tensor_parallel(1, folder, tmp_path / "tp1", "float32", adapter=str(adapter))
    tp2 = run_tensor_parallel(2, folder, tmp_path / "tp2", "float32", adapter=str(adapter))
    # Split over two ranks and gathered back: the same adapter to the last bit.
    assert_same_adapters(tp2["initial"], dict(lora.read_adapter(adapter).tensors))
    assert_matches(reference, tp2["logprobs"], tp2["result"], tp2["weights"])
    for name, gradient in reference_gradients.items():
        torch.testing.assert_close(tp2["gradients"][name], gradient, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(tp2["gradients"][name], tp1["gradients"][name], atol=1e-6, rtol=1e-4, msg=name)
    # The checkpoint of TP=2 is TP=1's (one AdamW step apart by rounding at most: see assert_matches).
    ours, theirs = (dict(lora.read_adapter(tmp_path / run / "saved").tensors) for run in ("tp2", "tp1"))
    assert_same_adapters(ours, theirs, atol=WEIGHT_MAX_STEPS * LR)
    assert_same_adapters(ours, tp2["weights"])
    assert len(torch.load(tmp_path / "tp2" / "optimizer.pt", weights_only=True)["ranks"]) == 2


def test_the_reference_policy_is_the_base_model(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama", False)
    adapter = write_random_adapter(tmp_path / "adapter", folder, EVERY_PROJECTION)
    base = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32"))
    adapted = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", adapter=str(adapter)))
    batches = micro_batches()
    assert adapted.reference is None  # no copy of the model is kept
    for ours, theirs, served in zip(
        adapted.logprobs(batches, reference=True), base.logprobs(batches), adapted.logprobs(batches), strict=True
    ):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        assert not torch.allclose(served, theirs, atol=1e-3)


def test_a_new_adapter_starts_as_the_torch_backend_s_and_serves_the_base_model(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "qwen3", False)
    options = {"lora_rank": RANK, "lora_alpha": ALPHA, "lora_targets": "q_proj,down_proj"}
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", **options))
    weights = dict(backend.hf_weights())
    assert len(backend.hf_weights()) == len(weights) == 2 * 2 * 2  # 2 layers x 2 projections x (A, B)
    torch_weights = dict(
        TorchBackend(TorchBackendOptions(model=str(folder), device="cpu", dtype="float32", **options)).hf_weights()
    )
    # The same names in the same order (PEFT's), of the same shapes.
    assert [(name, t.shape) for name, t in weights.items()] == [(name, t.shape) for name, t in torch_weights.items()]
    assert all(float(t.abs().max()) == 0 for name, t in weights.items() if name.endswith("lora_B.weight"))
    assert all(float(t.abs().max()) > 0 for name, t in weights.items() if name.endswith("lora_A.weight"))
    base = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32"))
    batches = micro_batches()
    for ours, theirs in zip(backend.logprobs(batches), base.logprobs(batches), strict=True):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_a_target_the_backend_cannot_adapt_is_refused(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama", False)
    with pytest.raises(BackendError, match="lm_head match no projection the megatron backend adapts"):
        MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", lora_rank=4, lora_targets="lm_head"))


def test_data_parallel_on_gloo_trains_the_adapter_alone(tmp_path):
    """TP=1 x DP=2: Megatron's DistributedDataParallel and DistributedOptimizer over the adapters."""
    folder = save_tiny_model(tmp_path / "model", "qwen3", False)
    adapter = write_random_adapter(tmp_path / "adapter", folder, EVERY_PROJECTION)
    reference, reference_gradients = torch_lora_run(folder, adapter)
    ours = run_tensor_parallel(2, folder, tmp_path, "float32", tp_size=1, adapter=str(adapter))
    assert_matches(reference, ours["logprobs"], ours["result"], ours["weights"])
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    # Each replica's optimizer holds its slice of the adapters, and nothing of the base model.
    adapter_numbers = sum(t.numel() for t in reference[2].values())
    held = [sum(state["exp_avg"].numel() for state in rank["adam"]["state"].values()) for rank in saved["ranks"]]
    assert all(held) and sum(held) == adapter_numbers


def test_a_run_resumes_from_its_adapter_checkpoint(tmp_path):
    from polar.config import TrainerConfig
    from trainer.service import create_backend

    folder = save_tiny_model(tmp_path / "model", "llama", False)
    adapter = write_random_adapter(tmp_path / "adapter", folder, "q_proj,v_proj")
    config = TrainerConfig(backend="megatron", model=str(folder), dtype="float32", lora_rank=8, lora_targets="o_proj")
    backend = create_backend(config, str(adapter))  # a checkpoint's model folder: the adapter over [trainer] model
    assert backend.folder == folder
    assert backend.lora == lora.read_adapter(adapter).settings  # the checkpoint's settings, not the config's
    assert_same_adapters(dict(backend.hf_weights()), dict(lora.read_adapter(adapter).tensors))
