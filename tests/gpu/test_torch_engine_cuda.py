"""The torch engine on a CUDA device: the CPU tier's guarantees hold with CUDA graphs and batching.

Runs on the device machine only (`python -m pytest -m gpu tests/gpu`); skipped without CUDA.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from polar.inference.engines.base import EngineOptions, GenerationRequest, SamplingConfig, TokenChunk
from polar.inference.sampling import processed_logprobs
from tests.helpers.transformers_twin import transformers_twin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_BATCH = 32


def _engine(dtype: str):
    from polar.inference.engines.torch_engine import TorchEngine

    engine = TorchEngine(EngineOptions(model="tiny", device="cuda", dtype=dtype, max_batch_size=MAX_BATCH))
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def fp32_engine():
    engine = _engine("float32")
    yield engine
    asyncio.run(engine.stop())


async def _collect(engine, request: GenerationRequest) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for item in engine.generate(request):
        if isinstance(item, TokenChunk):
            tokens += item.token_ids
            logprobs += item.logprobs
    return tokens, logprobs


def _request(i: int, **sampling) -> GenerationRequest:
    generator = torch.Generator().manual_seed(i)
    prompt = torch.randint(3, 49152, (5 + 7 * i,), generator=generator).tolist()
    config = SamplingConfig(max_tokens=16 + i, seed=500 + i, ignore_eos=True, **sampling)
    return GenerationRequest(f"r{i}", tuple(prompt), config)


SAMPLINGS = (
    dict(temperature=0.0),
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=40),
    dict(temperature=0.9, top_k=50, top_p=0.8),
)


def test_batched_equals_one_by_one_on_cuda(fp32_engine):
    requests = [_request(i, **SAMPLINGS[i % len(SAMPLINGS)]) for i in range(24)]
    alone = [asyncio.run(_collect(fp32_engine, r)) for r in requests]

    async def together():
        return await asyncio.gather(*(_collect(fp32_engine, r) for r in requests))

    for (tokens, logprobs), (one_tokens, one_logprobs) in zip(asyncio.run(together()), alone, strict=True):
        assert tokens == one_tokens
        assert logprobs == pytest.approx(one_logprobs, abs=1e-4)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "temperature", "top_k", "top_k_top_p"])
def test_logprobs_equal_a_full_forward_on_cuda(fp32_engine, sampling):
    request = _request(3, **sampling)
    tokens, logprobs = asyncio.run(_collect(fp32_engine, request))
    ids = torch.tensor([list(request.prompt_token_ids) + tokens], device="cuda")
    with torch.no_grad():
        logits = transformers_twin(fp32_engine)(ids).logits[0, len(request.prompt_token_ids) - 1 : -1].float()
    config = request.sampling
    expected = processed_logprobs(logits, config.temperature, config.top_k, config.top_p)
    expected = expected.gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(-1).cpu()
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_bfloat16_serves_and_updates_weights():
    engine = _engine("bfloat16")
    try:
        request = _request(1, temperature=0.0)
        before, _ = asyncio.run(_collect(engine, request))
        name = "model.layers.0.mlp.down_proj.weight"
        spec = engine.parameter_specs()[name]
        version = asyncio.run(engine.update_weights({name: torch.randn(spec.shape) * 0.5}))
        after, _ = asyncio.run(_collect(engine, request))
        assert version == 1 and engine.policy_version == 1
        assert after != before
    finally:
        asyncio.run(engine.stop())


def test_constrained_replies_on_cuda_follow_the_grammar_with_the_masked_logprobs(fp32_engine):
    """32 constrained streams at once (the grammar's bitmasks unpacked on the GPU): every reply is
    admitted by the grammar, and each logprob is that of the masked, renormalised distribution."""
    from polar.inference.constraints import OutputConstraint, TokenGrammar

    schema = {
        "type": "object",
        "properties": {"note": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["note", "n"],
    }
    constraint = OutputConstraint("json_schema", json.dumps(schema))
    requests = [
        GenerationRequest(
            f"c{i}",
            request.prompt_token_ids,
            SamplingConfig(max_tokens=24, seed=700 + i, temperature=1.0, constraint=constraint),
        )
        for i, request in enumerate(_request(i % 4) for i in range(MAX_BATCH))
    ]

    async def together():
        return await asyncio.gather(*(_collect(fp32_engine, r) for r in requests))

    grammar = TokenGrammar.for_model("tiny", fp32_engine.description.vocab_size)
    reference = transformers_twin(fp32_engine)
    for request, (tokens, logprobs) in zip(requests, asyncio.run(together()), strict=True):
        masks = torch.from_numpy(grammar.replay(constraint, tokens)).cuda()
        ids = torch.tensor([list(request.prompt_token_ids) + tokens], device="cuda")
        with torch.no_grad():
            logits = reference(ids).logits[0, len(request.prompt_token_ids) - 1 : -1].float()
        expected = processed_logprobs(logits.masked_fill(~masks, float("-inf")), 1.0)
        expected = expected.gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(-1).cpu()
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_an_idle_engine_keeps_its_cache_unless_told_to_give_it_back(release):
    """By default the keys, values and decode graphs outlive a call, so the next one captures
    nothing again; with release_idle_memory the memory goes back to the driver between calls, for a
    trainer on the same GPU."""
    from polar.inference.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        EngineOptions(model="tiny", device="cuda", max_batch_size=MAX_BATCH, release_idle_memory=release)
    )
    asyncio.run(engine.start())
    try:
        started = torch.cuda.memory_reserved()  # the model, the cache of every slot, the decode graphs
        tokens, _ = asyncio.run(_collect(engine, _request(2)))
        assert len(tokens) == 18
        runner = engine._runner
        if release:
            assert (runner.cache.slots, runner.cache.keys, runner._graphs) == (0, [], {})
            assert torch.cuda.memory_reserved() < started
        else:
            assert runner.cache.slots == MAX_BATCH
            graphs = {bucket: id(graph) for bucket, graph in runner._graphs.items()}
            asyncio.run(_collect(engine, _request(3)))
            assert {bucket: id(graph) for bucket, graph in runner._graphs.items()} == graphs
    finally:
        asyncio.run(engine.stop())
