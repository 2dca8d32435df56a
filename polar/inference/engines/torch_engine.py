"""The built-in torch engine: a Hugging Face Llama-family model, continuously batched.

One worker thread owns the model and its KV cache and loops over steps (weight updates, admission,
chunked prefill, one decode forward, sampling), with a prefix cache (prefix_cache.py) and grammar
masks for constrained requests. The step, the cache and the settings (``EngineOptions.extra``):
docs/design/engines.md.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from polar import lora
from polar.inference import models
from polar.inference.constraints import BitmaskUpload, ConstraintError, TokenGrammar, mask_logits_
from polar.inference.engines.base import (
    AdapterExists,
    AdapterInfo,
    AdapterLoad,
    AdaptersFull,
    Engine,
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ModelDescription,
    ParameterSpec,
    SamplingConfig,
    TokenChunk,
    UnknownAdapter,
    check_weight_update,
    default_adapter,
)
from polar.inference.engines.decoder_model import load_decoder_model
from polar.inference.engines.forced import ForcedReplies
from polar.inference.engines.llama import DecoderRunner
from polar.inference.engines.lora_bank import AdapterBank, specs_of
from polar.inference.engines.prefix_cache import BLOCK_TOKENS, PrefixCache, PrefixLease, adapter_namespace
from polar.inference.sampling import new_generator, sample_next_tokens, to_device
from polar.inference.tokenizer_files import load_tokenizer

DEFAULT_PREFILL_CHUNK_TOKENS = 2048
# On CUDA, the KV cache positions every slot holds from the start, with the decode graphs reading up
# to them captured before the first request (EngineOptions.extra["graph_positions"]).
DEFAULT_GRAPH_POSITIONS = 1024


def resolve_device(spec: str) -> torch.device:
    """ "auto" -> the current CUDA device when there is one, else the CPU; a bare "cuda" gets its index."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """ "auto" -> bfloat16 on CUDA, float32 elsewhere; else a torch dtype name such as "float16"."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, spec, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {spec!r} is not a torch floating-point dtype")
    return dtype


@dataclass
class _Adapter:
    """A LoRA adapter in the bank: its row, shape and version, and its matrices as views of the bank."""

    row: int
    settings: lora.LoraSettings
    version: int
    views: dict[str, torch.Tensor]

    def info(self, name: str) -> AdapterInfo:
        s = self.settings
        return AdapterInfo(name, s.rank, s.alpha, s.targets, self.version)


def _default_cpu_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _stop_ids(sampling: SamplingConfig, eos_ids: Sequence[int]) -> frozenset[int]:
    return frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else frozenset(eos_ids))


def _finish_reason(token: int, completion: int, total: int, stop_ids, max_tokens: int, context: int):
    """Why a sequence ends after sampling `token` (its `completion`-th, `total` with the prompt)."""
    if token in stop_ids:
        return FinishReason.STOP
    if completion >= max_tokens:
        return FinishReason.LENGTH
    if total >= context:
        return FinishReason.CONTEXT_LENGTH
    return None


@dataclass(eq=False)
class _Sequence:
    """One generation, owned by the worker thread once admitted."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    generator: torch.Generator
    stop_ids: frozenset[int]
    submitted: float
    adapter: str = ""  # the LoRA adapter it samples with ("" = the default weights)
    prompt: torch.Tensor | None = None  # on the model's device, from admission on
    prefix: PrefixLease | None = None  # its part in the prefix cache, from admission on (None: no cache)
    slot: int = -1
    cached: int = 0  # positions of this slot holding keys and values
    last_token: int = -1  # sampled but not yet in the cache; -1 until the first token
    completion: int = 0
    queue_seconds: float = 0.0
    cancelled: bool = False  # the consumer went away; set from the event loop's thread
    forced: tuple[int, ...] = ()  # forced-replies mode: the tokens to emit instead of sampling
    matcher: object = None  # the constraint's grammar matcher (llguidance.LLMatcher); None: unconstrained

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_tokens


@dataclass
class _Outbox:
    """Items produced by one step, handed to each event loop in a single callback."""

    items: dict[asyncio.AbstractEventLoop, list[tuple[_Sequence, object]]] = field(default_factory=dict)

    def put(self, seq: _Sequence, item: TokenChunk | GenerationEnd) -> None:
        self.items.setdefault(seq.loop, []).append((seq, item))

    def deliver(self) -> None:
        for loop, items in self.items.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                # The consumer's event loop is closed: nobody will read these streams again.
                for seq, _ in items:
                    seq.cancelled = True
        self.items = {}


def _put_all(items: list[tuple[_Sequence, object]]) -> None:
    for seq, item in items:
        seq.queue.put_nowait(item)


def _resolve(future: asyncio.Future, result: int | None = None, error: BaseException | None = None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _padded_groups(chunks: list[tuple[_Sequence, int, int]], budget: int) -> list[list[tuple[_Sequence, int, int]]]:
    """Chunks grouped for padded forwards: longest first, each group padded to its first chunk's
    length and holding at most `budget` positions, padding included (a chunk alone always fits)."""
    groups: list[list[tuple[_Sequence, int, int]]] = []
    for chunk in sorted(chunks, key=lambda c: c[2] - c[1], reverse=True):
        if groups and (len(groups[-1]) + 1) * (groups[-1][0][2] - groups[-1][0][1]) <= budget:
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups


def _end(seq: _Sequence, reason: FinishReason, error: str = "") -> GenerationEnd:
    return GenerationEnd(
        finish_reason=reason,
        prompt_tokens=seq.prompt_tokens,
        completion_tokens=seq.completion,
        queue_seconds=seq.queue_seconds,
        error=error,
        cached_prompt_tokens=seq.prefix.reused_tokens if seq.prefix is not None else 0,
    )


@dataclass
class _Update:
    tensors: dict[str, torch.Tensor]
    future: asyncio.Future
    # Staged tensors whose memory becomes the parameters' (the replaced memory goes back into
    # `tensors`); else each is copied into its parameter.
    swap: bool = False
    adapter: str = ""  # the named LoRA adapter whose matrices these are; "" = the engine's parameters


def _transformers_model(folder: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A model decoder_model does not build, loaded through transformers, in inference mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    # A server's log is no terminal: the per-tensor loading bar would only clutter it.
    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model.requires_grad_(False)


class TorchEngine(Engine):
    """Continuous batching over a slot KV cache, for llama, qwen2 and qwen3 models."""

    def __init__(self, options: EngineOptions) -> None:
        folder = models.resolve_model(options.model)
        self.device = resolve_device(options.device)
        self.dtype = resolve_dtype(options.dtype, self.device)
        self.max_batch_size = options.max_batch_size
        # On a CPU there are no decode graphs to capture again: the cache is always dropped when idle.
        self._release_idle_memory = options.release_idle_memory or self.device.type != "cuda"
        self.prefill_chunk_tokens = int(options.extra.get("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK_TOKENS))
        if self.max_batch_size < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError("max_batch_size and prefill_chunk_tokens must be positive")
        if self.device.type == "cpu":
            torch.set_num_threads(int(options.extra.get("cpu_threads", _default_cpu_threads())))

        self.model = load_decoder_model(folder, self.dtype, self.device) or _transformers_model(
            folder, self.dtype, self.device
        )
        base_parameters = sum(p.numel() for p in self.model.parameters())
        # LoRA: the default adapter in row 0 of a bank, and max_adapters rows for named ones.
        self._bank: AdapterBank | None = None
        self._adapters: dict[str, _Adapter] = {}
        default = default_adapter(options)
        if default is not None:
            self._bank = AdapterBank(
                self.model,
                default.settings.rank,
                default.settings.targets,
                rows=1 + options.max_adapters,
                batch_rows=self.max_batch_size,
                dtype=self.dtype,
            )
            self._adapters[""] = self._fill_row(0, default.settings, default.tensors, options.policy_version)
        self.max_adapters = options.max_adapters
        self._runner = DecoderRunner(
            self.model, max_slots=self.max_batch_size, cuda_graphs=options.extra.get("cuda_graphs", "1") == "1"
        )
        if self._runner.cuda_graphs:
            with torch.inference_mode():
                self._runner.capture_graphs(int(options.extra.get("graph_positions", DEFAULT_GRAPH_POSITIONS)))
        tokenizer = load_tokenizer(str(folder))
        # What a weight update may replace: every parameter (tied weights appear once), or with an
        # adapter its matrices alone (the base is never sent again).
        self._parameters = self._adapters[""].views if self._bank else dict(self.model.named_parameters())
        self._prefix = None
        if options.prefix_cache_mib > 0:
            self._prefix = PrefixCache(
                self._runner.cache,
                layers=len(self._runner.decoder.layers),
                kv_heads=self._runner.kv_heads,
                head_dim=self._runner.head_dim,
                device=self.device,
                budget_bytes=options.prefix_cache_mib << 20,
            )
        self.description = self._describe(options.model, folder, tokenizer, base_parameters)
        script = options.extra.get("forced_replies", "")
        self._forced = ForcedReplies.load(script, tokenizer) if script else None
        self._tokenizer = tokenizer
        self._grammar: TokenGrammar | None = None  # made for the first constrained request
        self._mask_thread: ThreadPoolExecutor | None = None  # made with it
        self._mask_upload: BitmaskUpload | None = None  # made with it, on a GPU
        # The next step's masks, being computed: the sequences, and their masks [len, V] to come.
        self._masks_ahead: tuple[list[_Sequence], Future] | None = None

        self._version = options.policy_version
        self._wake = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._updates: list[_Update] = []
        self._adapter_jobs: list[tuple[Callable[[_Outbox], object], asyncio.Future]] = []
        self._slots: list[_Sequence | None] = [None] * self.max_batch_size
        self._admitted: list[_Sequence] = []  # running sequences, in admission order
        self._stopping = False
        self._worker: threading.Thread | None = None

    def _describe(self, spec: str, folder: Path, tokenizer, parameter_count: int) -> ModelDescription:
        end_of_turn = models.end_of_turn_id(tokenizer)
        eos = models.end_token_ids(folder, tokenizer)
        bos = tokenizer.bos_token_id
        return ModelDescription(
            name=models.model_name(spec),
            vocab_size=self.model.get_output_embeddings().weight.shape[0],
            eos_token_ids=eos,
            context_length=self.model.config.max_position_embeddings,
            engine="torch",
            end_of_turn_token_id=end_of_turn,
            bos_token_id=-1 if bos is None else bos,
            chat_template=tokenizer.chat_template or "",
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            parameter_count=parameter_count,
            tokenizer_path=str(folder),
            constrained_decoding=True,
        )

    # -- the Engine contract, called from event loops --------------------------------------------

    def _fill_row(self, row: int, settings: lora.LoraSettings, tensors, version: int) -> _Adapter:
        """Put an adapter of `settings` into bank row `row` (its `tensors`, or zero without); its record."""
        views = self._bank.views(row, settings)
        if tensors:
            known = specs_of(views)
            for name, tensor in tensors.items():
                if name not in known:
                    raise lora.LoraError(f"the adapter holds {name!r}, which its targets do not adapt on this model")
                if tuple(tensor.shape) != known[name].shape:
                    raise lora.LoraError(
                        f"adapter matrix {name} has shape {list(tensor.shape)}, this model's is {list(known[name].shape)}"
                    )
            missing = sorted(set(views) - set(tensors))
            if missing:
                raise lora.LoraError(
                    f"the adapter lacks {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")
                )
        with torch.no_grad():
            self._bank.clear(row)
            for name, tensor in (tensors or {}).items():
                views[name].copy_(tensor)
            self._bank.scales[row] = settings.scaling
        return _Adapter(row, settings, version, views)

    @property
    def policy_version(self) -> int:
        return self._adapters[""].version if self._bank else self._version

    def adapters(self) -> list[AdapterInfo]:
        return [adapter.info(name) for name, adapter in self._adapters.items()]

    def adapter_version(self, adapter: str) -> int:
        if not adapter:
            return self.policy_version
        held = self._adapters.get(adapter)
        if held is None:
            raise self._unknown(adapter)
        return held.version

    def _unknown(self, adapter: str) -> UnknownAdapter:
        names = ", ".join(repr(n) for n in self._adapters if n) or "none"
        return UnknownAdapter(f"this server holds no LoRA adapter {adapter!r} (it holds {names})")

    def adapter_specs(self, adapter: str) -> Mapping[str, ParameterSpec]:
        if not adapter:
            return self.parameter_specs()
        self.adapter_version(adapter)
        return specs_of(self._adapters[adapter].views)

    async def apply_adapter(self, adapter: str, tensors: dict[str, torch.Tensor]) -> int:
        check_weight_update(tensors, self.adapter_specs(adapter))
        update = _Update(tensors, asyncio.get_running_loop().create_future(), adapter=adapter)
        self._ensure_worker()
        with self._wake:
            self._updates.append(update)
            self._wake.notify()
        return await update.future

    async def load_adapter(self, load: AdapterLoad) -> AdapterInfo:
        if self._bank is None or not self.max_adapters:
            return await super().load_adapter(load)
        if load.path:
            saved = await asyncio.to_thread(lora.read_adapter, load.path)
        else:
            targets = load.targets or ",".join(self._bank.targets)
            saved = lora.AdapterFolder(lora.LoraSettings.parse(load.rank, load.alpha, targets), "", {})
        problem = self._bank.fits(saved.settings)
        if problem:
            raise lora.LoraError(f"adapter {load.name!r} does not fit this server: {problem}")
        tensors = {name: t.to(self.dtype) for name, t in saved.tensors.items()}

        def job(outbox: _Outbox) -> AdapterInfo:
            held = self._adapters.get(load.name)
            if held is not None and not load.replace:
                raise AdapterExists(
                    f"this server holds an adapter {load.name!r} already (another run of that name, or this one "
                    "not unloaded: give the run another name, or replace it)"
                )
            if held is not None:
                self._end_generations_of(load.name, outbox, "was replaced")
                row = held.row
            else:
                used = {a.row for a in self._adapters.values()}
                free = [row for row in range(1, self._bank.rows) if row not in used]
                if not free:
                    raise AdaptersFull(
                        f"this server holds {self.max_adapters} named adapters already (max_adapters): "
                        "unload one, or start it with a larger max_adapters"
                    )
                row = free[0]
            adapter = self._fill_row(row, saved.settings, tensors, load.policy_version)
            self._adapters[load.name] = adapter
            if self._prefix is not None:
                self._prefix.clear()  # blocks computed under this name came from other matrices
            return adapter.info(load.name)

        return await self._adapter_job(job)

    async def unload_adapter(self, name: str) -> int:
        def job(outbox: _Outbox) -> int:
            held = self._adapters.pop(name, None)
            if held is None:
                raise self._unknown(name)
            ended = self._end_generations_of(name, outbox, "was unloaded")
            self._bank.clear(held.row)
            return ended

        if not name:
            raise UnknownAdapter("the default adapter cannot be unloaded; name an adapter LoadAdapter loaded")
        return await self._adapter_job(job)

    async def _adapter_job(self, job: Callable[[_Outbox], object]):
        """Run `job` on the worker between two steps (it may raise); its result."""
        future = asyncio.get_running_loop().create_future()
        self._ensure_worker()
        with self._wake:
            self._adapter_jobs.append((job, future))
            self._wake.notify()
        return await future

    @property
    def active_requests(self) -> int:
        """Requests admitted or waiting for a slot."""
        with self._wake:
            return len(self._admitted) + len(self._waiting)

    async def start(self) -> None:
        self._ensure_worker()

    async def stop(self) -> None:
        worker = self._worker
        if worker is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(worker.join)
        self._worker = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        self._ensure_worker()
        seq = _Sequence(
            request=request,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            generator=new_generator(request.sampling.seed),
            adapter=request.adapter,
            stop_ids=_stop_ids(request.sampling, self.description.eos_token_ids),
            submitted=time.monotonic(),
            forced=self._forced.reply(request.prompt_token_ids) if self._forced is not None else (),
        )
        with self._wake:
            self._waiting.append(seq)
            self._wake.notify()
        ended = False
        try:
            while not ended:
                item = await seq.queue.get()
                ended = isinstance(item, GenerationEnd)
                yield item
        finally:
            if not ended:
                with self._wake:
                    seq.cancelled = True
                    if seq in self._waiting:
                        self._waiting.remove(seq)
                    self._wake.notify()

    def parameter_specs(self) -> Mapping[str, ParameterSpec]:
        return {name: ParameterSpec(tuple(p.shape), p.dtype) for name, p in self._parameters.items()}

    async def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        check_weight_update(tensors, self.parameter_specs())
        prepared = await asyncio.to_thread(self._prepare_update, tensors)
        update = _Update(prepared, asyncio.get_running_loop().create_future())
        self._ensure_worker()
        with self._wake:
            self._updates.append(update)
            self._wake.notify()
        return await update.future

    async def apply_staged(self, tensors: dict[str, torch.Tensor]) -> int:
        """Staged tensors on the model's device become the parameters (no copy), unless CUDA graphs
        captured the parameters' addresses; any others are copied in, between two steps."""
        check_weight_update(tensors, self.parameter_specs())
        # An adapter's matrices are views into its bank, which only a copy writes.
        swap = all(t.device == self.device for t in tensors.values()) and not (self._runner.cuda_graphs or self._bank)
        update = _Update(tensors, asyncio.get_running_loop().create_future(), swap=swap)
        self._ensure_worker()
        with self._wake:
            self._updates.append(update)
            self._wake.notify()
        return await update.future

    def _prepare_update(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cast and move off the worker, so the worker only copies between two steps."""
        return {name: t.detach().to(self.device, self.dtype) for name, t in tensors.items()}

    def _ensure_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="polar-torch-engine", daemon=True)
        self._worker.start()

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (
                        self._stopping or self._updates or self._adapter_jobs or self._waiting or self._admitted
                    ):
                        self._wake.wait()
                    if self._stopping:
                        break
                    updates, self._updates = self._updates, []
                    jobs, self._adapter_jobs = self._adapter_jobs, []
                outbox = _Outbox()
                self._apply_updates(updates)
                self._run_adapter_jobs(jobs, outbox)
                with self._wake:
                    admitted = self._admit()
                try:
                    for seq in admitted:
                        self._start_sequence(seq, outbox)
                    self._drop_cancelled()
                    self._step(outbox)
                except Exception as error:
                    for seq in list(self._admitted):
                        self._finish(seq, FinishReason.ERROR, outbox, f"engine step failed: {error!r}")
                outbox.deliver()
                with self._wake:
                    if self._release_idle_memory and not self._admitted and not self._waiting:
                        self._runner.release()
            self._shut_down()

    def _run_adapter_jobs(self, jobs, outbox: _Outbox) -> None:
        for job, future in jobs:
            try:
                with torch.no_grad():
                    result = job(outbox)
            except Exception as error:
                future.get_loop().call_soon_threadsafe(_resolve, future, None, error)
            else:
                future.get_loop().call_soon_threadsafe(_resolve, future, result)

    def _end_generations_of(self, adapter: str, outbox: _Outbox, why: str) -> int:
        """End the running and waiting generations of `adapter` with an error saying it `why`."""
        error = f"LoRA adapter {adapter!r} {why} while this generation ran"
        running = [seq for seq in self._admitted if seq.adapter == adapter]
        for seq in running:
            self._finish(seq, FinishReason.ERROR, outbox, error)
        with self._wake:
            waiting = [seq for seq in self._waiting if seq.adapter == adapter]
            for seq in waiting:
                self._waiting.remove(seq)
        for seq in waiting:
            seq.queue_seconds = time.monotonic() - seq.submitted
            outbox.put(seq, _end(seq, FinishReason.ERROR, error))
        return len(running) + len(waiting)

    def _admit(self) -> list[_Sequence]:
        """Move waiting requests into free slots (caller holds the lock)."""
        admitted = []
        while self._waiting and len(self._admitted) < self.max_batch_size:
            seq = self._waiting.popleft()
            seq.slot = self._slots.index(None)
            self._slots[seq.slot] = seq
            self._admitted.append(seq)
            admitted.append(seq)
        return admitted

    def _start_sequence(self, seq: _Sequence, outbox: _Outbox) -> None:
        seq.queue_seconds = time.monotonic() - seq.submitted
        problem = self._admission_problem(seq.request)
        if problem is not None:
            reason, error = problem
            self._finish(seq, reason, outbox, error)
            return
        seq.prompt = torch.tensor(seq.request.prompt_token_ids, dtype=torch.long, device=self.device)
        if self._prefix is not None:
            seq.prefix = self._prefix.begin(seq.request.prompt_token_ids, adapter_namespace(seq.adapter))
        constraint = seq.request.sampling.constraint
        if constraint is not None and not seq.forced:  # a forced reply (a test fixture) is emitted as written
            try:
                seq.matcher = self._token_grammar().matcher(constraint)
            except ConstraintError as error:
                self._finish(seq, FinishReason.ERROR, outbox, f"constraint: {error}")

    def _token_grammar(self) -> TokenGrammar:
        if self._grammar is None:
            self._grammar = TokenGrammar(self._tokenizer, self.description.eos_token_ids, self.description.vocab_size)
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="polar-grammar-masks")
            if self.device.type == "cuda":
                self._mask_upload = BitmaskUpload(self.max_batch_size, self._grammar.words, self.device)
        return self._grammar

    def _compute_masks_ahead(self) -> None:
        """Start computing the masks of the constrained sequences' next tokens (their matchers change
        only when the next step feeds them, after it has taken these masks)."""
        ahead = [s for s in self._admitted if s.matcher is not None and s.last_token >= 0]
        if ahead:
            self._masks_ahead = (ahead, self._mask_thread.submit(self._grammar.bitmasks, [s.matcher for s in ahead]))

    def _constraint_masks(self, seqs: list[_Sequence]) -> np.ndarray:
        """int32 [len(seqs), words]: the tokens each sequence's constraint allows next, a bit each
        (TokenGrammar.bitmasks); computed ahead where it was."""
        known: dict[int, np.ndarray] = {}
        if self._masks_ahead is not None:
            ahead, future = self._masks_ahead
            self._masks_ahead = None
            masks = future.result()
            if ahead == seqs:
                return masks
            known = {id(s): row for s, row in zip(ahead, masks)}
        missing = [s for s in seqs if id(s) not in known]
        if missing:
            known.update(zip(map(id, missing), self._grammar.bitmasks([s.matcher for s in missing])))
        return np.stack([known[id(s)] for s in seqs])

    def _admission_problem(self, request: GenerationRequest) -> tuple[FinishReason, str] | None:
        """What prevents sampling at all; the servicer validates requests, the engine stays safe."""
        prompt = request.prompt_token_ids
        vocab = self.description.vocab_size
        if not prompt:
            return FinishReason.ERROR, "empty prompt"
        if request.sampling.max_tokens < 1:
            return FinishReason.ERROR, f"max_tokens must be positive, got {request.sampling.max_tokens}"
        if min(prompt) < 0 or max(prompt) >= vocab:
            return FinishReason.ERROR, f"prompt token ids must be in [0, {vocab})"
        if len(prompt) >= self.description.context_length:
            return FinishReason.CONTEXT_LENGTH, ""
        if request.adapter and request.adapter not in self._adapters:
            return FinishReason.ERROR, f"LoRA adapter {request.adapter!r} is not held here (it was unloaded)"
        return None

    def _apply_updates(self, updates: list[_Update]) -> None:
        for update in updates:
            loop = update.future.get_loop()
            try:
                with torch.no_grad():
                    parameters = self._adapters[update.adapter].views if update.adapter else self._parameters
                    for name, tensor in update.tensors.items():
                        parameter = parameters[name]
                        if update.swap:
                            update.tensors[name], parameter.data = parameter.data, tensor
                        else:
                            parameter.copy_(tensor)
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
            except Exception as error:
                loop.call_soon_threadsafe(_resolve, update.future, None, error)
                continue
            finally:
                # Keys and values computed with other weights would give other logprobs.
                if self._prefix is not None:
                    self._prefix.clear()
            held = self._adapters.get(update.adapter) if self._bank else None
            if held is None:
                self._version += 1
                version = self._version
            else:
                held.version += 1
                version = held.version
            loop.call_soon_threadsafe(_resolve, update.future, version)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._admitted if s.cancelled]:
            self._release(seq)

    def _step(self, outbox: _Outbox) -> None:
        versions = {name: adapter.version for name, adapter in self._adapters.items()} or {"": self._version}
        decoding = sorted((s for s in self._admitted if s.last_token >= 0), key=lambda s: s.slot)
        prefilled, prefill_logits = self._prefill(outbox)
        decode_logits = self._decode(decoding, outbox)
        if decode_logits is None:
            decoding = []
        batch = decoding + prefilled
        if not batch:
            return
        parts = ([decode_logits] if decoding else []) + prefill_logits
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # [len(batch), V]
        batch, logits = self._constrain(batch, logits, outbox)
        if not batch:
            return
        try:
            tokens, logprobs = self._sample(batch, logits)
        except Exception as error:
            for seq in batch:
                self._finish(seq, FinishReason.ERROR, outbox, f"sampling failed: {error!r}")
            return
        for seq, token, logprob in zip(batch, tokens, logprobs, strict=True):
            self._emit(seq, token, logprob, versions[seq.adapter], outbox)
        if self._grammar is not None:
            self._compute_masks_ahead()

    def _prefill(self, outbox: _Outbox) -> tuple[list[_Sequence], list[torch.Tensor]]:
        """Advance prompts by up to prefill_chunk_tokens; return those completed, with the logits
        [len(completed), V] of their last prompt positions (one tensor per forward, in order)."""
        prefilled, logits = [], []
        for group in _padded_groups(self._prefill_chunks(), self.prefill_chunk_tokens):
            try:
                if self._bank is not None:
                    self._bank.select([self._adapters[seq.adapter].row for seq, _, _ in group])
                last = self._runner.prefill(
                    [seq.slot for seq, _, _ in group],
                    [seq.prompt[start:end] for seq, start, end in group],
                    [start for _, start, _ in group],
                )  # [len(group), V]
            except Exception as error:
                for seq, _, _ in group:
                    self._finish(seq, FinishReason.ERROR, outbox, f"prefill failed: {error!r}")
                continue
            for seq, _, end in group:
                seq.cached = end
                if seq.prefix is not None:
                    self._prefix.store(seq.prefix, seq.slot, end)
            done = [row for row, (seq, _, _) in enumerate(group) if not seq.prefilling]
            prefilled += [group[row][0] for row in done]
            if done:
                logits.append(last if len(done) == len(group) else last[to_device(torch.tensor(done), last.device)])
        return prefilled, logits

    def _prefill_chunks(self) -> list[tuple[_Sequence, int, int]]:
        """The prompt positions [start, end) each prefilling sequence advances by this step: in
        admission order, until prefill_chunk_tokens are spent (the last one may stop mid-prompt).

        With the prefix cache, a sequence first takes the cached blocks that continue its prompt,
        and one whose next block an earlier sequence is computing waits for it to be cached."""
        budget = self.prefill_chunk_tokens
        chunks = []
        computing: set[bytes] = set()  # keys of the blocks this step's earlier chunks work towards
        for seq in self._admitted:
            if budget <= 0:
                break
            if seq.prefilling and seq.prefix is not None:
                seq.cached = self._prefix.take(seq.prefix, seq.slot, seq.cached)
                ahead = seq.prefix.keys[seq.cached // BLOCK_TOKENS :]
                if ahead and ahead[0] in computing:
                    continue
                computing.update(ahead)
            if seq.prefilling:
                end = min(seq.prompt_tokens, seq.cached + budget)
                chunks.append((seq, seq.cached, end))
                budget -= end - seq.cached
        return chunks

    def _decode(self, decoding: list[_Sequence], outbox: _Outbox) -> torch.Tensor | None:
        """One forward for the decoding sequences -> their logits [len(decoding), V], in order.

        Every slot [0, n) takes part; slots without a token to decode get a placeholder written at
        their next free position, which their own prefill or decode overwrites before it is read.
        """
        if not decoding:
            return None
        n = max(s.slot for s in self._admitted) + 1
        tokens, positions = [0] * n, [0] * n
        for seq in self._admitted:
            positions[seq.slot] = seq.cached
        for seq in decoding:
            tokens[seq.slot] = seq.last_token
        try:
            if self._bank is not None:
                rows = [self._adapters[s.adapter].row if s is not None else 0 for s in self._slots[:n]]
                self._bank.select(rows)
            logits = self._runner.decode(tokens, positions, [s.slot for s in decoding])
        except Exception as error:
            for seq in decoding:
                self._finish(seq, FinishReason.ERROR, outbox, f"decode failed: {error!r}")
            return None
        for seq in decoding:
            seq.cached += 1
            if seq.prefix is not None:
                seq.prefix.tokens.append(seq.last_token)
        return logits

    def _constrain(
        self, batch: list[_Sequence], logits: torch.Tensor, outbox: _Outbox
    ) -> tuple[list[_Sequence], torch.Tensor]:
        """Mask the constrained sequences' logits [len(batch), V] in place to what their grammars allow
        next; the batch and logits left to sample from. A sequence whose grammar allows no token (a
        dead end) or whose mask could not be computed ends here with an error and leaves the step:
        sampling from nothing would fail the whole batch, or, greedy, emit a token its grammar refuses."""
        constrained = [row for row, s in enumerate(batch) if s.matcher is not None]
        if not constrained:
            return batch, logits
        seqs = [batch[row] for row in constrained]
        try:
            masks = self._constraint_masks(seqs)
            dead = {id(s): "its grammar allows no next token" for s, mask in zip(seqs, masks) if not mask.any()}
        except Exception as error:
            masks, dead = None, {id(s): f"computing its grammar's mask failed: {error!r}" for s in seqs}
        if dead:
            for seq in seqs:
                if id(seq) in dead:
                    self._finish(seq, FinishReason.ERROR, outbox, f"constraint: {dead[id(seq)]}")
            keep = [row for row, s in enumerate(batch) if id(s) not in dead]
            if masks is not None:
                masks = masks[[i for i, s in enumerate(seqs) if id(s) not in dead]]
            batch = [batch[row] for row in keep]
            logits = logits[to_device(torch.tensor(keep, dtype=torch.long), logits.device)]
            constrained = [row for row, s in enumerate(batch) if s.matcher is not None]
        if constrained:
            mask_logits_(logits, constrained, masks, self._mask_upload)
        return batch, logits

    def _sample(self, batch: list[_Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        configs = [s.request.sampling for s in batch]
        tokens, logprobs = sample_next_tokens(
            logits,
            torch.tensor([c.temperature for c in configs], dtype=torch.float32),
            torch.tensor([c.top_k for c in configs], dtype=torch.long),
            torch.tensor([c.top_p for c in configs], dtype=torch.float32),
            [s.generator for s in batch],
            # Past its reply (only under ignore_eos) a sequence samples again.
            forced=torch.tensor([s.forced[s.completion] if s.completion < len(s.forced) else -1 for s in batch])
            if self._forced is not None
            else None,
        )
        # One transfer, the step's only wait for the device: fp64 holds token ids and fp32 logprobs exactly.
        host = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))).cpu()  # [2, len(batch)]
        return host[0].long().tolist(), host[1].tolist()

    def _emit(self, seq: _Sequence, token: int, logprob: float, version: int, outbox: _Outbox) -> None:
        seq.completion += 1
        seq.last_token = token
        outbox.put(seq, TokenChunk((token,), (logprob,), version))
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            self._finish(seq, FinishReason.ERROR, outbox, f"constraint: {seq.matcher.get_error()}")
            return
        reason = _finish_reason(
            token,
            seq.completion,
            seq.prompt_tokens + seq.completion,
            seq.stop_ids,
            seq.request.sampling.max_tokens,
            self.description.context_length,
        )
        if reason is not None:
            self._finish(seq, reason, outbox)

    def _finish(self, seq: _Sequence, reason: FinishReason, outbox: _Outbox, error: str = "") -> None:
        self._release(seq, keep=reason is not FinishReason.ERROR)
        outbox.put(seq, _end(seq, reason, error))

    def _release(self, seq: _Sequence, keep: bool = True) -> None:
        """Free the sequence's slot; `keep`: offer what it computed to the prefix cache first (a
        failed step may have left its slot half-written)."""
        if seq.prefix is not None:
            if keep:
                self._prefix.store(seq.prefix, seq.slot, seq.cached)
            self._prefix.release(seq.prefix)
        with self._wake:
            self._slots[seq.slot] = None
            self._admitted.remove(seq)

    def _shut_down(self) -> None:
        """End every stream with ABORTED and fail pending updates (the worker is leaving)."""
        outbox = _Outbox()
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
            updates, self._updates = self._updates, []
        for seq in list(self._admitted):
            self._finish(seq, FinishReason.ABORTED, outbox)
        for seq in waiting:
            seq.queue_seconds = time.monotonic() - seq.submitted
            outbox.put(seq, _end(seq, FinishReason.ABORTED))
        for update in updates:
            update.future.get_loop().call_soon_threadsafe(
                _resolve, update.future, None, RuntimeError("the engine stopped before applying the update")
            )
        outbox.deliver()
        self._runner.release()
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=True)
            self._grammar, self._mask_thread, self._masks_ahead, self._mask_upload = None, None, None, None
