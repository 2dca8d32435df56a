"""The inference service over a real grpc.aio server on a free loopback port, driven by the generated
stubs. The scripted engine stands in where compute does not matter; the tiny torch engine where the
weights do."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from polar.inference.engines import EngineOptions, FinishReason, GenerationEnd, TokenChunk, create_engine
from polar.inference.engines.scripted import ScriptedEngine, ScriptError
from polar.inference.server import serve, start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]

LONG = list(range(10, 110))  # 100 token ids
SLOW_PROMPT = [7]  # matched by the rule below: a reply that takes seconds
SCRIPT = {
    "tokenizer": None,
    "vocab_size": 1000,
    "context_length": 256,
    "tokens_per_chunk": 32,
    "rules": [{"prompt_regex": "^7$", "token_ids": LONG, "delay_seconds": 0.05}],
    "outputs": [
        {"token_ids": LONG, "logprobs": [-i / 100 for i in range(100)]},
        {"token_ids": [5, 6, 7], "logprob": -0.5},
    ],
}


async def open_server(engine):
    server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedEngine, inference_pb2_grpc.InferenceServiceStub]]:
    engine = ScriptedEngine.from_script(SCRIPT, max_batch_size=1)
    server, channel = await open_server(engine)
    yield engine, inference_pb2_grpc.InferenceServiceStub(channel)
    await channel.close()
    await server.stop(None)
    await engine.stop()


def gen_request(prompt=(1, 2, 3), model="", message_interval_seconds=0.0, **sampling) -> inference_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 200)
    return inference_pb2.GenerateRequest(
        model=model,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(**sampling),
        message_interval_seconds=message_interval_seconds,
    )


async def collect(stub, request) -> tuple[list[int], list[float], list[inference_pb2.GenerateResponse]]:
    messages = [message async for message in stub.Generate(request)]
    tokens = [t for m in messages for t in m.token_ids]
    logprobs = [x for m in messages for x in m.logprobs]
    return tokens, logprobs, messages


async def model_info(stub) -> inference_pb2.ModelInfo:
    return (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info


# --- Generate ----------------------------------------------------------------------------------


async def test_tokens_produced_at_once_come_in_one_message_with_the_end(scripted):
    _, stub = scripted  # the script's outputs have no delay: the engine has every token at once
    tokens, logprobs, messages = await collect(stub, gen_request())
    assert tokens == LONG
    assert logprobs == pytest.approx([-i / 100 for i in range(100)])
    [message] = messages
    assert message.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (message.usage.prompt_tokens, message.usage.completion_tokens) == (3, 100)
    assert 0 <= message.queue_seconds < 1


async def test_tokens_decoded_one_at_a_time_stream_one_message_each(scripted):
    _, stub = scripted  # SLOW_PROMPT's reply comes a token every 50 ms: nothing waits for the next
    tokens, _, messages = await collect(stub, gen_request(SLOW_PROMPT, max_tokens=4))
    assert tokens == LONG[:4]
    assert [len(m.token_ids) for m in messages] == [1, 1, 1, 1]
    assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 4


async def test_a_message_interval_gathers_tokens_and_never_holds_back_the_end(scripted):
    _, stub = scripted  # a token every 50 ms; after the first message, the next waits up to 1 s
    started = time.monotonic()
    tokens, _, messages = await collect(stub, gen_request(SLOW_PROMPT, max_tokens=4, message_interval_seconds=1.0))
    elapsed = time.monotonic() - started
    assert tokens == LONG[:4]
    assert [len(m.token_ids) for m in messages] == [1, 3]  # the rest came with the end, at once
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert elapsed < 0.9, f"the end waited for the interval: {elapsed:.2f} s"


class UpdatedMidwayEngine(ScriptedEngine):
    """Tokens of two policy versions produced at once, as when weights change between two decode steps."""

    async def generate(self, request):
        yield TokenChunk((5, 6), (-0.5, -0.6), 3)
        yield TokenChunk((7,), (-0.7,), 3)
        yield TokenChunk((8,), (-0.8,), 4)
        yield GenerationEnd(FinishReason.STOP, len(request.prompt_token_ids), 4, 0.0)


async def test_tokens_produced_together_share_a_message_only_with_their_policy_version():
    engine = UpdatedMidwayEngine.from_script(SCRIPT)
    server, channel = await open_server(engine)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    tokens, logprobs, messages = await collect(stub, gen_request())
    assert tokens == [5, 6, 7, 8] and logprobs == pytest.approx([-0.5, -0.6, -0.7, -0.8])
    assert [(list(m.token_ids), m.policy_version) for m in messages] == [([5, 6, 7], 3), ([8], 4)]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    await channel.close()
    await server.stop(None)


async def test_generate_respects_max_tokens_and_stop_ids_and_cycles_outputs(scripted):
    _, stub = scripted
    tokens, _, messages = await collect(stub, gen_request(max_tokens=40))
    assert tokens == LONG[:40] and messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    tokens, logprobs, messages = await collect(stub, gen_request(stop_token_ids=[6]))
    assert tokens == [5, 6] and logprobs == [-0.5, -0.5]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_spent_script_ends_the_call_with_internal(scripted):
    _, stub = scripted
    await collect(stub, gen_request())
    await collect(stub, gen_request())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, gen_request())
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "no output left" in caught.value.details()
    assert (await collect(stub, gen_request(SLOW_PROMPT, max_tokens=1)))[0] == [LONG[0]]  # still serving


async def test_cycling_script_starts_over():
    engine = ScriptedEngine.from_script({**SCRIPT, "cycle": True})
    replies = []
    for _ in range(3):
        items = [item async for item in engine.generate(_engine_request())]
        replies.append([t for item in items if isinstance(item, TokenChunk) for t in item.token_ids])
    assert replies == [LONG, [5, 6, 7], LONG]


class FailingEngine(ScriptedEngine):
    """An engine that breaks after its first chunk, as a GPU error would."""

    async def generate(self, request):
        yield TokenChunk((5,), (-1.0,), 0)
        raise RuntimeError("device lost")


class ErrorEndEngine(ScriptedEngine):
    """An engine that reports its own failure after a token, in the same breath."""

    async def generate(self, request):
        yield TokenChunk((5,), (-1.0,), 0)
        yield GenerationEnd(FinishReason.ERROR, len(request.prompt_token_ids), 1, 0.0, error="out of memory")


class EndlessEngine(ScriptedEngine):
    """An engine whose stream stops without a GenerationEnd (a broken engine)."""

    async def generate(self, request):
        yield TokenChunk((5,), (-1.0,), 0)


@pytest.mark.parametrize(
    ("engine_class", "details"),
    [
        (FailingEngine, "RuntimeError: device lost"),  # it raises
        (ErrorEndEngine, "out of memory"),
        (EndlessEngine, "without a GenerationEnd"),
    ],
)
async def test_an_engine_that_fails_or_stops_short_ends_the_stream_with_internal_after_its_tokens(
    engine_class, details
):
    engine = engine_class.from_script(SCRIPT)
    server, channel = await open_server(engine)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for message in stub.Generate(gen_request()):
            received.extend(message.token_ids)
    assert received == [5]
    assert caught.value.code() == grpc.StatusCode.INTERNAL and details in caught.value.details()
    await channel.close()
    await server.stop(None)


@pytest.mark.parametrize(
    ("request_kwargs", "code", "fragments"),
    [
        ({"model": "gpt-9"}, grpc.StatusCode.NOT_FOUND, ["'gpt-9'", "'scripted'"]),
        ({"prompt": ()}, grpc.StatusCode.INVALID_ARGUMENT, ["prompt_token_ids", "empty"]),
        ({"prompt": (1, 1000)}, grpc.StatusCode.INVALID_ARGUMENT, ["prompt_token_ids[1] = 1000", "[0, 1000)"]),
        ({"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, ["sampling.max_tokens = 0"]),
        ({"temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, ["sampling.temperature = -1.0"]),
        ({"top_p": 2.0}, grpc.StatusCode.INVALID_ARGUMENT, ["sampling.top_p = 2.0"]),
        ({"top_k": -2}, grpc.StatusCode.INVALID_ARGUMENT, ["sampling.top_k = -2"]),
        ({"max_tokens": 254}, grpc.StatusCode.INVALID_ARGUMENT, ["3", "254", "257", "256"]),
        (
            {"message_interval_seconds": 1.5},
            grpc.StatusCode.INVALID_ARGUMENT,
            ["message_interval_seconds = 1.5", "[0, 1]"],
        ),
        ({"message_interval_seconds": -0.1}, grpc.StatusCode.INVALID_ARGUMENT, ["message_interval_seconds = -0.1"]),
        ({"message_interval_seconds": math.nan}, grpc.StatusCode.INVALID_ARGUMENT, ["message_interval_seconds = nan"]),
    ],
)
async def test_bad_generate_requests_get_their_code_and_name_the_field(scripted, request_kwargs, code, fragments):
    _, stub = scripted
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, gen_request(**request_kwargs))
    assert caught.value.code() == code
    for fragment in fragments:
        assert fragment in caught.value.details()


async def test_a_client_that_goes_away_frees_its_slot_at_once(scripted):
    engine, stub = scripted  # one slot: a held slot would block the next call
    call = stub.Generate(gen_request(SLOW_PROMPT))
    first = await call.read()
    assert list(first.token_ids) == [LONG[0]]
    assert engine.running == 1
    call.cancel()
    deadline = time.monotonic() + 1.0
    while engine.running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.running == 0
    started = time.monotonic()
    tokens, _, messages = await collect(stub, gen_request())
    assert tokens == LONG and messages[-1].queue_seconds < 0.5
    assert time.monotonic() - started < 1.0
    assert (await stub.Pause(inference_pb2.PauseRequest())).drained == 0


# --- Pause / Resume ----------------------------------------------------------------------------


async def test_pause_drains_then_holds_new_calls_until_resume():
    engine = ScriptedEngine.from_script(
        {**SCRIPT, "rules": [{"prompt_regex": ".", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "delay_seconds": 0.05}]}
    )
    server, channel = await open_server(engine)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    finished: dict[str, float] = {}

    async def generate(label: str) -> list[int]:
        tokens, _, _ = await collect(stub, gen_request())
        finished[label] = time.monotonic()
        return tokens

    running = asyncio.create_task(generate("before"))
    await asyncio.sleep(0.1)  # the call is in flight, with about 0.3 s of tokens to go
    pause_started = time.monotonic()
    paused = await stub.Pause(inference_pb2.PauseRequest())
    assert paused.drained == 1
    assert time.monotonic() - pause_started > 0.2 and engine.running == 0
    assert await running == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (await model_info(stub)).paused

    held = asyncio.create_task(generate("held"))
    await asyncio.sleep(0.3)
    assert not held.done() and engine.running == 0
    resumed = await stub.Resume(inference_pb2.ResumeRequest())
    resumed_at = time.monotonic()
    assert resumed.admitted == 1
    assert await held == [1, 2, 3, 4, 5, 6, 7, 8]
    assert finished["held"] > resumed_at
    assert not (await model_info(stub)).paused
    assert (await stub.Resume(inference_pb2.ResumeRequest())).admitted == 0
    await channel.close()
    await server.stop(None)


async def test_bad_requests_are_refused_at_once_even_while_paused(scripted):
    _, stub = scripted
    await stub.Pause(inference_pb2.PauseRequest())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(collect(stub, gen_request(max_tokens=0)), 2)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- UpdateWeights -----------------------------------------------------------------------------


def header(count: int) -> inference_pb2.UpdateWeightsRequest:
    return inference_pb2.UpdateWeightsRequest(header=inference_pb2.WeightsHeader(tensor_count=count))


def tensor_chunks(name: str, tensor: torch.Tensor, chunk_bytes: int) -> list[inference_pb2.UpdateWeightsRequest]:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return [
        inference_pb2.UpdateWeightsRequest(
            chunk=inference_pb2.TensorChunk(
                name=name, dtype=dtype, shape=tensor.shape, offset=offset, data=data[offset : offset + chunk_bytes]
            )
        )
        for offset in range(0, len(data), chunk_bytes)
    ]


async def test_update_weights_on_the_scripted_engine_refuses_any_name_and_keeps_serving(scripted):
    _, stub = scripted
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.UpdateWeights(iter([header(1), *tensor_chunks("model.norm.weight", torch.ones(4), 8)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'model.norm.weight'" in caught.value.details()
    assert (await model_info(stub)).policy_version == 0
    assert (await collect(stub, gen_request()))[0] == LONG


async def test_a_stream_ended_before_its_tensors_is_invalid_and_changes_nothing(scripted):
    _, stub = scripted
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.UpdateWeights(iter([header(2)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor_count = 2" in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.UpdateWeights(iter([]))
    assert "without a header" in caught.value.details()
    assert (await model_info(stub)).policy_version == 0


async def test_a_client_that_cancels_an_update_changes_nothing(scripted):
    _, stub = scripted
    call = stub.UpdateWeights()
    await call.write(header(3))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert (await model_info(stub)).policy_version == 0
    assert (await collect(stub, gen_request()))[0] == LONG


# --- Description, health, reflection, lifecycle ------------------------------------------------


async def test_model_info_describes_the_tokenizer_and_live_state():
    engine = ScriptedEngine.from_script({"name": "tiny-script", "outputs": [{"text": "Hi"}], "context_length": 4096})
    server, channel = await open_server(engine)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    info = await model_info(stub)
    assert info.name == "tiny-script" and info.engine == "scripted"
    assert info.vocab_size == 49152 and info.context_length == 4096
    assert list(info.eos_token_ids) == [2] and info.end_of_turn_token_id == 2 and info.bos_token_id == 1
    assert "<|im_start|>" in info.chat_template
    assert (Path(info.tokenizer_path) / "tokenizer.json").is_file()
    assert (info.policy_version, info.paused, info.parameter_count) == (0, False, 0)
    tokens, _, messages = await collect(stub, gen_request(model="tiny-script"))
    assert tokens[-1] == 2 and messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    await channel.close()
    await server.stop(None)


async def test_text_outputs_rules_and_eos():
    engine = ScriptedEngine.from_script(
        {
            "rules": [{"prompt_regex": r"weather in \w+", "text": "Sunny.", "logprob": -0.25}],
            "outputs": [{"text": "plain", "end_of_turn": False}],
            "cycle": True,
        }
    )
    server, channel = await open_server(engine)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    tokenizer = AutoTokenizer.from_pretrained((await model_info(stub)).tokenizer_path)
    weather = tokenizer.encode("What is the weather in Paris?")
    tokens, logprobs, _ = await collect(stub, gen_request(weather))
    assert tokenizer.decode(tokens) == "Sunny.<|im_end|>" and logprobs == [-0.25] * len(tokens)
    tokens, logprobs, messages = await collect(stub, gen_request([1, 2, 3]))
    assert tokenizer.decode(tokens) == "plain" and logprobs == pytest.approx([-0.1] * len(tokens))
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    tokens, _, messages = await collect(stub, gen_request(weather, max_tokens=2))
    assert tokens == tokenizer.encode("Sunny.")[:2]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    await channel.close()
    await server.stop(None)


async def test_a_rule_may_match_the_prompt_s_last_ids_before_any_regex_rule():
    engine = ScriptedEngine.from_script(
        {
            "rules": [
                {"prompt_ends_with": [7, 8], "token_ids": [40, 41]},
                {"prompt_regex": ".", "token_ids": [50]},
            ],
            "outputs": [{"token_ids": [60]}],
            "cycle": True,
        }
    )
    server, channel = await open_server(engine)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    assert (await collect(stub, gen_request([1, 7, 8])))[0] == [40, 41]
    assert (await collect(stub, gen_request([7, 8, 1])))[0] == [50]  # the ids must end the prompt
    assert (await collect(stub, gen_request([8])))[0] == [50]  # a prompt shorter than the ids
    await channel.close()
    await server.stop(None)


def test_a_rule_needs_exactly_one_way_to_match():
    for rule in ({"token_ids": [1]}, {"prompt_regex": ".", "prompt_ends_with": [1], "token_ids": [1]}):
        with pytest.raises(ScriptError, match="prompt_ends_with"):
            ScriptedEngine.from_script({"rules": [rule], "outputs": [{"token_ids": [1]}]})


async def test_health_is_serving_and_reflection_lists_the_service():
    engine = ScriptedEngine.from_script(SCRIPT)
    server, channel = await open_server(engine)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "polar.v1.InferenceService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = [
        r
        async for r in reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    ]
    names = {s.name for s in replies[0].list_services_response.service}
    assert "polar.v1.InferenceService" in names
    await channel.close()
    await server.stop(None)


async def test_serve_reports_its_port_and_stops_when_cancelled():
    engine = ScriptedEngine.from_script(SCRIPT)
    ready: asyncio.Queue[int] = asyncio.Queue()
    task = asyncio.create_task(serve(engine, "127.0.0.1:0", on_ready=ready.put_nowait))
    port = await asyncio.wait_for(ready.get(), 10)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        assert (await model_info(stub)).name == "scripted"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await inference_pb2_grpc.InferenceServiceStub(channel).GetModelInfo(
                inference_pb2.GetModelInfoRequest(), timeout=1
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # The engine was stopped: a generation started on it now ends aborted.
    items = [item async for item in engine.generate(_engine_request())]
    assert isinstance(items[-1], GenerationEnd) and items[-1].finish_reason is FinishReason.ABORTED


SERVE_SCRIPT = """
import asyncio, sys
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.server import serve
engine = create_engine("scripted", EngineOptions(script=sys.argv[1]))
asyncio.run(serve(engine, "127.0.0.1:0", on_ready=lambda port: print(port, flush=True)))
"""


@pytest.mark.slow
async def test_serve_stops_gracefully_on_sigterm(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(script)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    try:
        port = int(await asyncio.to_thread(process.stdout.readline))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            assert (await collect(stub, gen_request()))[0] == LONG
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_create_engine_builds_scripted_from_a_file_and_names_the_kinds(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    engine = create_engine("scripted", EngineOptions(script=str(script)))
    assert isinstance(engine, ScriptedEngine) and engine.description.vocab_size == 1000
    with pytest.raises(ValueError, match="torch, vllm, scripted"):
        create_engine("onnx", EngineOptions())


def _engine_request():
    from polar.inference.engines import GenerationRequest, SamplingConfig

    return GenerationRequest("r", (1, 2), SamplingConfig(max_tokens=200))


# --- The tiny torch engine: weights that really change the output ------------------------------


@pytest.fixture
async def tiny() -> AsyncIterator[tuple[object, inference_pb2_grpc.InferenceServiceStub]]:
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", dtype="float32"))
    server, channel = await open_server(engine)
    yield engine, inference_pb2_grpc.InferenceServiceStub(channel)
    await channel.close()
    await server.stop(None)
    await engine.stop()


async def greedy(stub) -> list[int]:
    return (await collect(stub, gen_request((1, 9690, 28, 905), max_tokens=12, temperature=0.0, ignore_eos=True)))[0]


def new_weights(engine, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(spec.shape, generator=generator, dtype=torch.float32) * 0.5
        for name, spec in engine.parameter_specs().items()
    }


async def send_update(stub, tensors: dict[str, torch.Tensor], chunk_bytes: int = 1 << 20):
    messages = [header(len(tensors))]
    for name, tensor in tensors.items():
        messages.extend(tensor_chunks(name, tensor, chunk_bytes))
    return await stub.UpdateWeights(iter(messages))


@pytest.mark.slow
async def test_a_full_update_over_grpc_changes_output_and_version(tiny):
    engine, stub = tiny
    before = await greedy(stub)
    assert before == await greedy(stub)  # greedy is deterministic
    tensors = new_weights(engine, seed=1)
    reply = await send_update(stub, tensors, chunk_bytes=(3 << 20) + 5)  # splits tensors mid-element
    assert reply.policy_version == 1
    assert reply.tensors_updated == len(tensors)
    assert reply.bytes_received == sum(t.numel() * 4 for t in tensors.values())
    assert reply.apply_seconds >= 0
    after = await greedy(stub)
    assert after != before
    info = await model_info(stub)
    assert info.policy_version == 1 and info.engine == "torch"
    messages = (await collect(stub, gen_request((1, 2), max_tokens=3)))[2]
    assert {m.policy_version for m in messages} == {1}


async def test_bad_updates_change_neither_version_nor_output(tiny):
    engine, stub = tiny
    before = await greedy(stub)
    good = new_weights(engine, seed=2)
    name, tensor = next(iter(good.items()))
    cases = [
        ({"lm_head.extra": torch.ones(3)}, "'lm_head.extra'"),
        # Refused at its first chunk while the client is still sending the rest (tens of MiB).
        ({name: torch.ones(*tensor.shape, 2)}, repr(name)),
        # The last tensor is wrong, after every other one arrived complete: none may be applied.
        ({**{k: v for k, v in good.items() if k != name}, name: tensor.flatten()[:-1]}, repr(name)),
    ]
    for tensors, fragment in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await send_update(stub, tensors)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in caught.value.details()
    assert (await model_info(stub)).policy_version == 0
    assert await greedy(stub) == before


async def test_a_half_sent_update_changes_nothing_and_the_server_keeps_serving(tiny):
    engine, stub = tiny
    before = await greedy(stub)
    tensors = new_weights(engine, seed=3)
    messages = [header(len(tensors))]
    for name, tensor in tensors.items():
        messages.extend(tensor_chunks(name, tensor, 1 << 16))
    call = stub.UpdateWeights()
    for message in messages[: len(messages) // 2]:
        await call.write(message)
    await asyncio.sleep(0.2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # and one that just stops writing
        await stub.UpdateWeights(iter(messages[: len(messages) // 2]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "before every tensor was complete" in caught.value.details()
    assert (await model_info(stub)).policy_version == 0
    assert await greedy(stub) == before


async def test_tiny_frees_the_slot_of_a_client_that_goes_away(tiny):
    _, stub = tiny
    # Tens of seconds of decoding if the slot were kept: Pause would wait for all of it.
    call = stub.Generate(gen_request((1, 2), max_tokens=20000, ignore_eos=True))
    await call.read()
    call.cancel()
    started = time.monotonic()
    await asyncio.wait_for(stub.Pause(inference_pb2.PauseRequest()), 10)
    assert time.monotonic() - started < 2.0
    await stub.Resume(inference_pb2.ResumeRequest())
    assert len(await greedy(stub)) == 12
