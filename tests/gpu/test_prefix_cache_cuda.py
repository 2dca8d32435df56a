"""The torch engine's prefix cache on a CUDA device, with CUDA graphs: sessions of a recorded CLI
prompt, run together, give what an engine without the cache gives.

Runs on the device machine only (`python -m pytest -m gpu tests/gpu`); skipped without CUDA.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from polar.inference.engines.base import EngineOptions, GenerationEnd, GenerationRequest, SamplingConfig, TokenChunk
from polar.inference.engines.prefix_cache import BLOCK_TOKENS
from polar.trajectory.session_file import read_trajectory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SESSIONS = Path(__file__).resolve().parent.parent / "fixtures" / "sessions"


def _engine(**options):
    from polar.inference.engines.torch_engine import TorchEngine

    engine = TorchEngine(EngineOptions(model="tiny", device="cuda", dtype="float32", max_batch_size=16, **options))
    asyncio.run(engine.start())
    return engine


async def _collect(engine, request: GenerationRequest) -> tuple[list[int], list[float], GenerationEnd]:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for item in engine.generate(request):
        if isinstance(item, TokenChunk):
            tokens += item.token_ids
            logprobs += item.logprobs
        else:
            end = item
    return tokens, logprobs, end


def test_sessions_of_a_recorded_prompt_equal_an_engine_without_the_cache_on_cuda():
    calls = sorted(read_trajectory(SESSIONS / "codex.json.zst").calls, key=lambda call: call.call_id)
    shared = tuple(calls[0].prompt_token_ids)
    generator = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest(
            f"s{i}",
            shared + tuple(torch.randint(3, 49152, (3 + i,), generator=generator).tolist()),
            SamplingConfig(max_tokens=24, seed=i, ignore_eos=True, temperature=(0.0, 0.9)[i % 2]),
        )
        for i in range(12)
    ]
    cached, uncached = _engine(), _engine(prefix_cache_mib=0)
    try:

        async def together(engine):
            return await asyncio.gather(*(_collect(engine, r) for r in requests))

        first, again = asyncio.run(together(cached)), asyncio.run(together(cached))
        expected = [asyncio.run(_collect(uncached, r)) for r in requests]
    finally:
        asyncio.run(cached.stop())
        asyncio.run(uncached.stop())
    for result, reference in zip(first + again, expected + expected, strict=True):
        assert result[0] == reference[0]
        assert result[1] == pytest.approx(reference[1], abs=1e-4)
    blocks = len(shared) // BLOCK_TOKENS * BLOCK_TOKENS
    assert sorted(end.cached_prompt_tokens for _, _, end in first) == [0] + [blocks] * 11
    assert all(end.cached_prompt_tokens >= blocks for _, _, end in again)
