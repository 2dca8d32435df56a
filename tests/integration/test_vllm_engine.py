"""The vLLM engine against a Hugging Face forward pass, on smollm2-135m.

Runs only in the environment that scripts/setup_vllm.sh builds (.venv-vllm); elsewhere `import
vllm` fails and the module is skipped. One engine serves every test: the tier's (`vllm_engine`,
tests/integration/conftest.py), which the constrained-decoding tests drive too.

Logprob tolerance: vLLM and the reference both run the model in fp32 on the CPU, but with different
kernels (vLLM's oneDNN/SGL GEMMs and its paged-attention kernel, against PyTorch's matmul and
SDPA), so sums are accumulated in a different order and the logprobs differ in their last bits
(batching alone moves them by ~5e-6). 2e-3 leaves ample room for that while still catching any
semantic error: a temperature, top-k or top-p left out, or raw instead of processed logprobs,
changes the values by 0.05 or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run scripts/setup_vllm.sh and use .venv-vllm")

import torch
from transformers import AutoModelForCausalLM

from polar.inference import models
from polar.inference.engines.base import (
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingConfig,
    TokenChunk,
    WeightUpdateError,
)

pytestmark = [pytest.mark.vllm, pytest.mark.anyio, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"
LOGPROB_ATOL = 2e-3
PROMPT = (1, 9690, 1229, 28, 314, 1488, 34, 30, 223, 17, 1340, 282, 253, 1025, 30, 2, 198)
UPDATED = "model.layers.3.mlp.down_proj.weight"
# Halves of fused layers (q/k/v, gate/up): vLLM reloads such a layer whole, so an update of one half
# must leave the other as it was.
FUSED_HALVES = ("model.layers.5.self_attn.q_proj.weight", "model.layers.7.mlp.gate_proj.weight")


@pytest.fixture
def engine(vllm_engine):
    """The tier's engine (tests/integration/conftest.py)."""
    return vllm_engine


@pytest.fixture(scope="module")
def chat_prompt():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve_model(MODEL))
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(models.resolve_model(MODEL), dtype=torch.float32)
    return model.eval()


def request(max_tokens=12, prompt=PROMPT, **sampling) -> GenerationRequest:
    return GenerationRequest("t", tuple(prompt), SamplingConfig(max_tokens=max_tokens, **sampling))


async def collect(engine, req):
    tokens, logprobs, versions, end = [], [], [], None
    async for item in engine.generate(req):
        if isinstance(item, TokenChunk):
            tokens += item.token_ids
            logprobs += item.logprobs
            versions += [item.policy_version] * len(item.token_ids)
        else:
            assert isinstance(item, GenerationEnd)
            end = item
    return tokens, logprobs, versions, end


@torch.no_grad()
def reference_logits(model, prompt, tokens) -> torch.Tensor:
    """Logits that predicted each of `tokens` after `prompt`, in fp32."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The documented distribution: logits / T, top-k, then top-p (keep the smallest set of the most
    likely tokens whose mass reaches top_p), renormalised."""
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
        drop = (mass_before >= top_p).scatter(-1, order, mass_before >= top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.log_softmax(-1)


async def test_description(engine):
    d = engine.description
    im_end = 2  # SmolLM2's <|im_end|>
    assert d.engine == "vllm" and d.device == "cpu" and d.dtype == "float32"
    assert im_end in d.eos_token_ids and d.end_of_turn_token_id == im_end
    assert d.context_length == 1024 and d.vocab_size == 49152
    assert "<|im_start|>" in d.chat_template
    assert d.parameter_count == sum(torch.Size(s.shape).numel() for s in engine.parameter_specs().values())
    assert 130_000_000 < d.parameter_count < 140_000_000
    assert engine.parameter_specs()[UPDATED].shape == (576, 1536)


async def test_greedy_is_deterministic_and_logprobs_match_a_reference_forward(engine, reference):
    first = await collect(engine, request(temperature=0.0, ignore_eos=True))
    second = await collect(engine, request(temperature=0.0, ignore_eos=True))
    tokens, logprobs, versions, end = first
    assert (tokens, logprobs) == (second[0], second[1])
    assert len(tokens) == 12 and end.finish_reason is FinishReason.LENGTH
    assert end.prompt_tokens == len(PROMPT) and end.completion_tokens == 12
    assert versions == [0] * 12

    expected = reference_logits(reference, PROMPT, tokens).log_softmax(-1)
    assert tokens == expected.argmax(-1).tolist()
    sampled = expected.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), sampled, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.8, 0, 0.9), (0.9, 30, 0.8)],
)
async def test_sampled_logprobs_are_those_of_the_processed_distribution(engine, reference, temperature, top_k, top_p):
    req = request(max_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, seed=11, ignore_eos=True)
    tokens, logprobs, _, _ = await collect(engine, req)
    assert len(tokens) == 10

    expected = processed_logprobs(reference_logits(reference, PROMPT, tokens), temperature, top_k, top_p)
    sampled = expected.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.isfinite(sampled).all(), "a token outside the truncated support was sampled"
    torch.testing.assert_close(torch.tensor(logprobs), sampled, atol=LOGPROB_ATOL, rtol=0)


async def test_same_seed_gives_the_same_tokens_even_when_batched_with_others(engine):
    def seeded(seed):
        return request(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(collect(engine, seeded(s)) for s in (5, 5, 6, 7, 8)))

    alone = await collect(engine, seeded(5))
    results = await run()
    # Same tokens; the logprobs may move in the last bits, since a batch of five runs through
    # GEMMs blocked differently from a batch of one.
    assert results[0][0] == results[1][0] == alone[0]
    for _tokens, logprobs, _, _ in results[:2]:
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(alone[1]), atol=LOGPROB_ATOL, rtol=0)
    assert any(r[0] != alone[0] for r in results[2:])


async def test_stop_token_ends_generation_and_is_returned(engine):
    tokens, _, _, _ = await collect(engine, request(temperature=0.0, ignore_eos=True))
    stop = tokens[4]
    first = tokens.index(stop)
    stopped, _, _, end = await collect(engine, request(temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)))
    assert stopped == tokens[: first + 1]
    assert end.finish_reason is FinishReason.STOP and end.completion_tokens == first + 1


async def test_eos_ends_a_chat_turn_unless_ignored(engine, chat_prompt):
    eos = engine.description.eos_token_ids
    tokens, _, _, end = await collect(engine, request(max_tokens=200, prompt=chat_prompt, temperature=0.0))
    assert end.finish_reason is FinishReason.STOP
    assert tokens[-1] in eos and not any(t in eos for t in tokens[:-1])

    longer, _, _, end = await collect(
        engine, request(max_tokens=len(tokens) + 3, prompt=chat_prompt, temperature=0.0, ignore_eos=True)
    )
    assert longer[: len(tokens)] == tokens
    assert len(longer) == len(tokens) + 3 and end.finish_reason is FinishReason.LENGTH


async def test_closing_the_stream_aborts_the_request(engine):
    async def run():
        stream = engine.generate(request(max_tokens=500, temperature=1.0, ignore_eos=True))
        first = await anext(stream)
        assert isinstance(first, TokenChunk)
        await stream.aclose()
        for _ in range(100):
            if engine._llm.get_num_unfinished_requests() == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert await run(), "vLLM still holds the closed request"
    tokens, _, _, end = await collect(engine, request(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(tokens) == 3 and end.finish_reason is FinishReason.LENGTH


def _bytes_written() -> int:
    """Bytes this process and its children (vLLM's engine core and worker) passed to write calls
    so far: any file written, on disk or tmpfs, counts; a copy into shared memory does not."""
    import psutil

    pids = [os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))]
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):  # a child that ended meanwhile
            lines = Path(f"/proc/{pid}/io").read_text().splitlines()
            total += int(next(line for line in lines if line.startswith("wchar:")).split()[1])
    return total


async def test_update_weights_changes_outputs_and_version_without_writing_a_checkpoint(engine, reference):
    greedy = request(temperature=0.0, ignore_eos=True)
    before, _, _, _ = await collect(engine, greedy)
    version = engine.policy_version
    names = (UPDATED, *FUSED_HALVES)
    originals = {name: reference.state_dict()[name].clone() for name in names}

    with pytest.raises(WeightUpdateError):
        await engine.update_weights({"model.nope.weight": torch.zeros(3)})
    with pytest.raises(WeightUpdateError):
        await engine.update_weights({UPDATED: torch.zeros(3, 4)})
    assert engine.policy_version == version

    changed = {name: t * factor for (name, t), factor in zip(originals.items(), (3.0, 1.5, -1.0))}
    written = _bytes_written()
    assert await engine.update_weights(changed) == version + 1
    # The tensors reach vLLM's worker through the engine's block of shared memory: no checkpoint
    # is written anywhere (one would be the whole model, 538 MB; the RPCs write a few KB).
    written = _bytes_written() - written
    model_bytes = sum(torch.Size(s.shape).numel() * 4 for s in engine.parameter_specs().values())
    assert written < model_bytes / 100, f"{written} bytes written during the update"
    assert engine.policy_version == version + 1
    tokens, logprobs, versions, _ = await collect(engine, greedy)
    assert tokens != before
    assert versions == [version + 1] * len(tokens)

    # vLLM now computes what the Hugging Face model computes with the same changes, so the reload
    # left every other (fused, repacked) weight intact.
    with torch.no_grad():
        for name, tensor in changed.items():
            reference.get_parameter(name).copy_(tensor)
    try:
        expected = reference_logits(reference, PROMPT, tokens).log_softmax(-1)
    finally:
        with torch.no_grad():
            for name, tensor in originals.items():
                reference.get_parameter(name).copy_(tensor)
    assert tokens == expected.argmax(-1).tolist()
    sampled = expected.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), sampled, atol=LOGPROB_ATOL, rtol=0)

    # Restoring the weights restores the output: nothing computed with the changed weights (KV in
    # the prefix cache) is reused.
    assert await engine.update_weights(originals) == version + 2
    assert (await collect(engine, greedy))[0] == before


async def test_update_during_generation_labels_tokens_with_their_version(engine, reference):
    same = reference.state_dict()[UPDATED].clone()

    async def run():
        version = engine.policy_version
        versions, end, update = [], None, None
        async for item in engine.generate(request(max_tokens=300, temperature=0.0, ignore_eos=True)):
            if isinstance(item, TokenChunk):
                versions += [item.policy_version] * len(item.token_ids)
                if update is None and len(versions) >= 5:
                    update = asyncio.create_task(engine.update_weights({UPDATED: same}))
            else:
                end = item
        assert await update == version + 1
        return version, versions, end

    version, versions, end = await run()
    assert end.finish_reason is FinishReason.LENGTH and len(versions) == 300
    assert versions == sorted(versions) and versions[0] == version and versions[-1] == version + 1


async def test_a_constrained_reply_follows_its_schema_with_the_logprobs_of_the_masked_distribution(
    engine, chat_prompt, reference
):
    import json

    import jsonschema

    from polar.inference.constraints import OutputConstraint, TokenGrammar

    schema = {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    constraint = OutputConstraint("tool_call", json.dumps(schema), "<tool_call>\n", "\n</tool_call>")
    grammar = TokenGrammar.for_model(MODEL, engine.description.vocab_size)
    for seed in range(4):
        req = request(max_tokens=60, prompt=chat_prompt, temperature=1.0, seed=seed, constraint=constraint)
        tokens, logprobs, _, end = await collect(engine, req)
        assert end.finish_reason is FinishReason.STOP
        text = grammar.tokenizer.decode_str(tokens[:-1])
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        jsonschema.validate(json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")), schema)
        # The trainer's replay: the same masks, then the documented distribution.
        masks = torch.from_numpy(grammar.replay(constraint, tokens))
        logits = reference_logits(reference, chat_prompt, tokens).masked_fill(~masks, float("-inf"))
        expected = processed_logprobs(logits, 1.0, 0, 1.0).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


async def test_a_grammar_dead_end_ends_only_its_own_streams_with_an_error(engine, grammar_dead_end_file):
    """A grammar that allows no next token (the grammar library faked in vLLM's engine core through
    tests/vllm_hooks, switched on for this batch alone: real masks, then none from the fourth on):
    vLLM samples from a row of -inf and its grammar refuses the token. That token is never passed
    on; the constrained streams end with the torch engine's dead-end error, and the free stream of
    the same batch is untouched."""
    import json

    from polar.inference.constraints import OutputConstraint

    healthy = 3
    story = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    constraint = OutputConstraint("json_schema", json.dumps(story))

    async def batch():
        return await asyncio.gather(
            collect(engine, request(seed=1, constraint=constraint)),
            collect(engine, request(seed=2, constraint=constraint)),
            collect(engine, request(seed=3, ignore_eos=True)),
        )

    grammar_dead_end_file.write_text(str(healthy))
    try:
        *constrained, (free_tokens, _, _, free_end) = await asyncio.wait_for(batch(), 120)
    finally:
        grammar_dead_end_file.unlink()
    for tokens, logprobs, _, end in constrained:
        assert end.finish_reason is FinishReason.ERROR
        assert end.error == "constraint: its grammar allows no next token"
        assert len(tokens) == healthy and end.completion_tokens == healthy
        assert all(math.isfinite(logprob) for logprob in logprobs)
    assert free_end.finish_reason is FinishReason.LENGTH and len(free_tokens) == 12
