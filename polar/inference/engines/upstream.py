"""The upstream engine: every generation forwarded to an inference server that Polar does not own.

The upstream takes a prompt as token ids and returns the sampled token ids with their
log-probabilities, so the records stay token-faithful without Polar holding the weights: the ids
recorded are the upstream's, never text encoded again. Two protocols (``EngineOptions.extra["api"]``):

- ``vllm``: vLLM's OpenAI-compatible ``POST /v1/completions`` with the prompt as a list of ids,
  ``logprobs: 0`` (the sampled token's logprob) and ``return_tokens_as_token_ids`` (each token comes
  back as ``"token_id:N"``). Start vLLM with ``--logprobs-mode processed_logprobs``: its default
  reports the untempered full-vocabulary logprob, not that of the distribution the token was drawn
  from (which is what inference.proto promises and what the trainer replays).
- ``sglang``: SGLang's ``POST /generate`` with ``input_ids`` and ``return_logprob``; the sampled ids
  come from ``meta_info.output_token_logprobs`` (``[logprob, id, text]`` triples, cumulative while
  streaming).

Both stream (server-sent events), so tokens reach the gateway as the upstream samples them. Closing a
generation closes its HTTP response, which both servers take as the request's abort. The task's
sampling (temperature, top_p, top_k, max_tokens, seed), the request's stop ids and the model's own
end-of-sequence ids are sent with every request.

At start the engine checks that the upstream's tokenizer is the gateway's (the one of
``EngineOptions.model``, whose folder this engine names as its tokenizer): the same encoding of a probe
text rich in special tokens, BPE merges and non-ASCII text, and the same vocabulary size (ids just
inside and just outside the local vocabulary are sent as prompts: the first must be taken, the second
refused). A difference stops the server with both names. Weights cannot be pushed into a server
Polar does not run: ``fixed_weights`` says so and UpdateWeights answers FAILED_PRECONDITION.

Engine-specific settings (``EngineOptions.extra``; `polar serve inference --upstream-*`):
- ``url``: the upstream's base URL, e.g. ``http://127.0.0.1:8000``, or ``unix:PATH`` for a server on a
  Unix socket (vLLM's ``--uds``) (required).
- ``api``: ``vllm`` (default) or ``sglang``.
- ``served_model``: vLLM's model name to ask for; "" = the first that ``GET /v1/models`` lists.
- ``timeout_s``: seconds the upstream may stay silent (connecting, or between two events) before the
  generation fails (default 120).
"""

from __future__ import annotations

import abc
import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch

from polar.inference import models
from polar.inference.engines.base import (
    Engine,
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ModelDescription,
    ParameterSpec,
    TokenChunk,
    WeightsFixed,
)

API_KINDS = ("vllm", "sglang")
DEFAULT_TIMEOUT_S = 120.0
# Special tokens, code, digits, accents and an emoji: text on which tokenizers that differ in their
# vocabulary, merges or special tokens encode differently.
PROBE_TEXT = (
    "<|im_start|>user\nNaïve café façade — déjà vu? 1234567 tokens; def f(x): return x**2  # 🙂\n"
    "<tool_call>{\"name\": \"ls\", \"arguments\": {}}</tool_call><|im_end|>\n<|im_start|>assistant\n"
)
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
_ERROR_TEXT_LIMIT = 300


class UpstreamError(RuntimeError):
    """The upstream cannot serve as this engine: unreachable, refusing, or with another tokenizer.
    The message names the upstream and says what differs."""


class UpstreamRefused(Exception):
    """The upstream answered a request with an error status; `status` and its body's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


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
    async def describe(self, http: _Http) -> UpstreamModel:
        """The upstream's model name and context length."""

    @abc.abstractmethod
    async def encode(self, http: _Http, model: UpstreamModel, text: str) -> list[int]:
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


# ------------------------------------------------------------------------------------------ HTTP


class _Http:
    """The engine's HTTP client of one upstream: JSON calls and event streams, with the engine's timeouts."""

    def __init__(self, base: str, served_model: str, timeout_s: float) -> None:
        self.base = base.rstrip("/")
        # "unix:PATH": a server listening on a Unix socket (vLLM's --uds); requests name any host.
        self._socket = self.base[len("unix:") :] if self.base.startswith("unix:") else ""
        self._root = "http://localhost" if self._socket else self.base
        self.served_model = served_model
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Generations run at once as the gateway asks: no pool limit of our own.
            connector = aiohttp.UnixConnector(path=self._socket, limit=0) if self._socket else aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self._root + path) as response:
            return await _json_or_refusal(response)

    async def post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        async with self.session.post(self._root + path, json=body) as response:
            return await _json_or_refusal(response)

    def post(self, path: str, body: Mapping[str, Any]):
        return self.session.post(self._root + path, json=body)


async def _json_or_refusal(response) -> Any:
    text = await response.text()
    if response.status >= 400:
        raise UpstreamRefused(response.status, _error_message(text))
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise UpstreamRefused(response.status, f"not JSON: {text[:_ERROR_TEXT_LIMIT]!r}") from None


def _error_message(text: str) -> str:
    """The message of an upstream's error body (OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, SGLang's {"error": {...}} or {"message"}), else its first characters."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:_ERROR_TEXT_LIMIT].strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            for key in ("message", "detail"):
                if error.get(key):
                    return str(error[key])[:_ERROR_TEXT_LIMIT]
        elif isinstance(error, str):
            return error[:_ERROR_TEXT_LIMIT]
        if body.get("detail"):
            return str(body["detail"])[:_ERROR_TEXT_LIMIT]
    return text[:_ERROR_TEXT_LIMIT]


async def _events(response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]` or its end."""
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if isinstance(event, dict) and "error" in event and not event.get("choices") and not event.get("meta_info"):
            raise UpstreamRefused(200, _error_message(payload))
        yield event


# ----------------------------------------------------------------------------------------- engine


class UpstreamEngine(Engine):
    """Generations forwarded to a vLLM or SGLang server; see the module docstring."""

    fixed_weights = (
        "the upstream engine serves a model another server holds: its weights cannot be updated through "
        "Polar (restart that server with the new weights)"
    )

    def __init__(self, options: EngineOptions) -> None:
        extra = options.extra
        url = extra.get("url", "")
        if not url:
            raise ValueError("the upstream engine needs the upstream's URL ([inference] upstream_url, --upstream-url)")
        api = extra.get("api", "vllm")
        if api not in PROTOCOLS:
            raise ValueError(f"upstream api {api!r} is not one of {', '.join(API_KINDS)}")
        self._protocol = PROTOCOLS[api]()
        self._api = api
        self._http = _Http(url, extra.get("served_model", ""), float(extra.get("timeout_s", DEFAULT_TIMEOUT_S)))
        self._folder = models.resolve_model(options.model)
        self._model_spec = options.model
        self._tokenizer = _load_tokenizer(self._folder)
        self._version = options.policy_version
        self._upstream: UpstreamModel | None = None
        self.description = self._describe(0)

    def _describe(self, context_length: int) -> ModelDescription:
        from transformers import AutoConfig

        tokenizer = self._tokenizer
        vocab = tokenizer.get_vocab()
        end_of_turn = next((vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab), -1)
        eos = dict.fromkeys(
            ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
            + [vocab[t] for t in _END_OF_TEXT_TOKENS if t in vocab]
            + ([end_of_turn] if end_of_turn >= 0 else [])
        )
        config = AutoConfig.from_pretrained(self._folder)
        upstream = f" at {self._http.base}" + (f" ({self._upstream.name})" if self._upstream else "")
        return ModelDescription(
            name=models.model_name(self._model_spec),
            vocab_size=int(config.vocab_size),
            eos_token_ids=tuple(eos),
            context_length=context_length or int(config.max_position_embeddings),
            engine="upstream",
            end_of_turn_token_id=end_of_turn,
            bos_token_id=-1 if tokenizer.bos_token_id is None else tokenizer.bos_token_id,
            chat_template=tokenizer.chat_template or "",
            device=f"{self._api}{upstream}",
            tokenizer_path=str(self._folder),
        )

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def upstream(self) -> UpstreamModel | None:
        """What the upstream serves, once started."""
        return self._upstream

    async def start(self) -> None:
        if self._upstream is not None:
            return
        try:
            upstream = await self._start_checks()
        except BaseException:
            await self._http.close()
            raise
        self._upstream = upstream
        self.description = self._describe(upstream.context_length)

    async def _start_checks(self) -> UpstreamModel:
        try:
            upstream = await self._protocol.describe(self._http)
            await self._check_tokenizer(upstream)
        except UpstreamRefused as exc:
            raise UpstreamError(f"the {self._api} upstream at {self._http.base} refused the start-up checks: {exc}") from None
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(f"the {self._api} upstream at {self._http.base} is unreachable: {_describe_error(exc)}") from None
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise UpstreamError(
                f"the upstream at {self._http.base} does not answer like {self._api}: {type(exc).__name__}: {exc}"
            ) from None
        return upstream

    async def _check_tokenizer(self, upstream: UpstreamModel) -> None:
        local = f"{self.description.name} ({self._folder})"
        theirs = f"{upstream.name} at {self._http.base}"
        mine = list(self._tokenizer.encode(PROBE_TEXT, add_special_tokens=self._api == "sglang"))
        other = await self._protocol.encode(self._http, upstream, PROBE_TEXT)
        if mine != other:
            where = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), min(len(mine), len(other)))
            raise UpstreamError(
                f"the upstream's tokenizer is not the gateway's: {local} encodes the probe text as {len(mine)} tokens,"
                f" {theirs} as {len(other)}, first differing at token {where}"
                f" ({mine[where] if where < len(mine) else 'end'} vs {other[where] if where < len(other) else 'end'});"
                " serve the same model upstream or set [inference] model to the upstream's"
            )
        size = self.description.vocab_size
        inside = await self._accepts(upstream, size - 1)
        outside = await self._accepts(upstream, size)
        if not inside or outside:
            relation = "fewer" if not inside else "more"
            raise UpstreamError(
                f"the upstream's vocabulary is not the gateway's: {local} has {size} token ids, {theirs} has {relation}"
                f" (it {'refused' if not inside else 'took'} a prompt of token id {size - 1 if not inside else size})"
            )

    async def _accepts(self, upstream: UpstreamModel, token_id: int) -> bool:
        """Whether the upstream takes a one-token prompt of this id (4xx: it refuses the id)."""
        params = _params(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop_token_ids=[], ignore_eos=False)
        body = self._protocol.body([token_id], params, upstream.served_name, stream=False)
        try:
            await self._http.post_json(self._protocol.generate_path, body)
        except UpstreamRefused as exc:
            if 400 <= exc.status < 500:
                return False
            raise
        return True

    async def stop(self) -> None:
        await self._http.close()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        await self.start()
        submitted = time.monotonic()
        queue_seconds = 0.0
        completion = 0
        prompt = len(request.prompt_token_ids)
        s = request.sampling
        stops = dict.fromkeys(s.stop_token_ids + (() if s.ignore_eos else self.description.eos_token_ids))
        params = _params(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p if 0 < s.top_p < 1 else 1.0,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=list(stops),
            ignore_eos=s.ignore_eos,
        )
        body = self._protocol.body(list(request.prompt_token_ids), params, self._upstream.served_name, stream=True)
        reader = self._protocol.reader()
        finish: str | None = None
        try:
            # Leaving this block (the caller closed the generation) closes the response: the
            # upstream sees its client go and aborts the request.
            async with self._http.post(self._protocol.generate_path, body) as response:
                if response.status >= 400:
                    raise UpstreamRefused(response.status, _error_message(await response.text()))
                async for event in _events(response):
                    step = reader.read(event)
                    if step.token_ids:
                        if completion == 0:
                            queue_seconds = time.monotonic() - submitted
                        completion += len(step.token_ids)
                        yield TokenChunk(step.token_ids, step.logprobs, self._version)
                    if step.finish is not None:
                        finish = step.finish
                        break
        except UpstreamRefused as exc:
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, f"the upstream refused the generation: {exc}")
            return
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            error = f"the upstream at {self._http.base} failed: {_describe_error(exc)}"
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, error)
            return
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            error = f"the upstream's response is unreadable: {type(exc).__name__}: {exc}"
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, error)
            return
        if finish is None:
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, "the upstream ended the stream without a finish reason")
            return
        yield self._end(_finish_reason(finish, completion, s.max_tokens), prompt, completion, queue_seconds)

    @staticmethod
    def _end(reason: FinishReason, prompt: int, completion: int, queue_seconds: float, error: str = "") -> GenerationEnd:
        return GenerationEnd(reason, prompt, completion, queue_seconds, error)

    def parameter_specs(self) -> Mapping[str, ParameterSpec]:
        return {}

    async def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        raise WeightsFixed(self.fixed_weights)


def _params(**values: Any) -> dict[str, Any]:
    return values


def _finish_reason(reason: str, completion: int, max_tokens: int) -> FinishReason:
    if reason == "stop":
        return FinishReason.STOP
    if reason == "length":
        # Both servers say "length" for max_tokens and for a full context window.
        return FinishReason.LENGTH if completion >= max_tokens else FinishReason.CONTEXT_LENGTH
    if reason == "abort":
        return FinishReason.ABORTED
    return FinishReason.ERROR


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer within the timeout (upstream timeout_s)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
