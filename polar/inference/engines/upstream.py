"""The upstream engine: every generation forwarded to an inference server that Polar does not own.

vLLM (``POST /v1/completions``) or SGLang (``POST /generate``) takes the prompt as token ids and
streams back sampled ids with their logprobs, so records stay token-faithful; NeMo RL's vLLM HTTP
server takes it pinned to token ids and answers the ids it sampled from and sampled, whole. At start
the upstream's tokenizer is checked against the gateway's. The protocols, the check and the settings
(``EngineOptions.extra``): docs/design/engines.md.

With a LoRA adapter (``lora_rank`` or ``adapter``; the vllm api only) the engine writes each version
of an adapter as a PEFT folder into ``adapter_dir``, which the upstream reads at the same path, loads
it there under a name of its own (vLLM's ``POST /v1/load_lora_adapter``), and asks for that name as
the request's model (peft_adapters.py); a push replaces the adapter alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch

from polar import lora
from polar.inference import models
from polar.inference.engines.base import (
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ModelDescription,
    ParameterSpec,
    TokenChunk,
    UnknownAdapter,
    WeightsFixed,
)
from polar.inference.engines.peft_adapters import FolderAdapterEngine, HeldAdapters, ServedVersion
from polar.inference.engines.upstream_http import (
    UpstreamError,
    UpstreamHttp,
    UpstreamRefused,
    error_message,
    events,
    whole_body,
)
from polar.inference.engines.upstream_protocols import API_KINDS, PROTOCOLS, PromptRefused, UpstreamModel

DEFAULT_TIMEOUT_S = 120.0
# Special tokens, code, digits, accents and an emoji: text on which tokenizers that differ in their
# vocabulary, merges or special tokens encode differently.
PROBE_TEXT = (
    "<|im_start|>user\nNaïve café façade — déjà vu? 1234567 tokens; def f(x): return x**2  # 🙂\n"
    '<tool_call>{"name": "ls", "arguments": {}}</tool_call><|im_end|>\n<|im_start|>assistant\n'
)
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


_FIXED_WEIGHTS = (
    "the upstream engine serves a model another server holds: its weights cannot be updated through "
    "Polar (restart that server with the new weights, or serve a LoRA adapter: lora_rank)"
)


class UpstreamEngine(FolderAdapterEngine):
    """Generations forwarded to a vLLM, SGLang or NeMo RL server; see the module docstring."""

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
        self._http = UpstreamHttp(url, extra.get("served_model", ""), float(extra.get("timeout_s", DEFAULT_TIMEOUT_S)))
        self._folder = models.resolve_model(options.model)
        self._model_spec = options.model
        self._tokenizer = _load_tokenizer(self._folder)
        self._version = options.policy_version
        self._upstream: UpstreamModel | None = None
        self.description = self._describe(0)
        self.fixed_weights = _FIXED_WEIGHTS
        self._held: HeldAdapters | None = None
        self._adapter_dir = extra.get("adapter_dir", "")
        if options.adapter or options.lora_rank or options.max_adapters:
            if api != "vllm":
                raise ValueError(
                    f"the {api} upstream api loads no LoRA adapters: the upstream engine serves them through "
                    'vLLM\'s runtime adapter loading (upstream_api = "vllm")'
                )
            if not self._adapter_dir:
                raise ValueError(
                    "LoRA adapters on the upstream engine need [inference] upstream_adapter_dir: a folder the "
                    "upstream server reads at the same path, where each adapter version is written"
                )
            self._held = HeldAdapters(self._folder, options, torch.float32, self._load_lora, self._unload_lora)
            self.max_adapters = options.max_adapters
            self.fixed_weights = ""

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
        return self._held.version("") if self._held is not None else self._version

    @property
    def upstream(self) -> UpstreamModel | None:
        """What the upstream serves, once started."""
        return self._upstream

    async def start(self) -> None:
        if self._upstream is not None:
            return
        try:
            upstream = await self._start_checks()
            if self._held is not None:
                root = Path(self._adapter_dir).resolve()
                root.mkdir(parents=True, exist_ok=True)
                await self._held.start(root)
        except BaseException:
            await self._http.close()
            raise
        self._upstream = upstream
        self.description = self._describe(upstream.context_length)

    async def _load_lora(self, served: ServedVersion) -> None:
        body = {"lora_name": served.name, "lora_path": str(served.folder)}
        try:
            await self._http.post_for_text("/v1/load_lora_adapter", body)
        except UpstreamRefused as exc:
            hint = (
                ": start it with --enable-lora and the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                if exc.status == 404
                else ""
            )
            raise lora.LoraError(
                f"the upstream at {self._http.base} did not load LoRA adapter {served.folder} ({exc}){hint}"
            ) from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise UpstreamError(
                f"the upstream at {self._http.base} is unreachable to load a LoRA adapter: {_describe_error(exc)}"
            ) from None

    async def _unload_lora(self, served: ServedVersion) -> None:
        await self._http.post_for_text("/v1/unload_lora_adapter", {"lora_name": served.name})

    async def _start_checks(self) -> UpstreamModel:
        try:
            upstream = await self._protocol.describe(self._http)
            await self._check_tokenizer(upstream)
        except UpstreamRefused as exc:
            raise UpstreamError(
                f"the {self._api} upstream at {self._http.base} refused the start-up checks: {exc}"
            ) from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise UpstreamError(
                f"the {self._api} upstream at {self._http.base} is unreachable: {_describe_error(exc)}"
            ) from None
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
        if not self._protocol.probes_vocabulary:
            return
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
        params = _params(
            max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop_token_ids=[], ignore_eos=False
        )
        body = self._protocol.body([token_id], params, upstream.served_name, stream=False)
        try:
            await self._http.post_json(self._protocol.generate_path, body)
        except UpstreamRefused as exc:
            if 400 <= exc.status < 500:
                return False
            raise
        return True

    async def stop(self) -> None:
        if self._held is not None and self._upstream is not None:
            await self._held.close()
        await self._http.close()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        await self.start()
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
        prompt_ids = list(request.prompt_token_ids)
        lease = None
        try:
            if self._held is not None:
                lease = self._held.begin(request.adapter)  # its current version, held to the end
            else:
                self.adapter_version(request.adapter)  # a name, on a server that holds none
        except UnknownAdapter as exc:  # unloaded since the server checked the request
            yield self._end(FinishReason.ERROR, prompt, 0, 0.0, str(exc))
            return
        try:
            # Closed with this generation, so that its response closes (and the upstream aborts the
            # request) at once, before the adapter version is let go.
            async with contextlib.aclosing(self._forward(request, prompt_ids, params, lease)) as items:
                async for item in items:
                    yield item
        finally:
            if lease is not None:
                await self._held.end(lease)

    async def _forward(self, request: GenerationRequest, prompt_ids: list[int], params, lease):
        """The generation's items from the upstream; with an adapter (`lease`), from the version it
        holds, every token carrying that version's number."""
        submitted = time.monotonic()
        queue_seconds = 0.0
        completion = 0
        prompt = len(prompt_ids)
        s = request.sampling
        # vLLM's OpenAI API names a LoRA adapter as the request's model.
        model = lease.served.name if lease is not None else self._upstream.served_name
        version = lease.version if lease is not None else self._version

        def ended_by_unload() -> str:
            # An unload closes the response (lease.stop): the read fails or the stream stops short.
            return lease.ended if lease is not None else ""

        try:
            body = self._protocol.body(prompt_ids, params, model, stream=True)
        except PromptRefused as exc:
            yield self._end(FinishReason.ERROR, prompt, 0, 0.0, f"the upstream cannot be sent this prompt: {exc}")
            return
        reader = self._protocol.reader(prompt_ids)
        finish: str | None = None
        try:
            # Leaving this block (the caller closed the generation) closes the response: the
            # upstream sees its client go and aborts the request.
            async with self._http.post(self._protocol.generate_path, body) as response:
                if lease is not None:
                    lease.stop = response.close  # an unload ends the generation: the upstream aborts it
                if response.status >= 400:
                    raise UpstreamRefused(response.status, error_message(await response.text()))
                async for event in events(response) if self._protocol.streams else whole_body(response):
                    step = reader.read(event)
                    if step.token_ids:
                        if completion == 0:
                            queue_seconds = time.monotonic() - submitted
                        completion += len(step.token_ids)
                        yield TokenChunk(step.token_ids, step.logprobs, version)
                    if step.finish is not None:
                        finish = step.finish
                        break
        except UpstreamRefused as exc:
            yield self._end(
                FinishReason.ERROR, prompt, completion, queue_seconds, f"the upstream refused the generation: {exc}"
            )
            return
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            error = f"the upstream at {self._http.base} failed: {_describe_error(exc)}"
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, ended_by_unload() or error)
            return
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            error = f"the upstream's response is unreadable: {type(exc).__name__}: {exc}"
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, error)
            return
        if finish is None:
            error = "the upstream ended the stream without a finish reason"
            yield self._end(FinishReason.ERROR, prompt, completion, queue_seconds, ended_by_unload() or error)
            return
        yield self._end(_finish_reason(finish, completion, s.max_tokens), prompt, completion, queue_seconds)

    @staticmethod
    def _end(
        reason: FinishReason, prompt: int, completion: int, queue_seconds: float, error: str = ""
    ) -> GenerationEnd:
        return GenerationEnd(reason, prompt, completion, queue_seconds, error)

    def parameter_specs(self) -> Mapping[str, ParameterSpec]:
        # With an adapter, its matrices alone: the base weights are the upstream's.
        return self._held.specs("") if self._held is not None else {}

    async def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        if self._held is None:
            raise WeightsFixed(self.fixed_weights)
        await self.start()
        return await self._held.push("", tensors)


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
