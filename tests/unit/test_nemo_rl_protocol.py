"""The upstream engine's `nemo_rl` API (NeMo RL's vLLM HTTP server): how a gateway prompt becomes a
request pinned to its ids, and how a reply is read. Against a server: tests/integration/test_upstream_vllm.py."""

from __future__ import annotations

import struct

import pytest

from polar.inference.engines.upstream_protocols import NeMoRLChat, PromptRefused

SUFFIX = (2, 198, 1, 520, 198)  # what the server renders after a pinned prefix
PARAMS = {
    "max_tokens": 16,
    "temperature": struct.unpack("f", struct.pack("f", 0.7))[0],  # as a task's 32-bit float holds it
    "top_p": 1.0,
    "top_k": 0,
    "seed": 3,
    "stop_token_ids": [2],
    "ignore_eos": False,
}


def protocol() -> NeMoRLChat:
    chat = NeMoRLChat()
    chat.generation_suffix = SUFFIX
    return chat


def test_the_prompt_is_pinned_up_to_the_generation_prompt_the_server_appends():
    body = protocol().body([1, 9690, 42, 43, *SUFFIX], PARAMS, "policy", stream=True)
    assert body["required_prefix_token_ids"] == [1, 9690, 42, 43]
    assert body["messages"] == [{"role": "user", "content": "."}]
    assert body["stream"] is False and body["logprobs"] is True and body["top_logprobs"] == 0
    # NeMo RL compares them with its policy's decimals.
    assert body["temperature"] == 0.7 and body["top_p"] == 1.0
    assert "top_k" not in body and body["model"] == "policy"
    assert protocol().body([5, *SUFFIX], {**PARAMS, "top_k": 20}, "", stream=False)["top_k"] == 20


@pytest.mark.parametrize("prompt", [[1, 9690, 42], list(SUFFIX), [1, *SUFFIX[1:]]])
def test_a_prompt_not_ending_with_the_generation_prompt_is_refused(prompt):
    with pytest.raises(PromptRefused, match="ends every prompt with its chat template's generation prompt"):
        protocol().body(prompt, PARAMS, "", stream=False)


def reply(prompt: list[int], **message) -> dict:
    fields = {"prompt_token_ids": prompt, "generation_token_ids": [7, 8, 2], "generation_log_probs": [-0.5, -1.0, 0.0]}
    return {"choices": [{"index": 0, "message": {"role": "assistant", **fields, **message}, "finish_reason": "stop"}]}


def test_a_reply_reads_as_the_ids_and_logprobs_the_server_sampled():
    prompt = [1, 9690, *SUFFIX]
    step = protocol().reader(prompt).read(reply(prompt))
    assert (step.token_ids, step.logprobs, step.finish) == ((7, 8, 2), (-0.5, -1.0, 0.0), "stop")


def test_a_reply_sampled_from_another_prompt_is_unreadable():
    prompt = [1, 9690, *SUFFIX]
    with pytest.raises(ValueError, match="not the gateway's .* first differing at token 1"):
        protocol().reader(prompt).read(reply([1, 9691, *SUFFIX]))


def test_a_reply_without_the_token_fields_or_with_missing_logprobs_is_unreadable():
    prompt = [1, *SUFFIX]
    plain = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    with pytest.raises(ValueError, match="carries no prompt_token_ids"):
        protocol().reader(prompt).read(plain)
    with pytest.raises(ValueError, match="3 tokens with 2 logprobs"):
        protocol().reader(prompt).read(reply(prompt, generation_log_probs=[-0.5, -1.0]))
