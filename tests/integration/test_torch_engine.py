"""The torch engine on the tiny model: tokens, logprobs, batching, weight updates, stop conditions."""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass

import pytest
import torch

from polar.inference.engines.base import (
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingConfig,
    TokenChunk,
    WeightUpdateError,
)
from polar.inference.engines.torch_engine import TorchEngine
from polar.inference.models import TINY_CONTEXT_LENGTH, resolve_model
from polar.inference.sampling import processed_logprobs
from tests.helpers.transformers_twin import transformers_twin

MAX_BATCH = 16
PREFILL_CHUNK = 512


@pytest.fixture(scope="module")
def engine():
    engine = TorchEngine(
        EngineOptions(
            model="tiny",
            max_batch_size=MAX_BATCH,
            extra={"prefill_chunk_tokens": str(PREFILL_CHUNK)},
        )
    )
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    end: GenerationEnd


async def collect(engine, request: GenerationRequest) -> Result:
    tokens, logprobs, versions, ends = [], [], [], []
    async for item in engine.generate(request):
        if isinstance(item, TokenChunk):
            assert len(item.token_ids) == len(item.logprobs) == 1  # one chunk a step
            tokens += item.token_ids
            logprobs += item.logprobs
            versions.append(item.policy_version)
        else:
            assert not ends, "more than one GenerationEnd"
            ends.append(item)
    assert len(ends) == 1
    return Result(tokens, logprobs, versions, ends[0])


def run(engine, request: GenerationRequest) -> Result:
    return asyncio.run(collect(engine, request))


def request(prompt, max_tokens=16, request_id="r", **sampling) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(prompt), SamplingConfig(max_tokens=max_tokens, **sampling))


def prompt_of(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=generator).tolist()


def reference_logprobs(model, prompt, tokens, sampling: SamplingConfig) -> torch.Tensor:
    """Each sampled token's logprob from one full forward of transformers' `model` over prompt + tokens."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(tokens), V]
    processed = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return processed.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_description(engine):
    description = engine.description
    assert description.name == "tiny"
    assert description.vocab_size == 49152
    assert set(description.eos_token_ids) == {0, 2}  # <|endoftext|>, <|im_end|>
    assert description.end_of_turn_token_id == 2
    assert description.bos_token_id == 1
    assert description.context_length == TINY_CONTEXT_LENGTH == 131072
    assert description.dtype == "float32" and description.device == "cpu"
    assert description.parameter_count == sum(p.numel() for p in engine.model.parameters())
    assert "<|im_start|>" in description.chat_template
    assert description.tokenizer_path == str(resolve_model("tiny"))


def test_same_seed_same_tokens(engine):
    prompt = prompt_of(1, 12)
    first = run(engine, request(prompt, 24, seed=123, temperature=1.0))
    again = run(engine, request(prompt, 24, seed=123, temperature=1.0))
    other = run(engine, request(prompt, 24, seed=124, temperature=1.0))
    assert first.tokens == again.tokens and first.logprobs == again.logprobs
    assert first.tokens != other.tokens


SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.3, top_k=20),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "top_k_top_p": dict(temperature=0.9, top_k=50, top_p=0.8),
}


@pytest.mark.parametrize("name", SAMPLINGS)
def test_logprobs_equal_a_full_forward(engine, name):
    # A prompt longer than one prefill chunk, so chunked prefill is checked too.
    req = request(prompt_of(2, PREFILL_CHUNK + 37), 24, seed=7, ignore_eos=True, **SAMPLINGS[name])
    result = run(engine, req)
    assert len(result.tokens) == 24
    expected = reference_logprobs(transformers_twin(engine), req.prompt_token_ids, result.tokens, req.sampling)
    assert torch.isfinite(expected).all()  # every token was allowed by the truncation
    assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


def concurrent_requests(count: int) -> list[GenerationRequest]:
    # Not plain top_p: on tiny's flat distributions its nucleus spans most of the vocabulary, and
    # sorting that costs the same batched or not, hiding what batching saves.
    kinds = [SAMPLINGS[name] for name in ("greedy", "temperature", "top_k", "top_k_top_p")]
    return [
        request(
            prompt_of(100 + i, 5 + 3 * i), 8 + 2 * i, f"r{i}", seed=1000 + i, ignore_eos=True, **kinds[i % len(kinds)]
        )
        for i in range(count)
    ]


def test_concurrent_requests_equal_one_by_one_and_are_faster(engine):
    requests = concurrent_requests(16)

    async def together():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    # Best of two timings each, interleaved, so a burst of load from another process on this shared
    # 2-core machine cannot decide the comparison alone.
    sequential_seconds = concurrent_seconds = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        alone = [run(engine, r) for r in requests]
        sequential_seconds = min(sequential_seconds, time.perf_counter() - started)
        started = time.perf_counter()
        batched = asyncio.run(together())
        concurrent_seconds = min(concurrent_seconds, time.perf_counter() - started)

    for one, many, req in zip(alone, batched, requests, strict=True):
        assert many.tokens == one.tokens, req.request_id
        assert many.logprobs == pytest.approx(one.logprobs, abs=1e-5)
        assert many.end.finish_reason == FinishReason.LENGTH
        assert many.end.completion_tokens == req.sampling.max_tokens
    # On a CPU, tiny's per-token work (a 49152-wide output layer, sampling over it) dominates and
    # batching saves only the per-step work: about 2x here, so a margin that load cannot erase.
    assert concurrent_seconds < 0.8 * sequential_seconds, (concurrent_seconds, sequential_seconds)


def test_batched_prefill_equals_one_by_one(engine):
    """Prompts of different lengths, some continuing earlier chunks, prefilled in one padded forward:
    the same last-position logits and cache contents as prefilling each alone."""
    from polar.inference.engines.llama import DecoderRunner

    prompts = [torch.tensor(prompt_of(40 + i, length)) for i, length in enumerate((9, 3, 17, 6))]
    first = [5, 3, 8, 6]  # the first chunk's length; prompts 0 and 2 continue in a second chunk
    alone, together = DecoderRunner(engine.model, max_slots=4), DecoderRunner(engine.model, max_slots=4)
    with torch.inference_mode():
        expected = [alone.prefill([slot], [prompts[slot][: first[slot]]], [0]) for slot in range(4)]
        expected += [alone.prefill([slot], [prompts[slot][first[slot] :]], [first[slot]]) for slot in (0, 2)]
        fresh = together.prefill([0, 1, 2, 3], [p[:cut] for p, cut in zip(prompts, first)], [0] * 4)
        continued = together.prefill([2, 0], [prompts[2][first[2] :], prompts[0][first[0] :]], [8, 5])
    assert torch.allclose(fresh, torch.cat(expected[:4]), atol=1e-5, rtol=0)
    assert torch.allclose(continued, torch.cat([expected[5], expected[4]]), atol=1e-5, rtol=0)
    for slot, prompt in enumerate(prompts):
        written = slice(0, len(prompt))
        for kind in ("keys", "values"):
            for layer_alone, layer_together in zip(
                getattr(alone.cache, kind), getattr(together.cache, kind), strict=True
            ):
                assert torch.allclose(
                    layer_alone[slot, :, written], layer_together[slot, :, written], atol=1e-5, rtol=0
                )


def test_padded_prefill_groups_stay_within_the_budget():
    from polar.inference.engines.torch_engine import _padded_groups

    chunks = [(f"s{i}", 0, length) for i, length in enumerate((30, 2, 500, 7, 7, 100))]
    groups = _padded_groups(chunks, 512)
    assert sorted(chunk for group in groups for chunk in group) == sorted(chunks)
    for group in groups:
        padded = len(group) * max(end - start for _, start, end in group)
        assert len(group) == 1 or padded <= 512
    assert [len(group) for group in groups] == [1, 5]


def test_requests_beyond_the_batch_wait_for_a_slot(engine):
    requests = [request(prompt_of(i, 6), 20, f"r{i}", seed=i, ignore_eos=True) for i in range(MAX_BATCH + 2)]

    async def together():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    results = asyncio.run(together())
    assert all(len(r.tokens) == 20 for r in results)
    admitted_at_once = max(r.end.queue_seconds for r in results[:MAX_BATCH])
    assert min(r.end.queue_seconds for r in results[MAX_BATCH:]) > admitted_at_once
    assert results[-1].tokens == run(engine, requests[-1]).tokens
    assert engine.active_requests == 0


def test_max_tokens_ends_with_length(engine):
    result = run(engine, request(prompt_of(3, 5), 5, ignore_eos=True))
    assert len(result.tokens) == 5
    assert result.end == GenerationEnd(FinishReason.LENGTH, 5, 5, result.end.queue_seconds)


def test_stop_token_ids_end_with_the_stop_token(engine):
    prompt = prompt_of(4, 8)
    free = run(engine, request(prompt, 12, temperature=0.0, ignore_eos=True))
    stop = free.tokens[5]
    stopped = run(engine, request(prompt, 12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)))
    first = free.tokens.index(stop)
    assert stopped.tokens == free.tokens[: first + 1]
    assert stopped.end.finish_reason == FinishReason.STOP
    assert stopped.end.completion_tokens == first + 1


class swapped_weights:
    """Apply an update for the duration of a block, then put the original weights back."""

    def __init__(self, engine, tensors):
        self.engine, self.tensors = engine, tensors
        self.original = {name: engine.model.get_parameter(name).detach().clone() for name in tensors}

    def __enter__(self):
        return asyncio.run(self.engine.update_weights(self.tensors))

    def __exit__(self, *exc):
        asyncio.run(self.engine.update_weights(self.original))


def test_eos_stops_unless_ignored(engine):
    # A zero final norm gives every token the same logit: greedy then picks id 0, <|endoftext|>.
    zero_norm = {"model.norm.weight": torch.zeros(64)}
    with swapped_weights(engine, zero_norm):
        stopped = run(engine, request(prompt_of(5, 4), 6, temperature=0.0))
        ignored = run(engine, request(prompt_of(5, 4), 6, temperature=0.0, ignore_eos=True))
    assert stopped.tokens == [0] and stopped.end.finish_reason == FinishReason.STOP
    assert stopped.logprobs == pytest.approx([-torch.log(torch.tensor(49152.0)).item()], abs=1e-5)
    assert ignored.tokens == [0] * 6 and ignored.end.finish_reason == FinishReason.LENGTH


def test_update_weights_changes_output_and_version(engine):
    req = request(prompt_of(6, 10), 12, seed=9, temperature=1.0, ignore_eos=True)
    before = run(engine, req)
    embed = engine.model.get_parameter("model.embed_tokens.weight")
    new_embed = embed.detach() + 0.05 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(0))
    version = engine.policy_version
    with swapped_weights(engine, {"model.embed_tokens.weight": new_embed}) as new_version:
        assert new_version == version + 1 == engine.policy_version
        # The output projection is tied to the embedding and must follow it.
        assert torch.equal(engine.model.lm_head.weight, new_embed)
        after = run(engine, req)
        expected = reference_logprobs(transformers_twin(engine), req.prompt_token_ids, after.tokens, req.sampling)
        assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4, rtol=0)
    assert after.tokens != before.tokens
    assert set(before.versions) == {version} and set(after.versions) == {version + 1}
    assert engine.policy_version == version + 2
    assert run(engine, req).tokens == before.tokens


def test_parameter_specs_name_tied_weights_once(engine):
    specs = engine.parameter_specs()
    assert specs["model.embed_tokens.weight"].shape == (49152, 64)
    assert specs["model.layers.1.mlp.down_proj.weight"].shape == (64, 192)
    assert all(spec.dtype == torch.float32 for spec in specs.values())
    assert "lm_head.weight" not in specs


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"model.norm.weight": torch.ones(64), "model.nope.weight": torch.ones(3)}, "model.nope.weight"),
        (
            {"model.norm.weight": torch.ones(64), "model.layers.0.self_attn.q_proj.weight": torch.ones(64, 63)},
            r"\(64, 63\)",
        ),
        ({"lm_head.weight": torch.ones(49152, 64)}, "lm_head.weight"),
        ({"model.norm.weight": torch.ones(64, dtype=torch.long)}, "floating point"),
    ],
)
def test_bad_update_raises_and_changes_nothing(engine, tensors, message):
    version = engine.policy_version
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    with pytest.raises(WeightUpdateError, match=message):
        asyncio.run(engine.update_weights(tensors))
    assert engine.policy_version == version
    for name, parameter in engine.model.named_parameters():
        assert torch.equal(parameter, before[name]), name


def test_update_lands_between_steps_of_a_running_generation(engine):
    norm = engine.model.get_parameter("model.norm.weight").detach().clone()

    async def scenario():
        stream = engine.generate(request(prompt_of(8, 6), 400, temperature=0.0, ignore_eos=True))
        versions = []
        async for item in stream:
            if isinstance(item, TokenChunk):
                versions.append(item.policy_version)
                if len(versions) == 3:
                    new_version = await engine.update_weights({"model.norm.weight": norm * 1.5})
            else:
                return versions, new_version

    version = engine.policy_version
    try:
        versions, new_version = asyncio.run(scenario())
    finally:
        asyncio.run(engine.update_weights({"model.norm.weight": norm}))
    assert new_version == version + 1
    assert versions == sorted(versions)
    assert versions[0] == version and versions[-1] == new_version


def wait_until_idle(engine, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.active_requests and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.active_requests == 0


def test_closing_the_stream_frees_the_slot(engine):
    async def read_three_then_close():
        stream = engine.generate(request(prompt_of(9, 6), 10_000, ignore_eos=True, seed=1))
        chunks = [await anext(stream) for _ in range(3)]
        assert engine.active_requests == 1
        await stream.aclose()
        return chunks

    assert len(asyncio.run(read_three_then_close())) == 3
    wait_until_idle(engine)


def test_cancelled_consumer_frees_the_slot(engine):
    async def cancel_midway():
        got_one = asyncio.Event()

        async def consume():
            async for _ in engine.generate(request(prompt_of(10, 6), 10_000, ignore_eos=True)):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    wait_until_idle(engine)


def test_a_failing_request_ends_with_error_and_others_go_on(engine):
    good = request(prompt_of(11, 6), 10, "good", seed=3, ignore_eos=True)
    bad = request([5, 49152, 7], 10, "bad")

    async def together():
        return await asyncio.gather(collect(engine, bad), collect(engine, good))

    failed, served = asyncio.run(together())
    assert failed.end.finish_reason == FinishReason.ERROR and "49152" in failed.end.error
    assert failed.tokens == []
    assert served.tokens == run(engine, good).tokens and len(served.tokens) == 10


def test_stop_aborts_running_generations_and_start_serves_again(engine):
    async def scenario():
        stream = engine.generate(request(prompt_of(12, 6), 10_000, ignore_eos=True))
        await anext(stream)
        await engine.stop()
        rest = [item async for item in stream]
        await engine.start()
        return rest

    rest = asyncio.run(scenario())
    assert isinstance(rest[-1], GenerationEnd) and rest[-1].finish_reason == FinishReason.ABORTED
    assert len(run(engine, request(prompt_of(12, 6), 3, ignore_eos=True)).tokens) == 3


@pytest.mark.slow
def test_a_20k_token_prompt(engine):
    # Chunked prefill against a full forward is checked above on a two-chunk prompt; here the point
    # is that 40 chunks over a 20k-token cache run and leave the engine idle and able to serve.
    result = run(engine, request(prompt_of(13, 20_000), 3, temperature=0.0, ignore_eos=True))
    assert len(result.tokens) == 3 and result.end.prompt_tokens == 20_000
    assert all(-20 < logprob <= 0 for logprob in result.logprobs)
    wait_until_idle(engine)
    assert len(run(engine, request(prompt_of(13, 5), 2, ignore_eos=True)).tokens) == 2


def tiny_model_folder(tmp_path, model_type: str, context: int):
    """A random two-layer model of another Llama-family architecture, with tiny's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = resolve_model("tiny")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_other_architectures_and_the_context_limit(tmp_path, model_type):
    folder = tiny_model_folder(tmp_path, model_type, context=48)
    engine = TorchEngine(EngineOptions(model=str(folder), max_batch_size=4, extra={"prefill_chunk_tokens": "16"}))
    assert engine.description.name == folder.name and engine.description.context_length == 48
    assert "lm_head.weight" in engine.parameter_specs()  # untied here
    prompt = prompt_of(14, 40)
    sampling = dict(temperature=0.8, top_k=30, seed=5, ignore_eos=True)
    result = run(engine, request(prompt, 20, **sampling))
    try:
        # 40 + 8 fills the 48-token context before max_tokens.
        assert len(result.tokens) == 8 and result.end.finish_reason == FinishReason.CONTEXT_LENGTH
        expected = reference_logprobs(
            transformers_twin(engine), prompt, result.tokens, SamplingConfig(20, 0.8, top_k=30)
        )
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    finally:
        asyncio.run(engine.stop())
