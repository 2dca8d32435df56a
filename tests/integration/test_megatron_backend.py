"""The megatron backend against the torch backend on the same tiny models and tokens (CPU, gloo, fp32).

At TP=1 (in this process) and TP=2 (two spawned processes: rank 0 leads, rank 1 follows) the
logprobs, the GRPO loss, the gradient norm and the weights after one optimizer step match the torch
backend's; the saved folder loads in transformers. Skipped when megatron-core is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'polar[megatron]')")

from hypothesis import given, settings

from tests.helpers.trace_forests import assert_same_computation, forests, run_tree_job
from tests.helpers.trainer_backends import (
    LOSS,
    LR,
    assert_matches,
    micro_batches,
    run_tensor_parallel,
    save_tiny_model,
    torch_backend_run,
)
from trainer.backends.base import BackendError
from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions, TruncatedSamplingError
from trainer.grpo import LossConfig

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_type,tied", [("qwen3", False), ("qwen2", True), ("llama", False)])
def test_tp1_matches_the_torch_backend(tmp_path, model_type, tied):
    folder = save_tiny_model(tmp_path / "model", model_type, tied)
    reference = torch_backend_run(folder)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", lr=LR))
    assert backend.model_description["vocab_size"] == 300
    batches = micro_batches()
    logprobs = backend.logprobs(batches)
    result = backend.update(batches, LOSS)
    assert_matches(reference, logprobs, result, {name: t.clone() for name, t in backend.hf_weights()})


def test_saved_folder_loads_in_transformers_and_optimizer_state_restores(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "model", "qwen3", False)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", lr=LR))
    backend.update(micro_batches(), LOSS)
    backend.save(tmp_path / "saved", tmp_path / "optimizer.pt")
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").named_parameters())
    for name, tensor in backend.hf_weights():
        assert torch.equal(loaded[name], tensor), name
    reloaded = MegatronBackend(MegatronBackendOptions(model=str(tmp_path / "saved"), dtype="float32", lr=LR))
    reloaded.load_optimizer(tmp_path / "optimizer.pt")
    assert reloaded.optimizer.state_dict()["state"][0]["step"] == 1


def test_truncated_sampling_is_refused_before_any_work(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama", False)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32"))
    batch = micro_batches()[0]
    batch.top_k[batch.loss_mask] = 40
    with pytest.raises(TruncatedSamplingError, match="top_k"):
        backend.logprobs([batch])
    with pytest.raises(BackendError, match="reference"):
        backend.update([batch], LossConfig(kl_coef=0.1))


@pytest.mark.parametrize("model_type,tied", [("qwen3", False), ("qwen2", True)])
def test_tp2_on_gloo_matches_the_torch_backend(tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "model", model_type, tied)
    reference = torch_backend_run(folder)
    ours = run_tensor_parallel(2, folder, tmp_path, "float32")
    assert_matches(reference, ours["logprobs"], ours["result"], ours["weights"])
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").named_parameters())
    for name, tensor in ours["weights"].items():
        assert torch.equal(loaded[name], tensor), name
    assert len(torch.load(tmp_path / "optimizer.pt", weights_only=True)["ranks"]) == 2


@pytest.mark.parametrize("max_tokens,count", [(31, 3), (96, 1)])
def test_data_parallel_on_gloo_matches_one_replica(tmp_path, max_tokens, count):
    """TP=1 x DP=2 with Megatron's DistributedDataParallel and DistributedOptimizer: the summed
    gradients, the norm, the step and the gathered logprobs are one replica's (the torch backend's).
    3 micro-batches: one replica sits out the first round; 1: one replica learns from none."""
    from tests.helpers.trainer_backends import micro_batches as packed

    assert len(packed(max_tokens)) == count
    folder = save_tiny_model(tmp_path / "model", "qwen3", False)
    reference = torch_backend_run(folder, max_tokens=max_tokens)
    ours = run_tensor_parallel(2, folder, tmp_path, "float32", tp_size=1, max_tokens=max_tokens)
    assert_matches(reference, ours["logprobs"], ours["result"], ours["weights"])
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert (saved["tp_size"], saved["dp_size"], len(saved["ranks"])) == (1, 2, 2)


def test_trainer_config_selects_the_megatron_backend(tmp_path):
    from polar.config import TrainerConfig
    from trainer.service import create_backend

    folder = save_tiny_model(tmp_path / "model", "llama", True)
    backend = create_backend(TrainerConfig(backend="megatron", model=str(folder), dtype="float32"), str(folder))
    assert isinstance(backend, MegatronBackend) and backend.name == "megatron"
    assert backend.model_description["model_type"] == "llama"


def test_tensor_parallel_size_must_divide_the_ranks(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama", False)
    with pytest.raises(BackendError, match="must divide the number of ranks"):
        MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", tp_size=2))


def test_recomputation_is_refused_on_the_cpu(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "llama", False)
    with pytest.raises(BackendError, match="needs CUDA"):
        MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", recompute="full"))


def test_weight_sync_streams_the_gathered_weights_with_their_count_up_front(tmp_path):
    from polar.v1 import inference_pb2
    from trainer.weight_sync import tensor_messages

    folder = save_tiny_model(tmp_path / "model", "qwen2", True)
    backend = MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32"))
    weights = backend.hf_weights()
    messages = map(inference_pb2.UpdateWeightsRequest.FromString, tensor_messages(weights, "step 1"))
    header = next(messages)
    names = {message.chunk.name for message in messages}
    assert header.header.tensor_count == len(weights) == len(names) == len(dict(backend.hf_weights()))


# -------------------------------------------------------------------------------------------------
# Shared prefixes: a tree of pieces computes what its traces compute one by one


@pytest.fixture(scope="module")
def tree_backend(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tree") / "model", "qwen3", False)
    return MegatronBackend(MegatronBackendOptions(model=str(folder), dtype="float32", cpu_threads=1))


@settings(max_examples=10, deadline=None)
@given(sequences=forests(vocab=300, max_system=30, truncation=False))
def test_tp1_a_tree_computes_what_the_traces_compute_alone(tree_backend, sequences):
    assert_same_computation(tree_backend, sequences, max_tokens=120, min_saving=1)


def test_tp2_on_gloo_a_tree_computes_what_the_traces_compute_alone(tmp_path):
    folder = save_tiny_model(tmp_path / "model", "qwen2", True)
    shared = run_tree_job(2, folder, tmp_path)
    assert shared[0] == shared[1] > 0
