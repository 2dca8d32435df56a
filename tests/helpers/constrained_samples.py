"""Constrained calls sampled by the torch engine on the tiny model, and the traces the trainer packs
from them: shared by the torch and the megatron backends' tests of training on constrained calls."""

from __future__ import annotations

import asyncio
import json

from polar.inference.constraints import OutputConstraint
from polar.inference.engines import EngineOptions, create_engine
from polar.inference.engines.base import GenerationRequest, SamplingConfig, TokenChunk
from polar.v1 import common_pb2

PROMPT = [1, 504, 3570, 28, 9174, 30, 2, 198, 1, 520, 9531, 198]
MAX_TOKENS = 40
TOOL_CALL = OutputConstraint(
    "tool_call",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
                    "required": ["city", "days"],
                },
            },
            "required": ["name", "arguments"],
        }
    ),
    "<tool_call>\n",
    "\n</tool_call>",
)
ANSWER = OutputConstraint("json_schema", json.dumps({"type": "object", "properties": {"note": {"type": "string"}}}))
# fp32 on the CPU: the engine's decode steps against the trainer's one forward over the whole trace.
ATOL = 2e-5


def sample_constrained(samplings, prompt=PROMPT) -> list[tuple[OutputConstraint, dict, list[int], list[float]]]:
    """Per (constraint, sampling) pair: (constraint, sampling, sampled ids, recorded logprobs), sampled
    by the torch engine on the tiny model after `prompt` (seeded by the pair's position)."""
    engine = create_engine("torch", EngineOptions(model="tiny", device="cpu", max_batch_size=4))

    async def sample(constraint, sampling, seed):
        config = SamplingConfig(max_tokens=MAX_TOKENS, seed=seed, constraint=constraint, **sampling)
        tokens, logprobs = [], []
        async for item in engine.generate(GenerationRequest(f"r{seed}", tuple(prompt), config)):
            if isinstance(item, TokenChunk):
                tokens += item.token_ids
                logprobs += item.logprobs
        return constraint, sampling, tokens, logprobs

    async def all_samples():
        try:
            return await asyncio.gather(*(sample(c, s, seed) for seed, (c, s) in enumerate(samplings)))
        finally:
            await engine.stop()

    return asyncio.run(all_samples())


def constrained_trajectory(constraint, sampling, tokens, logprobs, *, recorded_constraint=True, prompt=PROMPT):
    """(trajectory, its one trace): the prompt, then the call's sampled tokens, trainable; the call's
    record names its constraint unless `recorded_constraint` is False."""
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, **sampling)
    if recorded_constraint:
        params.constraint.CopyFrom(constraint.to_proto(common_pb2.OutputConstraint))
    end = len(prompt) + len(tokens)
    trace = common_pb2.Trace(
        trace_id="t0",
        token_ids=list(prompt) + tokens,
        loss_mask=[0] * len(prompt) + [1] * len(tokens),
        behaviour_logprobs=[0.0] * len(prompt) + logprobs,
        segments=[
            common_pb2.TraceSegment(kind=common_pb2.TraceSegment.KIND_PROMPT, start=0, end=len(prompt), call_id="c1"),
            common_pb2.TraceSegment(
                kind=common_pb2.TraceSegment.KIND_SAMPLED, start=len(prompt), end=end, call_id="c1", sampling=params
            ),
        ],
        weight=1.0,
    )
    return common_pb2.Trajectory(trajectory_id="s", session_id="s", traces=[trace]), trace
