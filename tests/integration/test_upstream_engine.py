"""The upstream engine against a fake upstream (polar/testing/upstream.py): an aiohttp server
of this process speaking vLLM's and SGLang's protocols with the real smollm2 tokenizer.

What only a real server can show (vLLM's own ids and logprobs through the four dialects, a cancelled
stream aborting vLLM's request) is the vLLM tier's: tests/integration/test_upstream_vllm.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import openai
import pytest

from polar.inference.engines.base import (
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingConfig,
    TokenChunk,
)
from polar.inference.engines.upstream import UpstreamEngine, UpstreamError
from polar.inference.server import start_server
from polar.testing.gateway import running_gateway
from polar.testing.upstream import fake_upstream
from polar.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.anyio

MODEL = "smollm2-135m"
PROMPT = (1, 9690, 1229, 28, 314, 1488, 34, 30, 223, 17, 1340, 282, 253, 1025, 30, 2, 198)


def engine_for(upstream, api: str = "vllm", **extra: str) -> UpstreamEngine:
    return UpstreamEngine(EngineOptions(model=MODEL, extra={"url": upstream.url, "api": api, **extra}))


async def collect(engine: UpstreamEngine, **sampling) -> tuple[list[int], list[float], GenerationEnd]:
    ids: list[int] = []
    logprobs: list[float] = []
    request = GenerationRequest("t", PROMPT, SamplingConfig(**{"max_tokens": 64, **sampling}))
    async for item in engine.generate(request):
        if isinstance(item, TokenChunk):
            ids += item.token_ids
            logprobs += item.logprobs
        else:
            return ids, logprobs, item
    raise AssertionError("the stream ended without a GenerationEnd")


@pytest.mark.parametrize("api", ["vllm", "sglang"])
async def test_tokens_and_logprobs_are_the_upstreams(api):
    async with fake_upstream(MODEL, reply="The capital is Paris.") as upstream:
        engine = engine_for(upstream, api)
        await engine.start()
        try:
            ids, logprobs, end = await collect(engine, temperature=0.7, top_p=0.9, top_k=20, seed=7)
            assert ids == upstream.reply_ids()
            assert logprobs == pytest.approx([-(i + 1) / 100 for i in range(len(ids))])
            assert end.finish_reason is FinishReason.STOP and end.completion_tokens == len(ids)
            cut, _, cut_end = await collect(engine, max_tokens=3)
            assert cut == upstream.reply_ids()[:3] and cut_end.finish_reason is FinishReason.LENGTH
        finally:
            await engine.stop()
        sent = upstream.requests[-2]
        if api == "vllm":
            assert sent["prompt"] == list(PROMPT) and sent["stream"] is True
            assert (sent["temperature"], sent["top_k"], sent["seed"], sent["max_tokens"]) == (
                pytest.approx(0.7),
                20,
                7,
                64,
            )
            assert sent["top_p"] == pytest.approx(0.9)
            assert sent["logprobs"] == 0 and sent["return_tokens_as_token_ids"] is True
            stops = sent["stop_token_ids"]
        else:
            assert sent["input_ids"] == list(PROMPT) and sent["return_logprob"] is True
            params = sent["sampling_params"]
            assert (params["temperature"], params["top_k"], params["sampling_seed"], params["max_new_tokens"]) == (
                pytest.approx(0.7),
                20,
                7,
                64,
            )
            stops = params["stop_token_ids"]
        # The model's own end-of-sequence ids travel with every request: <|im_end|> (2) and <|endoftext|> (0).
        assert set(stops) == {0, 2}


async def test_context_length_is_the_upstreams():
    async with fake_upstream(MODEL) as upstream:
        upstream.context_length = 1234
        engine = engine_for(upstream)
        await engine.start()
        await engine.stop()
        assert engine.description.context_length == 1234
        assert engine.description.engine == "upstream" and engine.upstream.name == "fake-model"


async def test_an_upstream_error_fails_the_generation_with_its_message():
    async with fake_upstream(MODEL) as upstream:
        engine = engine_for(upstream)
        await engine.start()
        upstream.status = 503
        try:
            ids, _, end = await collect(engine)
        finally:
            await engine.stop()
    assert ids == [] and end.finish_reason is FinishReason.ERROR
    assert "HTTP 503" in end.error and "the fake upstream fails" in end.error


async def test_a_silent_upstream_times_out():
    async with fake_upstream(MODEL) as upstream:
        engine = engine_for(upstream, timeout_s="0.3")
        await engine.start()
        upstream.delay_s = 2.0
        try:
            _, _, end = await asyncio.wait_for(collect(engine), 10)
        finally:
            await engine.stop()
    assert end.finish_reason is FinishReason.ERROR and "timeout" in end.error


async def test_closing_a_generation_closes_the_upstream_request():
    async with fake_upstream(MODEL, reply="one two three four five six seven eight") as upstream:
        upstream.delay_s = 0.2
        engine = engine_for(upstream)
        await engine.start()
        try:
            stream = engine.generate(GenerationRequest("t", PROMPT, SamplingConfig(max_tokens=64)))
            first = await anext(stream)
            assert isinstance(first, TokenChunk)
            await stream.aclose()
            for _ in range(50):
                if upstream.disconnects:
                    break
                await asyncio.sleep(0.05)
        finally:
            await engine.stop()
        assert upstream.disconnects == 1 and upstream.finished == 0


async def test_an_unreachable_upstream_refuses_to_start():
    engine = UpstreamEngine(EngineOptions(model=MODEL, extra={"url": "http://127.0.0.1:9", "timeout_s": "2"}))
    with pytest.raises(UpstreamError, match=r"upstream at http://127.0.0.1:9 is unreachable"):
        await engine.start()


@pytest.mark.parametrize("api", ["vllm", "sglang"])
async def test_another_encoding_refuses_to_start_naming_both(api):
    async with fake_upstream(MODEL, name="other-model") as upstream:
        upstream.encode_offset = 1
        with pytest.raises(UpstreamError, match=r"tokenizer is not the gateway's: smollm2-135m .* other-model at http"):
            await engine_for(upstream, api).start()


@pytest.mark.parametrize(("vocab", "relation"), [(49153, "more"), (49151, "fewer")])
async def test_another_vocabulary_size_refuses_to_start(vocab, relation):
    async with fake_upstream(MODEL, name="other-model") as upstream:
        upstream.vocab_size = vocab
        with pytest.raises(
            UpstreamError,
            match=rf"vocabulary is not the gateway's: smollm2-135m .* has 49152 token ids, other-model .* has {relation}",
        ):
            await engine_for(upstream).start()


async def test_update_weights_is_a_failed_precondition():
    async with fake_upstream(MODEL) as upstream:
        engine = engine_for(upstream)
        server, port = await start_server(engine, "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                info = (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info
                assert info.engine == "upstream" and "fake-model" in info.device

                async def chunks():
                    yield inference_pb2.UpdateWeightsRequest(header=inference_pb2.WeightsHeader(tensor_count=1))

                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.UpdateWeights(chunks())
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "cannot be updated through Polar" in caught.value.details()
        finally:
            await server.stop(1)
            await engine.stop()


async def test_the_gateway_records_the_upstreams_tokens():
    async with fake_upstream(MODEL, reply="Bonjour!") as upstream:
        async with running_gateway(engine=engine_for(upstream), envoy=False) as gw:
            client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=gw.key, max_retries=0)
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], stream=True
            )
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            records = gw.records()
    assert reply.choices[0].message.content == "Bonjour!" and text == "Bonjour!"
    for record in records:
        assert list(record.sampled_token_ids) == upstream.reply_ids()
        assert list(record.sampled_logprobs) == pytest.approx(
            [-(i + 1) / 100 for i in range(len(upstream.reply_ids()))]
        )
        sent = next(r for r in upstream.requests if r.get("prompt") == list(record.prompt_token_ids))
        assert sent["stream"] is True


@pytest.mark.slow
async def test_serve_inference_refuses_a_mismatch_in_one_line():
    async with fake_upstream(MODEL, name="other-model") as upstream:
        upstream.encode_offset = 1
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "polar",
            "serve",
            "inference",
            "--engine",
            "upstream",
            "--model",
            MODEL,
            "--upstream-url",
            upstream.url,
            "--port",
            "0",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 120)
    lines = stderr.decode().strip().splitlines()
    assert process.returncode == 1
    assert len(lines) == 1 and "tokenizer is not the gateway's" in lines[0] and "other-model" in lines[0], lines


@pytest.mark.parametrize("api", ["sglang", "nemo_rl"])
async def test_lora_adapters_need_the_vllm_api_and_a_folder_the_upstream_reads(api, tmp_path):
    url = {"url": "http://127.0.0.1:9"}  # never reached: the settings are refused first
    with pytest.raises(ValueError, match=f"the {api} upstream api loads no LoRA adapters"):
        UpstreamEngine(EngineOptions(model=MODEL, lora_rank=8, extra={**url, "api": api, "adapter_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match="need \\[inference\\] upstream_adapter_dir"):
        UpstreamEngine(EngineOptions(model=MODEL, lora_rank=8, extra={**url, "api": "vllm"}))
