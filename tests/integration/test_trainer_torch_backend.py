"""The torch backend on the tiny model against the real inference server: it scores tokens exactly as
the engine sampled them, learns in the direction of the advantage, saves what it loads, and its new
weights reach the server as the next policy version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from polar.inference import sharing
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.server import start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import pack
from trainer.grpo import LossConfig
from trainer.sequences import TrainSequence
from trainer.weight_sync import InferencePool

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPT = [1, 504, 3570, 28, 9174, 30, 2, 198, 1, 520, 9531, 198]


@pytest.fixture
async def server():
    # One for each test: a push leaves its weights behind, and the next push of the same step (the
    # tiny model's seeded sample hardly moves with one step) would change nothing the test can see.
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", max_batch_size=4))
    grpc_server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine, inference_pb2_grpc.InferenceServiceStub(channel), f"127.0.0.1:{port}"
    await channel.close()
    await grpc_server.stop(None)
    await engine.stop()


async def sample(stub, **sampling) -> tuple[list[int], list[float], int]:
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True, **sampling)
    )
    messages = [m async for m in stub.Generate(request)]
    tokens = [t for m in messages for t in m.token_ids]
    return tokens, [x for m in messages for x in m.logprobs], messages[-1].policy_version


def sequence(
    tokens: list[int],
    logprobs: list[float],
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    advantage: float = 1.0,
    name: str = "s/t",
) -> TrainSequence:
    ids = PROMPT + tokens
    mask = np.array([0] * len(PROMPT) + [1] * len(tokens), dtype=bool)
    full = lambda value, dtype: np.where(mask, value, 1.0 if dtype is np.float32 else 0).astype(dtype)  # noqa: E731
    return TrainSequence(
        name=name,
        token_ids=np.array(ids, dtype=np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.array([0.0] * len(PROMPT) + logprobs, dtype=np.float32),
        advantage=advantage,
        token_weight=1.0 / len(tokens),
        temperature=full(temperature, np.float32),
        top_p=full(top_p, np.float32),
        top_k=full(top_k, np.int32),
    )


def backend(**options) -> TorchBackend:
    return TorchBackend(TorchBackendOptions(model="tiny", device="cpu", **options))


def target_logprobs(batch_logprobs: torch.Tensor, batch) -> np.ndarray:
    return batch_logprobs[batch.loss_mask].numpy()


@pytest.mark.parametrize(
    "sampling", [dict(temperature=1.0, top_p=1.0, top_k=0), dict(temperature=0.7, top_p=0.9, top_k=50)]
)
async def test_the_backend_scores_sampled_tokens_as_the_engine_drew_them(server, sampling) -> None:
    _, stub, _ = server
    tokens, logprobs, _ = await sample(stub, seed=7, **sampling)
    [batch] = pack([sequence(tokens, logprobs, **sampling)], max_tokens=256)
    [scored] = backend().logprobs([batch])
    np.testing.assert_allclose(target_logprobs(scored, batch), logprobs, atol=2e-4)


async def test_packed_traces_score_as_they_do_alone(server) -> None:
    _, stub, _ = server
    first = await sample(stub, seed=1, temperature=1.0)
    second = await sample(stub, seed=2, temperature=1.0)
    model = backend()
    sequences = [
        sequence(*first[:2], temperature=1.0, top_p=1.0, top_k=0, name="a/0"),
        sequence(*second[:2], temperature=1.0, top_p=1.0, top_k=0, name="b/0"),
    ]
    [packed] = pack(sequences, max_tokens=256)
    assert packed.input_ids.shape[0] == 1 and packed.tokens == 2 * len(PROMPT) + 24
    [together] = model.logprobs([packed])
    np.testing.assert_allclose(target_logprobs(together, packed), first[1] + second[1], atol=2e-4)


async def test_an_update_moves_the_sampled_tokens_with_the_advantage(server) -> None:
    _, stub, _ = server
    tokens, logprobs, _ = await sample(stub, seed=3, temperature=1.0)
    for advantage in (1.0, -1.0):
        model = backend(lr=1e-2, grad_clip=0.0)
        [batch] = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0, advantage=advantage)], 256)
        before = target_logprobs(model.logprobs([batch])[0], batch).sum()
        result = model.update([batch], LossConfig())
        after = target_logprobs(model.logprobs([batch])[0], batch).sum()
        assert result.trainable_tokens == len(tokens) and result.grad_norm > 0
        assert (after - before) * advantage > 0.1
        # One update, ratio 1: the loss is -mean(advantage * importance weight), the weight capped.
        assert result.stats["clip_fraction"] == 0.0


async def test_a_saved_model_loads_back_exactly(tmp_path: Path, server) -> None:
    _, stub, _ = server
    tokens, logprobs, _ = await sample(stub, seed=4, temperature=1.0)
    model = backend(lr=1e-3)
    [batch] = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0)], 256)
    model.update([batch], LossConfig())
    model.save(tmp_path / "tiny", tmp_path / "optimizer.pt")
    loaded = TorchBackend(TorchBackendOptions(model=str(tmp_path / "tiny"), device="cpu", lr=1e-3))
    loaded.load_optimizer(tmp_path / "optimizer.pt")
    saved = dict(model.hf_weights())
    for name, tensor in loaded.hf_weights():
        assert torch.equal(tensor, saved[name]), name
    # The optimizer carries on identically: the next update gives the same weights.
    model.update([batch], LossConfig())
    loaded.update([batch], LossConfig())
    after = dict(model.hf_weights())
    for name, tensor in loaded.hf_weights():
        assert torch.equal(tensor, after[name]), name


@pytest.mark.parametrize("transport", ["auto", "gloo"])
async def test_pushed_weights_are_the_next_policy_version_and_change_outputs(server, transport) -> None:
    engine, stub, address = server
    names = {name: tuple(t.shape) for name, t in backend().hf_weights()}
    assert names == {name: spec.shape for name, spec in engine.parameter_specs().items()}
    greedy_before, greedy_logprobs_before, version_before = await sample(stub, temperature=0.0)
    model = backend(lr=5e-2, grad_clip=0.0)
    tokens, logprobs, _ = await sample(stub, seed=5, temperature=1.0)
    [batch] = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0)], 256)
    model.update([batch], LossConfig())
    pool = InferencePool([address], transport=transport)
    try:
        result = await asyncio.to_thread(pool.push, model.hf_weights, "step 1")
    finally:
        pool.close()
    # On one machine a CPU server takes the weights through shared memory.
    same_machine = sharing.SHM if sharing.SHM in sharing.transports("cpu") else sharing.STREAM
    assert result.transport == (same_machine if transport == "auto" else transport)
    assert result.policy_version == version_before + 1
    assert result.bytes_sent == sum(t.numel() * t.element_size() for _, t in model.hf_weights())
    greedy_after, greedy_logprobs_after, version_after = await sample(stub, temperature=0.0)
    assert version_after == result.policy_version
    # The tiny model's greedy reply may keep its tokens (its likeliest words are about as likely as
    # one another); their logprobs move.
    moved = np.abs(np.subtract(greedy_logprobs_after, greedy_logprobs_before)).max()
    assert greedy_after != greedy_before or moved > 1e-3
    # The server now scores exactly as the trainer does.
    tokens, logprobs, _ = await sample(stub, seed=6, temperature=1.0)
    [batch] = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0)], 256)
    np.testing.assert_allclose(target_logprobs(model.logprobs([batch])[0], batch), logprobs, atol=2e-4)


async def test_gradient_checkpointing_changes_memory_not_results(server) -> None:
    _, stub, _ = server
    tokens, logprobs, _ = await sample(stub, seed=8, temperature=1.0)
    [batch] = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0)], 256)
    plain, recomputing = backend(lr=1e-3), backend(lr=1e-3, gradient_checkpointing="on")
    # By default a micro-batch holds the model's whole context, and the tiny model's fits in memory.
    assert plain.microbatch_tokens == plain.model.config.max_position_embeddings
    assert not plain.recomputes(plain.microbatch_tokens) and recomputing.recomputes(1)
    first, second = plain.update([batch], LossConfig()), recomputing.update([batch], LossConfig())
    assert first.grad_norm == pytest.approx(second.grad_norm, rel=1e-5) and first.grad_norm > 0
    recomputed = dict(recomputing.hf_weights())
    for name, tensor in plain.hf_weights():
        torch.testing.assert_close(tensor, recomputed[name], rtol=1e-5, atol=1e-7, msg=name)


async def test_auto_recomputes_only_the_micro_batches_too_large_for_memory(server, monkeypatch) -> None:
    _, stub, _ = server
    tokens, logprobs, _ = await sample(stub, seed=9, temperature=1.0)
    small = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0)], 256)
    large = pack(
        [sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0, name=f"s/{i}") for i in range(4)], 256
    )
    assert small[0].tokens < 40 < large[0].tokens
    # A device whose quarter holds the activations of 40 tokens: the 4-trace micro-batch recomputes.
    per_token = backend()._activations_per_token
    monkeypatch.setattr("trainer.backends.torch_backend.device_memory", lambda device: 4 * 40 * per_token)
    auto, plain = backend(lr=1e-3), backend(lr=1e-3, gradient_checkpointing="off")
    recomputed = []
    for layer in auto._recomputable:
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *args, _f=checkpoint, **kwargs: (
            recomputed.append(1) or _f(*args, **kwargs)
        )
    for batches in (small, large):
        before = len(recomputed)
        first, second = auto.update(batches, LossConfig()), plain.update(batches, LossConfig())
        assert first.grad_norm == pytest.approx(second.grad_norm, rel=1e-5)
        assert (len(recomputed) > before) == (batches is large)
    weights = dict(plain.hf_weights())
    for name, tensor in auto.hf_weights():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-5, atol=1e-7, msg=name)


async def test_bf16_computation_keeps_fp32_weights_so_small_updates_land(server) -> None:
    """At RL learning rates AdamW moves a weight by ~lr per step, below half of bf16's spacing for
    most weights: in bf16 parameters the step would round away. The backend computes in bf16 and
    keeps fp32 parameters, so the update lands on them, and sends the weights in bf16."""
    _, stub, _ = server
    tokens, logprobs, _ = await sample(stub, seed=5, temperature=1.0)
    model = backend(dtype="bfloat16", lr=1e-5, grad_clip=0.0)
    [batch] = pack([sequence(tokens, logprobs, temperature=1.0, top_p=1.0, top_k=0)], 256)
    before = {name: p.detach().clone() for name, p in model.model.named_parameters()}
    assert all(p.dtype == torch.float32 for p in before.values())
    model.update([batch], LossConfig())
    moved = changed = 0
    for name, parameter in model.model.named_parameters():
        delta = parameter.detach() - before[name]
        moved += int((delta != 0).sum())
        # What a bf16 parameter would have kept of the same step.
        changed += int((before[name].bfloat16() != parameter.detach().bfloat16()).sum())
    assert changed < moved / 2  # most of the step is finer than bf16 can hold
    assert all(tensor.dtype == torch.bfloat16 for _, tensor in model.hf_weights())
