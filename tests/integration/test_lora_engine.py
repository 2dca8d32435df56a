"""The torch engine serving the tiny model plus a LoRA adapter: its tokens and logprobs are those of a
Hugging Face forward of the merged weights; a push from a LoRA trainer carries the adapter's bytes
alone, advances the policy version, and the server then serves the new adapter (the old one gone);
`polar merge` writes the model the adapter's server serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from polar import lora
from polar.inference.engines import EngineOptions, WeightUpdateError, create_engine
from polar.inference.models import resolve_model
from polar.inference.server import start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import pack
from trainer.grpo import LossConfig
from trainer.sequences import TrainSequence
from trainer.weight_sync import InferencePool, WeightSyncError

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPT = [1, 504, 3570, 28, 9174, 30, 2, 198, 1, 520, 9531, 198]
RANK, ALPHA = 4, 8.0


async def serving(**options):
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", max_batch_size=4, **options))
    grpc_server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return engine, grpc_server, channel, f"127.0.0.1:{port}"


async def close(engine, grpc_server, channel) -> None:
    await channel.close()
    await grpc_server.stop(None)
    await engine.stop()


async def sample(channel, **sampling) -> tuple[list[int], list[float], int]:
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True, **sampling)
    )
    messages = [m async for m in stub.Generate(request)]
    tokens = [t for m in messages for t in m.token_ids]
    return tokens, [x for m in messages for x in m.logprobs], messages[-1].policy_version


def lora_backend(**options) -> TorchBackend:
    return TorchBackend(
        TorchBackendOptions(model="tiny", device="cpu", lora_rank=RANK, lora_alpha=ALPHA, cpu_threads=1, **options)
    )


def trained_adapter(folder: Path) -> Path:
    """A tiny-model adapter with random matrices (a trained one would move the model as little)."""
    backend = lora_backend()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(backend.model):
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    backend.save(folder, folder.parent / "optimizer.pt")
    return folder


def merged_logprobs(adapter: Path, tokens: list[int]) -> np.ndarray:
    """Teacher-forced logprobs of `tokens` after PROMPT, from the plain Hugging Face model with the
    adapter merged into its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    saved = lora.read_adapter(adapter)
    lora.attach(model, saved.settings)
    lora.load_adapter_tensors(model, saved.tensors)
    lora.merge_into(model)
    assert not any(lora.is_adapter_name(name) for name, _ in model.named_parameters())
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


async def test_a_server_without_an_adapter_says_so_to_a_lora_trainer() -> None:
    engine, grpc_server, channel, address = await serving()
    pool = InferencePool([address], transport="stream")
    try:
        with pytest.raises(WeightSyncError, match="sends a LoRA adapter, and this server serves none"):
            await asyncio.to_thread(pool.push, lora_backend().hf_weights, "step 1")
    finally:
        pool.close()
        await close(engine, grpc_server, channel)


async def test_the_engine_serves_what_the_merged_model_computes(tmp_path: Path) -> None:
    adapter = trained_adapter(tmp_path / "adapter")
    engine, grpc_server, channel, _ = await serving(adapter=str(adapter))
    try:
        assert set(engine.parameter_specs()) == {name for name, _ in lora_backend().hf_weights()}
        sampled, sampled_logprobs, _ = await sample(channel, seed=3, temperature=1.0)
        greedy, greedy_logprobs, _ = await sample(channel, temperature=0.0)
    finally:
        await close(engine, grpc_server, channel)
    np.testing.assert_allclose(sampled_logprobs, merged_logprobs(adapter, sampled), atol=2e-4)
    np.testing.assert_allclose(greedy_logprobs, merged_logprobs(adapter, greedy), atol=2e-4)
    base, grpc_server, channel, _ = await serving()
    try:
        base_greedy, base_logprobs, _ = await sample(channel, temperature=0.0)
    finally:
        await close(base, grpc_server, channel)
    assert greedy != base_greedy or np.abs(np.subtract(greedy_logprobs, base_logprobs)).max() > 1e-2


async def test_polar_merge_writes_the_model_the_adapter_engine_serves(tmp_path: Path, capsys) -> None:
    from polar.app.cli import main

    adapter = trained_adapter(tmp_path / "adapter")
    assert main(["merge", str(adapter), str(tmp_path / "merged")]) == 0
    assert "polar merge:" in capsys.readouterr().out
    assert main(["merge", str(adapter), str(tmp_path / "merged")]) == 1  # an existing folder is kept
    assert "exists already" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "merged"), str(tmp_path / "again")]) == 1
    assert "no LoRA checkpoint" in capsys.readouterr().err
    replies = []
    for options in (dict(adapter=str(adapter)), dict(model=str(tmp_path / "merged"))):
        engine = create_engine("torch", EngineOptions(**{"model": "tiny", "device": "cpu", **options}))
        grpc_server, port = await start_server(engine)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            replies.append(await sample(channel, seed=9, temperature=1.0))
        finally:
            await close(engine, grpc_server, channel)
    (tokens, logprobs, _), (merged_tokens, merged_logprobs_, _) = replies
    assert tokens == merged_tokens
    np.testing.assert_allclose(logprobs, merged_logprobs_, atol=2e-4)


def sequence(tokens: list[int], logprobs: list[float]) -> TrainSequence:
    ids = PROMPT + tokens
    mask = np.array([0] * len(PROMPT) + [1] * len(tokens), dtype=bool)
    return TrainSequence(
        name="s/t",
        token_ids=np.array(ids, dtype=np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.array([0.0] * len(PROMPT) + logprobs, dtype=np.float32),
        advantage=1.0,
        token_weight=1.0 / len(tokens),
        temperature=np.ones(len(ids), np.float32),
        top_p=np.ones(len(ids), np.float32),
        top_k=np.zeros(len(ids), np.int32),
    )


async def test_a_push_sends_the_adapter_alone_and_the_server_serves_the_new_one() -> None:
    engine, grpc_server, channel, address = await serving(lora_rank=RANK, lora_alpha=ALPHA)
    model = lora_backend(lr=5e-2, grad_clip=0.0)
    pool = InferencePool([address], transport="stream")
    try:
        # A fresh server's adapter is zero: it serves the base model, as the fresh trainer does.
        tokens, logprobs, version = await sample(channel, seed=5, temperature=1.0)
        [batch] = pack([sequence(tokens, logprobs)], 256)
        [scored] = model.logprobs([batch])
        np.testing.assert_allclose(scored[batch.loss_mask].numpy(), logprobs, atol=2e-4)
        for step in (1, 2):
            model.update([batch], LossConfig())
            result = await asyncio.to_thread(pool.push, model.hf_weights, f"step {step}")
            assert result.policy_version == version + step
            adapter_bytes = sum(t.numel() * t.element_size() for _, t in model.hf_weights())
            model_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            assert result.bytes_sent == adapter_bytes < model_bytes / 10
            # The server now scores exactly as the trainer's newest adapter does.
            tokens, logprobs, served_version = await sample(channel, seed=5 + step, temperature=1.0)
            assert served_version == result.policy_version
            [check] = pack([sequence(tokens, logprobs)], 256)
            [scored] = model.logprobs([check])
            np.testing.assert_allclose(scored[check.loss_mask].numpy(), logprobs, atol=2e-4)
        # The base is never sent again: a full update is not one this server takes.
        with pytest.raises(WeightUpdateError, match="'model.embed_tokens.weight': this server serves a LoRA adapter"):
            await engine.update_weights({"model.embed_tokens.weight": engine.model.model.embed_tokens.weight})
    finally:
        pool.close()
        await close(engine, grpc_server, channel)
