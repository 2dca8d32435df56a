"""The upstream APIs the upstream engine speaks (see upstream.py): how a request body is made from a
prompt of token ids and neutral sampling settings, how a response's events read as sampled ids and
logprobs, and how the start-up checks ask for the upstream's model and an encoding.

- ``vllm``: vLLM's OpenAI-compatible ``POST /v1/completions``; ``return_tokens_as_token_ids`` makes
  every token come back as ``"token_id:N"``.
- ``sglang``: SGLang's ``POST /generate``; the sampled ids are in ``meta_info.output_token_logprobs``
  (``[logprob, id, text]`` triples, cumulative while streaming).
- ``nemo_rl``: the HTTP server NeMo RL's vLLM workers expose (``expose_http_server``), which serves
  only ``POST /v1/chat/completions`` and ``POST /tokenize``, with two additions to vLLM's: a request
  may pin the prompt's start to token ids (``required_prefix_token_ids``: the prompt is those ids
  followed by what the chat template renders after the messages' last end-of-turn), and a
  non-streamed reply carries ``prompt_token_ids``, ``generation_token_ids`` and
  ``generation_log_probs`` on its message. The gateway's prompt is sent as that prefix with the
  template's tail cut off (learnt at start by asking ``/tokenize`` to render a pinned prefix), and
  the reply's ``prompt_token_ids`` must be the gateway's prompt, id for id.
"""

from __future__ import annotations

import abc
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polar.inference.engines.upstream_http import UpstreamError, UpstreamHttp

API_KINDS = ("vllm", "sglang", "nemo_rl")


@dataclass(frozen=True)
class Step:
    """What one upstream event (or whole response) adds: sampled ids and logprobs, and the finish."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str | None = None  # the upstream's finish reason ("stop", "length", "abort"), None = more to come


@dataclass(frozen=True)
class UpstreamModel:
    """What the upstream says it serves."""

    name: str  # its model's name or path, for messages
    served_name: str  # what requests ask for (vLLM's "model"); "" where the protocol has none
    context_length: int  # 0 = not reported


# ------------------------------------------------------------------------------------- protocols


class Protocol(abc.ABC):
    """One upstream API: where requests go, their bodies, and how responses read."""

    generate_path: str
    streams = True  # False: a generation's reply is one JSON body, read as one event
    # Whether the start-up checks may send one-token prompts at greedy sampling to find the
    # vocabulary's size: a server that serves only its policy's sampling refuses them.
    probes_vocabulary = True

    @abc.abstractmethod
    def body(self, prompt: list[int], params: dict[str, Any], served_name: str, stream: bool) -> dict[str, Any]:
        """The request body; `params` are the sampling settings in neutral names (see `_params`).
        Raises PromptRefused for a prompt this API cannot send."""

    @abc.abstractmethod
    def reader(self, prompt: list[int]) -> StepReader:
        """A reader of one response's events (or of the whole response) to the generation of `prompt`."""

    @abc.abstractmethod
    async def describe(self, http: UpstreamHttp) -> UpstreamModel:
        """The upstream's model name and context length."""

    @abc.abstractmethod
    async def encode(self, http: UpstreamHttp, model: UpstreamModel, text: str) -> list[int]:
        """How the upstream's tokenizer encodes `text` (without the special tokens a tokenizer adds)."""


class PromptRefused(ValueError):
    """A prompt the upstream's API has no way to be sent."""


class StepReader(abc.ABC):
    @abc.abstractmethod
    def read(self, event: Mapping[str, Any]) -> Step:
        """The new tokens and finish of one decoded JSON event."""


class VLLMCompletions(Protocol):
    """vLLM's /v1/completions with prompt ids, logprobs and tokens returned as ids."""

    generate_path = "/v1/completions"

    def body(self, prompt, params, served_name, stream):
        return {
            "model": served_name,
            "prompt": prompt,
            "max_tokens": params["max_tokens"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
            "top_k": params["top_k"] or -1,
            "seed": params["seed"],
            "stop_token_ids": params["stop_token_ids"],
            "ignore_eos": params["ignore_eos"],
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stream": stream,
        }

    def reader(self, prompt):
        return _VLLMReader()

    async def describe(self, http):
        listing = await http.get_json("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if not data:
            raise UpstreamError(f"the upstream at {http.base} lists no model at GET /v1/models")
        chosen = next((m for m in data if m.get("id") == http.served_model), None) if http.served_model else data[0]
        if chosen is None:
            names = ", ".join(str(m.get("id")) for m in data)
            raise UpstreamError(
                f"the upstream at {http.base} serves no model {http.served_model!r} (it serves {names})"
            )
        return UpstreamModel(
            name=str(chosen.get("root") or chosen["id"]),
            served_name=str(chosen["id"]),
            context_length=int(chosen.get("max_model_len") or 0),
        )

    async def encode(self, http, model, text):
        response = await http.post_json(
            "/tokenize", {"model": model.served_name, "prompt": text, "add_special_tokens": False}
        )
        return [int(t) for t in response["tokens"]]


class _VLLMReader(StepReader):
    def read(self, event):
        choices = event.get("choices") or []
        if not choices:
            return Step((), ())  # a usage-only chunk
        choice = choices[0]
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        ids = tuple(_token_id(token) for token in tokens)
        values = tuple(float(v) for v in logprobs.get("token_logprobs") or [])
        if len(values) != len(ids):
            raise ValueError(f"the upstream sent {len(ids)} tokens with {len(values)} logprobs")
        return Step(ids, values, choice.get("finish_reason"))


def _token_id(token: str) -> int:
    # return_tokens_as_token_ids: every token reads "token_id:N".
    prefix, _, number = str(token).partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise ValueError(
            f"the upstream sent token {token!r}, not 'token_id:N' (is return_tokens_as_token_ids supported?)"
        )
    return int(number)


class SGLangGenerate(Protocol):
    """SGLang's native /generate with input ids and return_logprob."""

    generate_path = "/generate"

    def body(self, prompt, params, served_name, stream):
        sampling = {
            "max_new_tokens": params["max_tokens"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
            "top_k": params["top_k"] or -1,
            "stop_token_ids": params["stop_token_ids"],
            "ignore_eos": params["ignore_eos"],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params["seed"] is not None:
            sampling["sampling_seed"] = params["seed"]
        return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "stream": stream}

    def reader(self, prompt):
        return _SGLangReader()

    async def describe(self, http):
        info = await http.get_json("/get_model_info")
        name = str(info.get("model_path") or info.get("tokenizer_path") or "sglang")
        return UpstreamModel(name=name, served_name="", context_length=int(info.get("context_length") or 0))

    async def encode(self, http, model, text):
        # The prompt's own logprobs carry its ids: logprob_start_len 0 asks for all of them.
        response = await http.post_json(
            "/generate",
            {"text": text, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "logprob_start_len": 0},
        )
        return [int(entry[1]) for entry in response["meta_info"]["input_token_logprobs"]]


class _SGLangReader(StepReader):
    """SGLang streams the output's logprobs so far with every event: only the new tail is a step."""

    def __init__(self) -> None:
        self._seen = 0

    def read(self, event):
        meta = event.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        new = entries[self._seen :]
        self._seen = max(self._seen, len(entries))
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        return Step(tuple(int(e[1]) for e in new), tuple(float(e[0]) for e in new), reason)


class NeMoRLChat(Protocol):
    """NeMo RL's vLLM HTTP server: /v1/chat/completions with the prompt pinned as
    required_prefix_token_ids, answered whole with the token fields on the message.

    Its handler asserts that temperature and top_p equal its policy's (training or validation) and
    that top_k is unset, so both are always sent, as the decimals the task set (Polar keeps them as
    32-bit floats), and top_k only when a task sets one (which it then refuses with its reason)."""

    generate_path = "/v1/chat/completions"
    streams = False  # the token fields are on whole replies only
    probes_vocabulary = False
    # The messages every request renders after its pinned prefix: one user turn, whose rendering
    # ends with its end-of-turn token, then the generation prompt. The text is never sampled from:
    # the prefix replaces everything up to that end-of-turn.
    MESSAGES = ({"role": "user", "content": "."},)

    def __init__(self) -> None:
        self.generation_suffix: tuple[int, ...] = ()  # what the server appends to a pinned prefix

    def body(self, prompt, params, served_name, stream):
        suffix = self.generation_suffix
        if len(prompt) <= len(suffix) or tuple(prompt[-len(suffix) :]) != suffix:
            raise PromptRefused(
                "NeMo RL's server ends every prompt with its chat template's generation prompt "
                f"{list(suffix)}, and this prompt ends otherwise ({list(prompt[-len(suffix) :])})"
            )
        body: dict[str, Any] = {
            "messages": list(self.MESSAGES),
            "required_prefix_token_ids": list(prompt[: -len(suffix)]),
            "max_tokens": params["max_tokens"],
            "temperature": _decimal(params["temperature"]),
            "top_p": _decimal(params["top_p"]),
            "seed": params["seed"],
            "stop_token_ids": params["stop_token_ids"],
            "ignore_eos": params["ignore_eos"],
            "logprobs": True,
            "top_logprobs": 0,
            "skip_special_tokens": False,
            "stream": False,
        }
        if params["top_k"]:
            body["top_k"] = params["top_k"]
        if served_name:
            body["model"] = served_name
        return body

    def reader(self, prompt):
        return _NeMoRLReader(prompt)

    async def describe(self, http):
        model = {"model": http.served_model} if http.served_model else {}
        pinned = (await http.post_json("/tokenize", {**model, "prompt": "Polar", "add_special_tokens": False}))[
            "tokens"
        ]
        rendered = await http.post_json(
            "/tokenize",
            {
                **model,
                "messages": list(self.MESSAGES),
                "add_generation_prompt": True,
                "required_prefix_token_ids": pinned,
            },
        )
        ids = [int(t) for t in rendered["tokens"]]
        if ids[: len(pinned)] != pinned or len(ids) == len(pinned):
            raise UpstreamError(
                f"the upstream at {http.base} does not pin prompts to required_prefix_token_ids (asked to render"
                f" {pinned} before a user turn, it rendered {ids[:16]}...): is it NeMo RL's vLLM HTTP server"
                " (vllm_cfg.expose_http_server)?"
            )
        self.generation_suffix = tuple(ids[len(pinned) :])
        name = http.served_model or "NeMo RL's policy"
        return UpstreamModel(
            name=name, served_name=http.served_model, context_length=int(rendered.get("max_model_len") or 0)
        )

    async def encode(self, http, model, text):
        body = {"prompt": text, "add_special_tokens": False}
        if model.served_name:
            body["model"] = model.served_name
        return [int(t) for t in (await http.post_json("/tokenize", body))["tokens"]]


class _NeMoRLReader(StepReader):
    def __init__(self, prompt: list[int]) -> None:
        self._prompt = list(prompt)

    def read(self, event):
        choice = (event.get("choices") or [])[0]
        message = choice["message"]
        if "generation_token_ids" not in message or "prompt_token_ids" not in message:
            raise ValueError("the reply's message carries no prompt_token_ids and generation_token_ids")
        served = [int(t) for t in message["prompt_token_ids"]]
        if served != self._prompt:
            where = next((i for i, (a, b) in enumerate(zip(served, self._prompt)) if a != b), None)
            where = min(len(served), len(self._prompt)) if where is None else where
            raise ValueError(
                f"the upstream sampled from a prompt of {len(served)} tokens that is not the gateway's"
                f" ({len(self._prompt)} tokens), first differing at token {where}"
            )
        ids = tuple(int(t) for t in message["generation_token_ids"])
        values = tuple(float(v) for v in message.get("generation_log_probs") or [])
        if len(values) != len(ids):
            raise ValueError(f"the upstream sent {len(ids)} tokens with {len(values)} logprobs")
        return Step(ids, values, choice.get("finish_reason"))


def _decimal(value: float) -> float:
    """The shortest decimal whose 32-bit float is `value`'s: 0.7, not 0.699999988079071."""
    single = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", candidate))[0] == single:
            return candidate
    return value


PROTOCOLS: dict[str, type[Protocol]] = {"vllm": VLLMCompletions, "sglang": SGLangGenerate, "nemo_rl": NeMoRLChat}
