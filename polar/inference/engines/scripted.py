"""The scripted engine: replays configured outputs without any model, for tests and benchmarks.

Outputs come from a JSON script (``EngineOptions.script``, or a dict for
``ScriptedEngine.from_script``): rules matched against the prompt, else the next output in order.
The script format and the stopping rules: docs/design/engines.md (the scripted engine).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polar.inference.engines.base import (
    Engine,
    EngineOptions,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    ModelDescription,
    ParameterSpec,
    TokenChunk,
    WeightUpdateError,
)

END_OF_TURN = "<|im_end|>"
DEFAULT_CONTEXT_LENGTH = 32768
DEFAULT_LOGPROB = -0.1
DEFAULT_TOKENS_PER_CHUNK = 32


@dataclass(frozen=True)
class ScriptedOutput:
    """One reply, as token ids with their logprobs."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    delay_seconds: float = 0.0  # pause before each token; 0 streams tokens_per_chunk at once


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str] | None  # None: the rule matches by `ends_with`
    output: ScriptedOutput
    ends_with: tuple[int, ...] = ()


class ScriptError(ValueError):
    """The script is malformed; the message names the entry and field."""


class ScriptedEngine(Engine):
    """Replays a script's outputs; see the module docstring for the format."""

    def __init__(self, options: EngineOptions) -> None:
        if not options.script:
            raise ScriptError("the scripted engine needs a script: set EngineOptions.script to a JSON file")
        path = Path(options.script)
        try:
            script = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ScriptError(f"cannot read the script {str(path)!r}: {exc}") from exc
        self._configure(script, options.max_batch_size)
        self._policy_version = options.policy_version

    @classmethod
    def from_script(cls, script: Mapping[str, Any], max_batch_size: int = 64) -> ScriptedEngine:
        """Build from an in-memory script (the JSON file's content)."""
        engine = cls.__new__(cls)
        engine._configure(script, max_batch_size)
        engine._policy_version = 0
        return engine

    def _configure(self, script: Mapping[str, Any], max_batch_size: int) -> None:
        tokenizer_spec = script.get("tokenizer", "tiny")
        tokenizer_path = _resolve(tokenizer_spec) if tokenizer_spec is not None else None
        self._tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
        vocab_size = script.get("vocab_size", len(self._tokenizer) if self._tokenizer is not None else None)
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ScriptError(f"vocab_size = {vocab_size!r}: a script without a tokenizer must give one > 0")
        self._logprob = float(script.get("logprob", DEFAULT_LOGPROB))
        self._delay = float(script.get("delay_seconds", 0.0))
        self._tokens_per_chunk = int(script.get("tokens_per_chunk", DEFAULT_TOKENS_PER_CHUNK))
        if self._tokens_per_chunk <= 0:
            raise ScriptError(f"tokens_per_chunk = {self._tokens_per_chunk} must be > 0")
        self._end_of_turn = -1
        eos: tuple[int, ...] = ()
        bos = -1
        if self._tokenizer is not None:
            self._end_of_turn = self._tokenizer.convert_tokens_to_ids(END_OF_TURN)
            eos = tuple(sorted({self._tokenizer.eos_token_id, self._end_of_turn} - {None}))
            bos = -1 if self._tokenizer.bos_token_id is None else self._tokenizer.bos_token_id
        self.description = ModelDescription(
            name=str(script.get("name", "scripted")),
            vocab_size=vocab_size,
            eos_token_ids=eos,
            context_length=int(script.get("context_length", DEFAULT_CONTEXT_LENGTH)),
            engine="scripted",
            end_of_turn_token_id=self._end_of_turn,
            bos_token_id=bos,
            chat_template=(self._tokenizer.chat_template or "") if self._tokenizer is not None else "",
            tokenizer_path=str(tokenizer_path or ""),
        )
        self._rules = tuple(self._rule(entry, f"rules[{i}]") for i, entry in enumerate(script.get("rules", ())))
        self._outputs = tuple(self._output(entry, f"outputs[{i}]") for i, entry in enumerate(script.get("outputs", ())))
        indices = range(len(self._outputs))
        self._next_output: Iterator[int] = itertools.cycle(indices) if script.get("cycle", False) else iter(indices)
        self._slots = asyncio.Semaphore(max_batch_size)
        self._stopped = False
        self.running = 0  # generations holding a slot now

    def _rule(self, entry: Mapping[str, Any], where: str) -> _Rule:
        if ("prompt_regex" in entry) == ("prompt_ends_with" in entry):
            raise ScriptError(f"{where}: a rule needs one of 'prompt_regex' or 'prompt_ends_with'")
        if "prompt_ends_with" in entry:
            return _Rule(None, self._output(entry, where), tuple(int(t) for t in entry["prompt_ends_with"]))
        try:
            pattern = re.compile(str(entry["prompt_regex"]))
        except re.error as exc:
            raise ScriptError(f"{where}: prompt_regex {entry['prompt_regex']!r} is not a regex: {exc}") from exc
        return _Rule(pattern, self._output(entry, where))

    def _output(self, entry: Mapping[str, Any], where: str) -> ScriptedOutput:
        if ("text" in entry) == ("token_ids" in entry):
            raise ScriptError(f"{where}: give exactly one of 'text' or 'token_ids'")
        if "text" in entry:
            if self._tokenizer is None:
                raise ScriptError(f"{where}: a 'text' output needs a tokenizer (the script sets none)")
            ids = list(self._tokenizer.encode(str(entry["text"]), add_special_tokens=False))
        else:
            ids = [int(t) for t in entry["token_ids"]]
        logprob = float(entry.get("logprob", self._logprob))
        logprobs = [float(x) for x in entry["logprobs"]] if "logprobs" in entry else [logprob] * len(ids)
        if len(logprobs) != len(ids):
            raise ScriptError(f"{where}: {len(logprobs)} logprobs for {len(ids)} tokens")
        if entry.get("end_of_turn", "text" in entry):
            if self._end_of_turn < 0:
                raise ScriptError(f"{where}: end_of_turn needs a tokenizer with {END_OF_TURN}")
            ids.append(self._end_of_turn)
            logprobs.append(logprob)
        bad = [t for t in ids if not 0 <= t < self.description.vocab_size]
        if bad:
            raise ScriptError(f"{where}: token id {bad[0]} is outside [0, {self.description.vocab_size})")
        return ScriptedOutput(tuple(ids), tuple(logprobs), float(entry.get("delay_seconds", self._delay)))

    @property
    def policy_version(self) -> int:
        return self._policy_version

    async def start(self) -> None:
        self._stopped = False

    async def stop(self) -> None:
        self._stopped = True

    def parameter_specs(self) -> Mapping[str, ParameterSpec]:
        return {}

    async def update_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        if tensors:
            raise WeightUpdateError(
                f"unknown parameter name {next(iter(tensors))!r}: the scripted engine has no parameters"
            )
        return self.policy_version

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk | GenerationEnd]:
        submitted = time.perf_counter()
        prompt_tokens = len(request.prompt_token_ids)
        output = self._pick(request.prompt_token_ids)
        if isinstance(output, str):
            yield GenerationEnd(FinishReason.ERROR, prompt_tokens, 0, 0.0, error=output)
            return
        async with self._slots:
            self.running += 1
            try:
                queue_seconds = time.perf_counter() - submitted
                stops = set(request.sampling.stop_token_ids)
                if not request.sampling.ignore_eos:
                    stops.update(self.description.eos_token_ids)
                count, reason = _replay_length(output.token_ids, request.sampling.max_tokens, stops)
                step = 1 if output.delay_seconds > 0 else self._tokens_per_chunk
                for start in range(0, count, step):
                    if output.delay_seconds > 0:
                        await asyncio.sleep(output.delay_seconds)
                    if self._stopped:
                        yield GenerationEnd(FinishReason.ABORTED, prompt_tokens, start, queue_seconds)
                        return
                    end = min(start + step, count)
                    yield TokenChunk(output.token_ids[start:end], output.logprobs[start:end], self.policy_version)
                yield GenerationEnd(reason, prompt_tokens, count, queue_seconds)
            finally:
                self.running -= 1

    def _pick(self, prompt: tuple[int, ...]) -> ScriptedOutput | str:
        """The output for this prompt, or why there is none."""
        text = None  # decoded once, when a regex rule is reached
        for rule in self._rules:
            if rule.pattern is None:
                if prompt[len(prompt) - len(rule.ends_with) :] == rule.ends_with:
                    return rule.output
                continue
            if text is None:
                text = self._tokenizer.decode(prompt) if self._tokenizer is not None else " ".join(map(str, prompt))
            if rule.pattern.search(text):
                return rule.output
        index = next(self._next_output, None)
        if index is None:
            return f"the script has no output left: all {len(self._outputs)} outputs were used and cycle is off"
        return self._outputs[index]


def _replay_length(token_ids: tuple[int, ...], max_tokens: int, stops: set[int]) -> tuple[int, FinishReason]:
    """How many of the output's tokens a generation emits, and why it ends there."""
    for i, token in enumerate(token_ids[:max_tokens]):
        if token in stops:
            return i + 1, FinishReason.STOP
    if len(token_ids) >= max_tokens:
        return max_tokens, FinishReason.LENGTH
    return len(token_ids), FinishReason.STOP


def _resolve(spec: str) -> Path:
    from polar.inference.models import resolve_model

    return resolve_model(spec)


def _load_tokenizer(folder: Path):
    from polar.inference.tokenizer_files import load_tokenizer

    return load_tokenizer(str(folder))
