"""The vLLM engine serving smollm2-135m plus LoRA adapters (vLLM's LoRA), behind the real gRPC server.

Its tokens and logprobs, with the default adapter and with a named one sampled in the same batch, are
those of a Hugging Face forward of the base with that adapter merged (polar/lora.py); a push from a
LoRA trainer's weight sync carries the adapter's bytes alone, advances the policy version, and the
server then serves the new adapter (the old version unloaded, its folder gone, and none of its prefix
cache reused); an unload ends the adapter's generations with an error that says so.

Runs only in .venv-vllm (scripts/setup_vllm.sh). One engine serves every test (start-up ~40 s on 2
cores). Logprob tolerance: that of test_vllm_engine.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run scripts/setup_vllm.sh and use .venv-vllm")

import grpc
import torch

from polar import lora
from polar.inference.engines.base import EngineOptions, WeightUpdateError
from polar.inference.engines.vllm_engine import VLLMEngine
from polar.inference.server import start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.helpers.lora_reference import MODEL, adapter_shapes, base_model, merged_logprobs, random_adapter
from trainer.weight_sync import InferencePool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LOGPROB_ATOL = 2e-3
# 36 tokens: two full blocks of vLLM's prefix cache (16 tokens each), computed under one adapter
# version and asked for again under the next.
PROMPT = [1, 9690, 1229, 28, 314, 1488, 34, 30, 223, 17, 1340, 282, 253, 1025, 30, 2, 198, 504] * 2
RANK, ALPHA = 8, 16.0
NAMED = "run-a"
NAMED_SETTINGS = lora.LoraSettings.parse(4, 8.0, "q_proj,v_proj,down_proj")


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def served(loop):
    """The engine with a zero default adapter of rank 8 on every projection and room for one named
    adapter, behind a gRPC server; (engine, stub, address)."""
    engine = VLLMEngine(
        EngineOptions(
            model=MODEL,
            max_batch_size=4,
            lora_rank=RANK,
            lora_alpha=ALPHA,
            max_adapters=1,
            extra={"max_model_len": "512"},
        )
    )
    server, port = loop.run_until_complete(start_server(engine))

    async def open_channel():  # in the loop: an aio channel belongs to the loop it is made in
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    channel = loop.run_until_complete(open_channel())
    yield engine, inference_pb2_grpc.InferenceServiceStub(channel), f"127.0.0.1:{port}"
    loop.run_until_complete(channel.close())
    loop.run_until_complete(server.stop(None))
    loop.run_until_complete(engine.stop())


@pytest.fixture(scope="module")
def base():
    return base_model()


async def sample(stub, adapter="", max_tokens=10, **sampling):
    """(tokens, logprobs, versions) of one Generate call."""
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        adapter=adapter,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )
    messages = [m async for m in stub.Generate(request)]
    tokens = [t for m in messages for t in m.token_ids]
    versions = [m.policy_version for m in messages for _ in m.token_ids]
    return tokens, [x for m in messages for x in m.logprobs], versions


def assert_served(base, settings, adapter, reply, temperature=1.0):
    tokens, logprobs, _ = reply
    expected = merged_logprobs(base, settings, adapter, PROMPT, tokens, temperature)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_a_push_carries_the_adapter_alone_and_the_server_then_serves_the_new_one(served, loop, base):
    engine, stub, address = served
    settings = lora.LoraSettings.parse(RANK, ALPHA)
    shapes = adapter_shapes(settings)
    assert {name: spec.shape for name, spec in engine.parameter_specs().items()} == shapes
    zero = {name: torch.zeros(shape) for name, shape in shapes.items()}
    # A fresh server's adapter is zero: it serves the base model.
    fresh = loop.run_until_complete(sample(stub, temperature=0.0))
    assert fresh[2] == [0] * 10
    assert_served(base, settings, zero, fresh)

    pool = InferencePool([address], transport="stream")
    try:
        for step, seed in ((1, 11), (2, 12)):
            adapter = random_adapter(shapes, seed)
            held = set(loop.run_until_complete(engine._llm.list_loras()))
            result = loop.run_until_complete(asyncio.to_thread(pool.push, lambda a=adapter: a.items(), f"step {step}"))
            assert result.policy_version == step
            adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
            model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
            assert result.bytes_sent == adapter_bytes < model_bytes / 50
            # The old version is unloaded and its folder removed; one new version is loaded.
            now = set(loop.run_until_complete(engine._llm.list_loras()))
            assert len(now) == 1 and not now & held
            assert len(list(engine._adapter_root.iterdir())) == 1
            # The prompt's blocks in vLLM's prefix cache were computed under the previous version:
            # the new one computes its own.
            greedy = loop.run_until_complete(sample(stub, temperature=0.0))
            assert greedy[2] == [step] * 10 and greedy[0] != fresh[0]
            assert_served(base, settings, adapter, greedy)
        sampled = loop.run_until_complete(sample(stub, temperature=0.8, seed=5))
        assert sampled[2] == [2] * 10
        assert_served(base, settings, adapter, sampled, temperature=0.8)
    finally:
        pool.close()
    # The base is never sent again.
    with pytest.raises(WeightUpdateError, match="'model.norm.weight': this server serves a LoRA adapter"):
        loop.run_until_complete(engine.update_weights({"model.norm.weight": base.model.norm.weight}))


def test_a_named_adapter_samples_beside_the_default_one_and_unloads(served, loop, base, tmp_path: Path):
    engine, stub, _ = served
    named = random_adapter(adapter_shapes(NAMED_SETTINGS), 21)
    lora.save_adapter_tensors(tmp_path / "adapter", named.items(), NAMED_SETTINGS, MODEL)
    load = inference_pb2.LoadAdapterRequest(name=NAMED, path=str(tmp_path / "adapter"), policy_version=7)
    info = loop.run_until_complete(stub.LoadAdapter(load)).adapter
    assert (info.rank, info.policy_version, list(info.targets)) == (4, 7, list(NAMED_SETTINGS.targets))
    with pytest.raises(grpc.aio.AioRpcError) as full:
        loop.run_until_complete(stub.LoadAdapter(inference_pb2.LoadAdapterRequest(name="run-b", rank=4, alpha=8.0)))
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    default_version = engine.policy_version

    async def both():
        return await asyncio.gather(
            sample(stub, adapter=NAMED, temperature=1.0, seed=3), sample(stub, temperature=1.0, seed=3)
        )

    mine, theirs = loop.run_until_complete(both())
    assert mine[2] == [7] * 10 and theirs[2] == [default_version] * 10
    assert_served(base, NAMED_SETTINGS, named, mine)
    assert mine[0] != theirs[0]

    async def unloaded_while_sampling():
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=PROMPT,
            adapter=NAMED,
            sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True, temperature=1.0),
        )
        call = stub.Generate(request)
        await anext(aiter(call))
        ended = (await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=NAMED))).ended_generations
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in call:
                pass
        return ended, error.value

    ended, error = loop.run_until_complete(asyncio.wait_for(unloaded_while_sampling(), 120))
    assert ended == 1 and f"LoRA adapter {NAMED!r} was unloaded while this generation ran" in error.details()
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        loop.run_until_complete(sample(stub, adapter=NAMED))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    info = loop.run_until_complete(stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
    assert [a.name for a in info.adapters] == [""] and info.max_adapters == 1
