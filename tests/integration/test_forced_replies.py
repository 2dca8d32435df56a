"""The torch engine's forced-replies mode on the tiny model: which reply a call gets, that its tokens
are recorded with the served model's own logprobs (checked against a direct forward of the model),
and that the trainer, scoring them, starts with importance weights of 1 and takes a real step."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gateway.conversation import Conversation, Message, ToolCall, ToolSpec
from polar.config import InferenceConfig
from polar.inference.engines.base import (
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingConfig,
    TokenChunk,
)
from polar.inference.engines.forced import ForcedReplies, ForcedRepliesError
from polar.inference.engines.torch_engine import TorchEngine
from polar.inference.models import resolve_model
from polar.inference.sampling import processed_logprobs
from polar.inference.server import serve_inference
from polar.service_base import ServiceError
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import TrainSequence, pack
from trainer.grpo import LossConfig

pytestmark = pytest.mark.slow

BASH = ToolSpec("bash", "Run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})
WRITE = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi > note.txt"}}\n</tool_call>'
READ = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat note.txt"}}\n</tool_call>'
ANSWER = "Done: note.txt says hi."
FALLBACK = "Nothing to add."
SCRIPT = {
    "replies": [
        {"turn": 0, "prompt_regex": "<tools>", "text": WRITE},
        {"turn": 1, "last_message_regex": "<tool_response>", "text": READ},
        {"turn": 2, "last_message_regex": "<tool_response>\\nhi", "text": ANSWER},
    ],
    "fallback": FALLBACK,
}


def call(id_: str, command: str) -> ToolCall:
    return ToolCall(id_, "bash", {"command": command})


def session_conversation(steps: int) -> tuple[Message, ...]:
    """The instruction and the first `steps` messages after it: the write, its result, the read, its result."""
    after = (
        Message("assistant", tool_calls=(call("a", "echo hi > note.txt"),)),
        Message("tool", "", tool_call_id="a"),
        Message("assistant", tool_calls=(call("b", "cat note.txt"),)),
        Message("tool", "hi", tool_call_id="b"),
    )
    return (Message("user", "Write hi into note.txt, then read it."), *after[:steps])


def session_prompts(hermes) -> list[list[int]]:
    """The prompts of a three-call session: the instruction, then each tool result."""
    return [
        hermes.render_prompt(
            Conversation((Message("system", "You are an agent."), *session_conversation(steps)), tools=(BASH,))
        )
        for steps in (0, 2, 4)
    ]


def reply_text(replies: ForcedReplies, tokenizer, prompt: list[int]) -> str:
    ids = replies.reply(prompt)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.decode(ids[:-1])


def test_each_call_of_a_session_gets_its_reply_and_side_calls_the_fallback(smollm2_tokenizer, hermes) -> None:
    replies = ForcedReplies(SCRIPT, smollm2_tokenizer)
    assert [reply_text(replies, smollm2_tokenizer, p) for p in session_prompts(hermes)] == [WRITE, READ, ANSWER]
    # A side call (a title, a summary) offers no tools: it gets the fallback, as does a call past the script.
    title = Conversation((Message("system", "Write a title."), Message("user", "Write hi into note.txt.")))
    assert reply_text(replies, smollm2_tokenizer, hermes.render_prompt(title)) == FALLBACK
    later = Conversation(
        (*session_conversation(4), Message("assistant", tool_calls=(call("c", "ls"),)), Message("tool", "note.txt")),
        tools=(BASH,),
    )
    assert reply_text(replies, smollm2_tokenizer, hermes.render_prompt(later)) == FALLBACK
    # A conversation the harness opened with an exchange of its own (Qwen Code's context turn)
    # counts its turns from the instruction.
    opened = Conversation(
        (Message("user", "Here is the context."), Message("assistant", "Got it."), *session_conversation(2)),
        tools=(BASH,),
    )
    assert reply_text(replies, smollm2_tokenizer, hermes.render_prompt(opened)) == READ
    # The default fallback.
    defaults = ForcedReplies({"replies": []}, smollm2_tokenizer)
    assert reply_text(defaults, smollm2_tokenizer, hermes.render_prompt(title)) == "Done."


def test_a_bad_script_is_refused_naming_the_entry(smollm2_tokenizer, tmp_path: Path) -> None:
    cases = {
        '{"replies": [{"turn": 0}]}': "replies[0]: a reply is an object with a string 'text'",
        '{"replies": [{"text": "x", "when": 1}]}': "replies[0]: unknown key 'when'",
        '{"replies": [{"text": "x", "turn": -1}]}': "replies[0].turn: must be an integer >= 0",
        '{"replies": [{"text": "x", "prompt_regex": "("}]}': "replies[0].prompt_regex: '(' is not a regex",
        '{"fallback": 3}': "fallback: a reply is an object with a string 'text'",
        '{"reply": []}': "unknown key 'reply'",
        "[": "cannot read the forced-replies script",
    }
    for text, message in cases.items():
        path = tmp_path / "script.json"
        path.write_text(text)
        with pytest.raises(ForcedRepliesError, match=message.replace("(", r"\(").replace("[", r"\[")):
            ForcedReplies.load(path, smollm2_tokenizer)


def test_forced_replies_need_the_torch_engine(tmp_path: Path) -> None:
    config = InferenceConfig(
        engine="scripted", script=str(tmp_path / "s.json"), forced_replies=str(tmp_path / "f.json")
    )
    with pytest.raises(ServiceError, match="forced_replies needs the torch engine, not 'scripted'"):
        asyncio.run(serve_inference(config, ready=lambda port, detail: None))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    script = tmp_path_factory.mktemp("forced") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    engine = TorchEngine(
        EngineOptions(model="tiny", device="cpu", max_batch_size=4, extra={"forced_replies": str(script)})
    )
    yield engine
    asyncio.run(engine.stop())


def generate(engine, prompt: list[int], sampling: SamplingConfig) -> tuple[list[int], list[float], GenerationEnd]:
    async def collect():
        items = [item async for item in engine.generate(GenerationRequest("r", tuple(prompt), sampling))]
        chunks = [item for item in items if isinstance(item, TokenChunk)]
        return [t for c in chunks for t in c.token_ids], [x for c in chunks for x in c.logprobs], items[-1]

    return asyncio.run(collect())


def reference_logprobs(prompt: list[int], tokens: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """Each token's logprob from one full Hugging Face forward pass of the served weights."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()  # [len(tokens), V]
    processed = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return processed.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def sequence(prompt: list[int], tokens: list[int], logprobs: list[float], sampling: SamplingConfig, advantage: float):
    mask = np.array([0] * len(prompt) + [1] * len(tokens), dtype=bool)
    full = lambda value, dtype: np.where(mask, value, 0).astype(dtype)  # noqa: E731
    return TrainSequence(
        name="s/0",
        token_ids=np.array(prompt + tokens, dtype=np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.array([0.0] * len(prompt) + logprobs, dtype=np.float32),
        advantage=advantage,
        token_weight=1.0 / len(tokens),
        temperature=full(sampling.temperature, np.float32),
        top_p=full(sampling.top_p, np.float32),
        top_k=full(sampling.top_k, np.int32),
    )


def test_forced_tokens_carry_the_models_own_logprobs_and_train_at_ratio_one(engine, smollm2_tokenizer, hermes) -> None:
    prompts = session_prompts(hermes)
    sampling = SamplingConfig(max_tokens=64, temperature=0.7)
    tokens, logprobs, end = generate(engine, prompts[1], sampling)
    read = list(smollm2_tokenizer.encode(READ, add_special_tokens=False))
    assert tokens == read + [engine.description.end_of_turn_token_id]
    assert end.finish_reason is FinishReason.STOP and end.completion_tokens == len(tokens)
    expected = reference_logprobs(prompts[1], tokens, sampling)
    np.testing.assert_allclose(logprobs, expected.numpy(), atol=2e-4)
    assert max(logprobs) < -1  # a random model would not have chosen these tokens itself

    # The trainer scores the forced tokens as the engine recorded them: its first step's importance
    # weights are 1, and the step moves their logprobs with the advantage.
    for advantage in (1.0, -1.0):
        trainer = TorchBackend(TorchBackendOptions(model="tiny", device="cpu", lr=1e-2, grad_clip=0.0))
        [batch] = pack([sequence(prompts[1], tokens, logprobs, sampling, advantage)], max_tokens=1024)
        before = trainer.logprobs([batch])[0][batch.loss_mask].numpy()
        np.testing.assert_allclose(before, logprobs, atol=2e-4)
        result = trainer.update([batch], LossConfig())
        assert result.stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert result.stats["ratio_max"] == pytest.approx(1.0, abs=1e-3)
        after = trainer.logprobs([batch])[0][batch.loss_mask].numpy()
        assert (after.sum() - before.sum()) * advantage > 0.1


def test_a_cap_cuts_the_forced_reply_and_truncation_gives_minus_infinity(engine, smollm2_tokenizer, hermes) -> None:
    prompt = session_prompts(hermes)[0]
    tokens, _, end = generate(engine, prompt, SamplingConfig(max_tokens=3, temperature=1.0))
    assert tokens == list(smollm2_tokenizer.encode(WRITE, add_special_tokens=False))[:3]
    assert end.finish_reason is FinishReason.LENGTH
    # Under top-k the random model's top 5 hardly ever holds a forced token: its logprob is -inf, as
    # the trainer computes it, never a made-up number.
    sampling = SamplingConfig(max_tokens=8, temperature=1.0, top_k=5)
    tokens, logprobs, _ = generate(engine, prompt, sampling)
    expected = reference_logprobs(prompt, tokens, sampling).numpy()
    assert np.isneginf(logprobs).any()
    np.testing.assert_array_equal(np.isneginf(logprobs), np.isneginf(expected))
    finite = ~np.isneginf(expected)
    np.testing.assert_allclose(np.array(logprobs)[finite], expected[finite], atol=2e-4)
