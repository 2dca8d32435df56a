"""Two LoRA runs on one inference server (the torch engine holding named adapters): each run's
sessions sample from its own adapter alone (their logprobs are a Hugging Face forward of the base
with that adapter merged, in batches that mix the two), each run's pushes touch its adapter alone
and its policy version alone, and a run's adapter unloads; an adapter the server does not hold is a
clear error everywhere."""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import torch

from polar import lora
from polar.config import TrainerConfig
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.engines.base import AdapterLoad
from polar.inference.models import resolve_model
from polar.inference.server import start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.weight_sync import InferencePool, WeightSyncError

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# 36 tokens: two full blocks of the prefix cache, which a second adapter must not reuse.
PROMPT = [1, 504, 3570, 28, 9174, 30, 2, 198, 1, 520, 9531, 198] * 3
RANK, ALPHA = 4, 8.0
TARGETS = "q_proj,v_proj,up_proj"


def trainer(seed: int) -> TorchBackend:
    """A run's trainer whose adapter holds random matrices (as a trained one would, only more so)."""
    backend = TorchBackend(
        TorchBackendOptions(
            model="tiny", device="cpu", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS, cpu_threads=1
        )
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(backend.model):
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    return backend


def merged_logprobs(backend: TorchBackend | None, tokens: list[int]) -> np.ndarray:
    """Teacher-forced logprobs of `tokens` after PROMPT from the plain Hugging Face model with the
    trainer's adapter merged into its weights (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    if backend is not None:
        lora.attach(model, lora.LoraSettings.parse(RANK, ALPHA, TARGETS))
        lora.load_adapter_tensors(model, dict(backend.hf_weights()))
        lora.merge_into(model)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


async def sample(stub, adapter: str, seed: int) -> tuple[list[int], list[float], int]:
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        adapter=adapter,
        sampling=common_pb2.SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=seed),
    )
    messages = [m async for m in stub.Generate(request)]
    versions = {m.policy_version for m in messages}
    assert len(versions) == 1
    return [t for m in messages for t in m.token_ids], [x for m in messages for x in m.logprobs], versions.pop()


async def sample_mixed(stub, adapters: dict[str, TorchBackend | None], versions: dict[str, int]) -> None:
    """Sessions of every adapter at once (one batch mixes them): each samples its own adapter's
    distribution, at its own version."""
    names = list(adapters) * 2
    replies = await asyncio.gather(*(sample(stub, name, seed) for seed, name in enumerate(names)))
    for name, (tokens, logprobs, version) in zip(names, replies):
        assert version == versions[name], name
        np.testing.assert_allclose(logprobs, merged_logprobs(adapters[name], tokens), atol=2e-4, err_msg=name)


async def test_two_runs_share_a_server_each_sampling_and_pushing_its_own_adapter() -> None:
    engine = create_engine(
        "torch",
        EngineOptions(model="tiny", device="cpu", max_batch_size=8, lora_rank=RANK, lora_alpha=ALPHA, max_adapters=2),
    )
    grpc_server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    address = f"127.0.0.1:{port}"
    runs = {name: InferencePool([address], transport="stream", adapter=name) for name in ("run-a", "run-b")}
    first, second = trainer(seed=1), trainer(seed=2)
    try:
        for pool in runs.values():
            await asyncio.to_thread(pool.load_adapter, RANK, ALPHA, TARGETS, 0)
        info = (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
        assert [(a.name, a.policy_version) for a in info.adapters] == [("", 0), ("run-a", 0), ("run-b", 0)]
        assert info.max_adapters == 2 and list(info.adapters[1].targets) == TARGETS.split(",")

        # Run A pushes: its adapter and version move; run B's and the default stay as they were.
        pushed = await asyncio.to_thread(runs["run-a"].push, first.hf_weights, "a step 1")
        assert pushed.policy_version == 1
        assert pushed.bytes_sent == sum(t.numel() * t.element_size() for _, t in first.hf_weights())
        await sample_mixed(stub, {"run-a": first, "run-b": None, "": None}, {"run-a": 1, "run-b": 0, "": 0})

        # Run B pushes its own (other) adapter twice, run A once more: versions count per run.
        for step in (1, 2):
            pushed = await asyncio.to_thread(runs["run-b"].push, second.hf_weights, f"b step {step}")
            assert pushed.policy_version == step
        with torch.no_grad():
            for _, parameter in lora.adapter_parameters(first.model):
                parameter.mul_(-1.0)
        assert (await asyncio.to_thread(runs["run-a"].push, first.hf_weights, "a step 2")).policy_version == 2
        await sample_mixed(stub, {"run-a": first, "run-b": second, "": None}, {"run-a": 2, "run-b": 2, "": 0})
        tokens_a, logprobs_a, _ = await sample(stub, "run-a", seed=7)
        tokens_b, logprobs_b, _ = await sample(stub, "run-b", seed=7)
        assert tokens_a != tokens_b or np.abs(np.subtract(logprobs_a, logprobs_b)).max() > 1e-2

        # Run A ends: its adapter goes; run B's sessions go on as before, and its room is free again.
        await asyncio.to_thread(runs["run-a"].unload_adapter)
        info = (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
        assert [(a.name, a.policy_version) for a in info.adapters] == [("", 0), ("run-b", 2)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await sample(stub, "run-a", seed=1)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no LoRA adapter 'run-a' (it holds 'run-b')" in refused.value.details()
        with pytest.raises(WeightSyncError, match="NOT_FOUND: this server holds no LoRA adapter 'run-a'"):
            await asyncio.to_thread(runs["run-a"].push, first.hf_weights, "a step 3")
        await sample_mixed(stub, {"run-b": second}, {"run-b": 2})
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="run-a"))
        assert again.value.code() == grpc.StatusCode.NOT_FOUND
        # A new run takes the freed room from zero: it serves the base model until it pushes.
        await asyncio.to_thread(runs["run-a"].load_adapter, RANK, ALPHA, TARGETS, 0)
        await sample_mixed(stub, {"run-a": None, "run-b": second}, {"run-a": 0, "run-b": 2})
    finally:
        for pool in runs.values():
            pool.close()
        await channel.close()
        await grpc_server.stop(None)
        await engine.stop()


async def test_loading_an_adapter_that_cannot_be_held_says_why() -> None:
    engine = create_engine(
        "torch", EngineOptions(model="tiny", device="cpu", max_batch_size=2, lora_rank=RANK, max_adapters=1)
    )
    grpc_server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = inference_pb2_grpc.InferenceServiceStub(channel)

    async def refused(code: grpc.StatusCode, **request) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.LoadAdapter(inference_pb2.LoadAdapterRequest(**request))
        assert error.value.code() == code, error.value.details()
        return error.value.details()

    try:
        assert "needs a name" in await refused(grpc.StatusCode.INVALID_ARGUMENT, rank=RANK, alpha=ALPHA)
        assert "rank 8 is above the server's lora_rank 4" in await refused(
            grpc.StatusCode.INVALID_ARGUMENT, name="wide", rank=8, alpha=ALPHA
        )
        assert "lm_head, which the server's lora_targets" in await refused(
            grpc.StatusCode.INVALID_ARGUMENT, name="head", rank=RANK, alpha=ALPHA, targets="lm_head"
        )
        assert "not a readable adapter config" in await refused(
            grpc.StatusCode.INVALID_ARGUMENT, name="gone", path="no-such-folder"
        )
        await stub.LoadAdapter(inference_pb2.LoadAdapterRequest(name="a", rank=2, alpha=ALPHA, targets="q_proj"))
        assert "holds an adapter 'a' already" in await refused(
            grpc.StatusCode.ALREADY_EXISTS, name="a", rank=RANK, alpha=ALPHA
        )
        assert "max_adapters" in await refused(grpc.StatusCode.RESOURCE_EXHAUSTED, name="b", rank=RANK, alpha=ALPHA)
        replaced = await stub.LoadAdapter(
            inference_pb2.LoadAdapterRequest(name="a", rank=RANK, alpha=ALPHA, policy_version=7, replace=True)
        )
        assert (replaced.adapter.rank, replaced.adapter.policy_version) == (RANK, 7)
        with pytest.raises(grpc.aio.AioRpcError) as default:
            await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=""))
        assert default.value.code() == grpc.StatusCode.NOT_FOUND
        assert "default adapter cannot be unloaded" in default.value.details()
    finally:
        await channel.close()
        await grpc_server.stop(None)
        await engine.stop()


async def test_a_server_without_room_for_adapters_refuses_them_by_name() -> None:
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", max_batch_size=2))
    grpc_server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as load:
            await stub.LoadAdapter(inference_pb2.LoadAdapterRequest(name="a", rank=RANK, alpha=ALPHA))
        assert load.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "max_adapters" in load.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as generate:
            await sample(stub, "a", seed=1)
        assert generate.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no LoRA adapter 'a'" in generate.value.details()
    finally:
        await channel.close()
        await grpc_server.stop(None)
        await engine.stop()


async def test_the_gateway_samples_each_session_from_its_task_s_adapter() -> None:
    import openai

    from polar.testing.gateway import running_gateway

    engine = create_engine(
        "torch", EngineOptions(model="tiny", device="cpu", max_batch_size=2, lora_rank=RANK, max_adapters=1)
    )
    async with running_gateway(engine=engine, envoy=False) as gw:
        # The run's adapter is served as version 7 (a resumed run's), the default as 0: each record's
        # version says which one sampled it.
        await engine.load_adapter(AdapterLoad(name="run-a", rank=RANK, alpha=ALPHA, policy_version=7))
        store = gw.running.store
        keys = {adapter: store.open(task_id=f"t-{adapter}", adapter=adapter).key for adapter in ("run-a", "")}
        for key in keys.values():
            client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
            )
        versions = {adapter: [r.policy_version for r in gw.records(key)] for adapter, key in keys.items()}
        assert versions == {"run-a": [7], "": [0]}
        assert store.find(keys["run-a"]).to_proto().adapter == "run-a"
        # A session whose run ended (its adapter unloaded) gets an error, not another adapter's tokens.
        await engine.unload_adapter("run-a")
        client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=keys["run-a"], max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert "no LoRA adapter 'run-a'" in str(refused.value)


async def test_unloading_ends_the_adapter_s_running_generations_and_no_other() -> None:
    from polar.inference.engines.base import FinishReason, GenerationEnd, GenerationRequest, SamplingConfig

    engine = create_engine(
        "torch", EngineOptions(model="tiny", device="cpu", max_batch_size=4, lora_rank=RANK, max_adapters=1)
    )
    await engine.load_adapter(AdapterLoad(name="run-a", rank=RANK, alpha=ALPHA))
    sampling = SamplingConfig(max_tokens=400, ignore_eos=True)
    started = asyncio.Event()

    async def run(adapter: str) -> GenerationEnd:
        async for item in engine.generate(GenerationRequest(adapter, tuple(PROMPT), sampling, adapter=adapter)):
            if isinstance(item, GenerationEnd):
                return item
            started.set()
        raise AssertionError("the stream ended without a GenerationEnd")

    try:
        runs = [asyncio.create_task(run(adapter)) for adapter in ("run-a", "")]
        await started.wait()
        assert await engine.unload_adapter("run-a") == 1
        ended, other = await asyncio.gather(*runs)
        assert ended.finish_reason == FinishReason.ERROR
        assert ended.error == "LoRA adapter 'run-a' was unloaded while this generation ran"
        assert other.finish_reason == FinishReason.LENGTH and other.completion_tokens == 400
    finally:
        await engine.stop()


async def test_a_run_refused_its_adapter_s_name_leaves_the_other_run_s_adapter_alone(tmp_path) -> None:
    """Two servers, the second holding another run's adapter of the name: the run stops (ALREADY_EXISTS)
    before it trains, takes its adapter off the first server again, and leaves the other run's be."""
    from trainer.loop import TrainingRun
    from trainer.service import create_backend

    engines = [
        create_engine(
            "torch", EngineOptions(model="tiny", device="cpu", max_batch_size=2, lora_rank=RANK, max_adapters=1)
        )
        for _ in range(2)
    ]
    started = [await start_server(engine) for engine in engines]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _, port in started]
    stubs = [inference_pb2_grpc.InferenceServiceStub(channel) for channel in channels]
    await engines[1].load_adapter(AdapterLoad(name="run-a", rank=RANK, alpha=ALPHA, policy_version=5))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"instruction": "x", "groupSize": 2, "harness": {"preset": "command", "command": ["true"]}}\n')
    config = TrainerConfig(
        model="tiny", device="cpu", dataset=str(tasks), lora_rank=RANK, lora_alpha=ALPHA, lora_adapter_name="run-a"
    )
    addresses = [f"127.0.0.1:{port}" for _, port in started]
    try:
        run = await asyncio.to_thread(
            TrainingRun, config, tmp_path / "run", "127.0.0.1:1", addresses, create_backend, io.StringIO()
        )
        with pytest.raises(WeightSyncError, match=f"inference server {addresses[1]}: .* ALREADY_EXISTS"):
            await asyncio.to_thread(run.run)
        held = [(await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info.adapters for stub in stubs]
        assert [[(a.name, a.policy_version) for a in adapters] for adapters in held] == [
            [("", 0)],
            [("", 0), ("run-a", 5)],
        ]
    finally:
        for channel in channels:
            await channel.close()
        for (server, _), engine in zip(started, engines):
            await server.stop(None)
            await engine.stop()
