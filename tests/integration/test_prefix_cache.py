"""The torch engine's prefix cache on the tiny model, with prompts recorded from real CLIs: the same
tokens and logprobs as an engine without it, under a small budget too, for sequences that share a
prompt while they run, and nothing reused across a weight update."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import grpc
import pytest
import torch

from polar.inference.engines.base import EngineOptions, GenerationEnd, GenerationRequest, SamplingConfig, TokenChunk
from polar.inference.engines.prefix_cache import BLOCK_TOKENS
from polar.inference.engines.torch_engine import TorchEngine
from polar.inference.sampling import processed_logprobs
from polar.inference.server import start_server
from polar.trajectory.session_file import read_trajectory
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.helpers.transformers_twin import transformers_twin

SESSIONS = Path(__file__).resolve().parent.parent / "fixtures" / "sessions"
PREFILL_CHUNK = 512  # below a prompt's length: blocks are taken and stored between chunks
SAMPLINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.9, top_k=50, seed=11)}


@functools.cache
def recorded_prompts(harness: str) -> tuple[tuple[int, ...], ...]:
    """The prompt ids of a recorded session's calls, in call order (each extends an earlier one's
    prompt and recorded output, or starts again from the CLI's system prompt)."""
    calls = sorted(read_trajectory(SESSIONS / f"{harness}.json.zst").calls, key=lambda call: call.call_id)
    return tuple(tuple(call.prompt_token_ids) for call in calls)


def make_engine(**options) -> TorchEngine:
    extra = {"prefill_chunk_tokens": str(PREFILL_CHUNK)}
    engine = TorchEngine(EngineOptions(model="tiny", max_batch_size=8, extra=extra, **options))
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def cached():
    engine = make_engine()
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture(scope="module")
def uncached():
    engine = make_engine(prefix_cache_mib=0)
    yield engine
    asyncio.run(engine.stop())


async def collect(engine: TorchEngine, request: GenerationRequest) -> tuple[list[int], list[float], GenerationEnd]:
    tokens, logprobs = [], []
    async for item in engine.generate(request):
        if isinstance(item, TokenChunk):
            tokens += item.token_ids
            logprobs += item.logprobs
        else:
            end = item
    return tokens, logprobs, end


def run(engine, request):
    return asyncio.run(collect(engine, request))


def run_together(engine, requests):
    async def together():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    return asyncio.run(together())


def request(prompt, max_tokens=8, name="greedy", request_id="r") -> GenerationRequest:
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True, **SAMPLINGS[name])
    return GenerationRequest(request_id, tuple(prompt), sampling)


def assert_same(result, reference):
    tokens, logprobs, end = result
    assert tokens == reference[0]
    assert logprobs == pytest.approx(reference[1], abs=1e-4)
    assert end.finish_reason == reference[2].finish_reason


def reusable(prompt_tokens: int) -> int:
    """Positions a fully cached prompt takes from the cache: whole blocks, its last token computed."""
    return (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLINGS)
def test_a_recorded_session_gives_what_an_engine_without_the_cache_gives(cached, uncached, name):
    # Each CLI's second call extends its first call's prompt and recorded output.
    prompts = recorded_prompts("pi") + recorded_prompts("codex")
    requests = [request(prompt, name=name, request_id=f"c{i}") for i, prompt in enumerate(prompts)]
    references = [run(uncached, r) for r in requests]
    assert all(end.cached_prompt_tokens == 0 for _, _, end in references)
    first_pass = [run(cached, r) for r in requests]
    again = [run(cached, r) for r in requests]
    for result, reference in zip(first_pass + again, references + references):
        assert_same(result, reference)
    # A second call reuses at least its first call's prompt (tiny's output is not the recorded one).
    assert first_pass[1][2].cached_prompt_tokens >= reusable(len(prompts[0]) + 1)
    assert first_pass[3][2].cached_prompt_tokens >= reusable(len(prompts[2]) + 1)
    assert [end.cached_prompt_tokens for _, _, end in again] == [reusable(len(p)) for p in prompts]


def test_a_call_that_extends_an_earlier_output_reuses_the_output_too(cached, uncached):
    prompt = recorded_prompts("pi")[0]
    tokens, _, _ = run(cached, request(prompt, max_tokens=3 * BLOCK_TOKENS))
    # The next call: this prompt, the output, and a few template tokens after it.
    extended = prompt + tuple(tokens) + (2, 198, 1)
    result = run(cached, request(extended, name="sampled"))
    assert_same(result, run(uncached, request(extended, name="sampled")))
    # The output's blocks were written by decode steps and stored when the sequence ended.
    assert result[2].cached_prompt_tokens == reusable(len(prompt) + len(tokens))


@pytest.mark.slow
def test_sequences_that_share_a_prompt_while_they_run(uncached):
    engine = make_engine()  # cold: nothing of this prompt is cached yet
    try:
        shared = recorded_prompts("pi")[0]
        # Eight sessions of one CLI: its prompt, then each its own last few tokens.
        generator = torch.Generator().manual_seed(0)
        suffixes = [torch.randint(3, 49152, (5 + i,), generator=generator).tolist() for i in range(8)]
        requests = [
            request(shared + tuple(suffix), name=("greedy", "sampled")[i % 2], request_id=f"s{i}")
            for i, suffix in enumerate(suffixes)
        ]
        together = run_together(engine, requests)
        for result, r in zip(together, requests):
            assert_same(result, run(uncached, r))
        # The first computes the shared prompt; the others wait for its blocks and take them.
        taken = sorted(end.cached_prompt_tokens for _, _, end in together)
        assert taken[0] == 0
        assert taken[1:] == [len(shared) // BLOCK_TOKENS * BLOCK_TOKENS] * 7
    finally:
        asyncio.run(engine.stop())


@pytest.mark.slow
def test_eviction_under_a_small_budget_keeps_results_equal(uncached):
    engine = make_engine(prefix_cache_mib=1)  # tiny's blocks: 1 MiB holds 2,048 positions
    try:
        capacity = engine._prefix.index.capacity
        assert capacity * BLOCK_TOKENS == 2048
        pi, codex = recorded_prompts("pi"), recorded_prompts("codex")
        prompts = [pi[0], pi[1], codex[0], pi[1], pi[0]]  # codex's prompt alone is over 4 times the budget
        for i, prompt in enumerate(prompts):
            name = ("greedy", "sampled")[i % 2]
            assert_same(run(engine, request(prompt, name=name)), run(uncached, request(prompt, name=name)))
            assert len(engine._prefix.index) <= capacity
        # Running sequences pin more blocks than fit: what finds no row is computed, not shared.
        requests = [request(prompt, name="sampled", request_id=f"p{i}") for i, prompt in enumerate(pi + pi)]
        for result, r in zip(run_together(engine, requests), requests):
            assert_same(result, run(uncached, r))
        assert engine._prefix.memory_bytes <= 1 << 20
    finally:
        asyncio.run(engine.stop())


def full_forward_logprobs(model, prompt, tokens, sampling: SamplingConfig) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    processed = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return processed.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.slow
def test_a_weight_update_invalidates_the_cache():
    engine = make_engine()
    try:
        prompt = recorded_prompts("pi")[0]
        req = request(prompt, name="sampled")
        before = run(engine, req)
        assert run(engine, req)[2].cached_prompt_tokens == reusable(len(prompt))
        embed = engine.model.get_parameter("model.embed_tokens.weight")
        noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(0))
        asyncio.run(engine.update_weights({"model.embed_tokens.weight": embed.detach() + 0.05 * noise}))
        tokens, logprobs, end = run(engine, req)
        assert end.cached_prompt_tokens == 0
        assert tokens != before[0]
        expected = full_forward_logprobs(transformers_twin(engine), prompt, tokens, req.sampling)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)

        # A sequence running when the weights change stores nothing afterwards: its keys and values
        # were computed (in part) with the old weights.
        prompt = recorded_prompts("pi")[1]

        async def update_midway():
            tokens = []
            async for item in engine.generate(request(prompt, max_tokens=40)):
                if isinstance(item, TokenChunk):
                    if not tokens:
                        await engine.update_weights({"model.norm.weight": torch.full((64,), 1.5)})
                    tokens += item.token_ids
            return tokens

        stale = asyncio.run(update_midway())
        assert run(engine, request(prompt, max_tokens=1))[2].cached_prompt_tokens == 0
        # The prompt's blocks are cached again, with the new weights; what the sequence decoded is not.
        extended = request(prompt + tuple(stale) + (2,), max_tokens=1)
        assert run(engine, extended)[2].cached_prompt_tokens == len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS
    finally:
        asyncio.run(engine.stop())


@pytest.mark.anyio
async def test_the_server_reports_the_prompt_tokens_reused(cached):
    server, port = await start_server(cached)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            prompt = recorded_prompts("pi")[1]
            sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0)
            request = inference_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            ends = [[m async for m in stub.Generate(request)][-1] for _ in range(2)]
    finally:
        await server.stop(None)
    assert ends[-1].usage.prompt_tokens == len(prompt)
    assert ends[-1].usage.cached_prompt_tokens == reusable(len(prompt))
