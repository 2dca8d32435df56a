"""The two upstream APIs the upstream engine speaks (see upstream.py): how a request body is made
from a prompt of token ids and neutral sampling settings, how a response's events read as sampled ids
and logprobs, and how the start-up checks ask for the upstream's model and an encoding.

- ``vllm``: vLLM's OpenAI-compatible ``POST /v1/completions``; ``return_tokens_as_token_ids`` makes
  every token come back as ``"token_id:N"``.
- ``sglang``: SGLang's ``POST /generate``; the sampled ids are in ``meta_info.output_token_logprobs``
  (``[logprob, id, text]`` triples, cumulative while streaming).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polar.inference.engines.upstream_http import UpstreamError, UpstreamHttp

API_KINDS = ("vllm", "sglang")


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

    @abc.abstractmethod
    def body(self, prompt: list[int], params: dict[str, Any], served_name: str, stream: bool) -> dict[str, Any]:
        """The request body; `params` are the sampling settings in neutral names (see `_params`)."""

    @abc.abstractmethod
    def reader(self) -> StepReader:
        """A reader of one response's events (or of the whole response)."""

    @abc.abstractmethod
    async def describe(self, http: UpstreamHttp) -> UpstreamModel:
        """The upstream's model name and context length."""

    @abc.abstractmethod
    async def encode(self, http: UpstreamHttp, model: UpstreamModel, text: str) -> list[int]:
        """How the upstream's tokenizer encodes `text` (without the special tokens a tokenizer adds)."""


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

    def reader(self) -> StepReader:
        return _VLLMReader()

    async def describe(self, http):
        listing = await http.get_json("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if not data:
            raise UpstreamError(f"the upstream at {http.base} lists no model at GET /v1/models")
        chosen = next((m for m in data if m.get("id") == http.served_model), None) if http.served_model else data[0]
        if chosen is None:
            names = ", ".join(str(m.get("id")) for m in data)
            raise UpstreamError(f"the upstream at {http.base} serves no model {http.served_model!r} (it serves {names})")
        return UpstreamModel(
            name=str(chosen.get("root") or chosen["id"]),
            served_name=str(chosen["id"]),
            context_length=int(chosen.get("max_model_len") or 0),
        )

    async def encode(self, http, model, text):
        response = await http.post_json("/tokenize", {"model": model.served_name, "prompt": text, "add_special_tokens": False})
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
        raise ValueError(f"the upstream sent token {token!r}, not 'token_id:N' (is return_tokens_as_token_ids supported?)")
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

    def reader(self) -> StepReader:
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


PROTOCOLS: dict[str, type[Protocol]] = {"vllm": VLLMCompletions, "sglang": SGLangGenerate}
