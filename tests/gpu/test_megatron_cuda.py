"""The megatron backend on CUDA: the CPU tier's checks at TP=1 (one GPU), TP=2 and TP=1 x DP=2 (two
GPUs, NCCL).

Runs on the device machine only (`python -m pytest -m gpu tests/gpu/test_megatron_cuda.py`); skipped
without CUDA, without megatron-core, and (TP=2) without two GPUs.

fp32: logprobs and loss within 1e-4 of the torch backend on the same GPU, and the weights after one
AdamW step as on the CPU (at most 10% of a step on any element, 0.1% on average).
Recomputation ("selective", "full"), the compiled SwiGLU and the compiled RoPE give the fp32 results
too.
bf16 (the training dtype): two bf16 implementations round differently, so each is compared with the
fp32 truth instead: the megatron backend's largest logprob error may be at most twice the torch
backend's plus 0.02 nats, and its loss error at most twice the torch backend's plus 1e-3. Weights
after one step are not compared in bf16: a step of lr = 1e-3 is about one bf16 unit of these weights.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'polar[megatron]')")

from tests.helpers.trainer_backends import assert_matches, run_tensor_parallel, save_tiny_model, torch_backend_run  # noqa: E402

FP32_ATOL = 1e-4  # cuBLAS and SDPA kernels order their sums differently from each other


def _needs_gpus(count: int) -> None:
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3", tied=False)


@pytest.fixture(scope="module")
def torch_fp32(folder):
    return torch_backend_run(folder, device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def torch_bf16(folder):
    return torch_backend_run(folder, device="cuda", dtype="bfloat16")


def _max_error(logprobs, truth) -> float:
    return max(float((ours - theirs).abs().max()) for ours, theirs in zip(logprobs, truth, strict=True))


def _assert_bf16_close(ours, torch_bf16, torch_fp32) -> None:
    logprobs, result, _ = ours
    truth_logprobs, truth_result, _ = torch_fp32
    yardstick_logprobs, yardstick_result, _ = torch_bf16
    ours_error = _max_error(logprobs, truth_logprobs)
    torch_error = _max_error(yardstick_logprobs, truth_logprobs)
    assert ours_error <= 2 * torch_error + 0.02, (ours_error, torch_error)
    ours_loss_error = abs(result.loss - truth_result.loss)
    torch_loss_error = abs(yardstick_result.loss - truth_result.loss)
    assert ours_loss_error <= 2 * torch_loss_error + 1e-3, (ours_loss_error, torch_loss_error)
    assert result.trainable_tokens == truth_result.trainable_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp1(tmp_path, folder, torch_fp32, torch_bf16, dtype):
    ours = run_tensor_parallel(1, folder, tmp_path, dtype)
    ours = (ours["logprobs"], ours["result"], ours["weights"])
    if dtype == "float32":
        assert_matches(torch_fp32, *ours, atol=FP32_ATOL)
    else:
        _assert_bf16_close(ours, torch_bf16, torch_fp32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_nccl(tmp_path, folder, torch_fp32, torch_bf16, dtype):
    _needs_gpus(2)
    ours = run_tensor_parallel(2, folder, tmp_path, dtype)
    ours = (ours["logprobs"], ours["result"], ours["weights"])
    if dtype == "float32":
        assert_matches(torch_fp32, *ours, atol=FP32_ATOL)
    else:
        _assert_bf16_close(ours, torch_bf16, torch_fp32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_data_parallel_nccl(tmp_path, folder, torch_fp32, torch_bf16, dtype):
    """Two replicas (Megatron's DistributedDataParallel and DistributedOptimizer: in bf16, fp32 main
    weights) learn from one micro-batch each."""
    _needs_gpus(2)
    ours = run_tensor_parallel(2, folder, tmp_path, dtype, tp_size=1)
    ours = (ours["logprobs"], ours["result"], ours["weights"])
    if dtype == "float32":
        assert_matches(torch_fp32, *ours, atol=FP32_ATOL)
    else:
        _assert_bf16_close(ours, torch_bf16, torch_fp32)


@pytest.mark.parametrize("recompute,fused", [("selective", False), ("full", False), ("none", True)])
def test_recomputation_and_fusion_change_nothing(tmp_path, folder, torch_fp32, recompute, fused):
    """Recomputed activations (Megatron's checkpointing needs CUDA's RNG state: GPU only) and the
    compiled SwiGLU and RoPE give the same logprobs, loss and step."""
    ours = run_tensor_parallel(1, folder, tmp_path, "float32", recompute, fused_swiglu=fused, fused_rope=fused)
    assert_matches(torch_fp32, ours["logprobs"], ours["result"], ours["weights"], atol=FP32_ATOL)


def test_auto_recomputes_only_the_large_micro_batches_and_changes_nothing(tmp_path, folder, torch_fp32):
    """recompute "auto" switches Megatron's whole-layer recomputation per micro-batch (here: above 40
    tokens, of micro-batches of 45 and 32): the same logprobs, loss and step as the torch backend."""
    ours = run_tensor_parallel(1, folder, tmp_path, "float32", "auto", recompute_above=40)
    # The update's forward passes (the scoring ones, without gradients, never recompute).
    assert {(45, "full"), (32, None)} <= set(ours["granularities"])
    assert_matches(torch_fp32, ours["logprobs"], ours["result"], ours["weights"], atol=FP32_ATOL)
