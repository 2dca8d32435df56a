"""Constrained decoding: an output constraint as a grammar, and the token masks it allows.

One `OutputConstraint` (SamplingParams.constraint in common.proto) says what a reply must be: a
prefix, one JSON value valid against a JSON schema, written canonically (no whitespace but a space
after each "," and ":", as json.dumps writes it), a suffix, then a stop token. It becomes a Lark
grammar for llguidance, whose JSON compiler turns the schema into grammar rules:

    start: "<tool_call>\\n" value "\\n</tool_call>"
    value: %json {... the schema, with its separators ...}

The same grammar serves three places, so each masks exactly the same tokens:

- the inference engine samples only what the mask allows at each step (`TokenGrammar.bitmasks`),
  the mask applied to the logits before temperature, top-k and top-p;
- the trainer replays the grammar over the sampled ids (`TokenGrammar.replay`) and computes its
  logprobs under the same masks, so the importance ratio of an unchanged policy is 1;
- `polar verify` replays it too, and a sampled id the mask did not admit is a violation.

Grammars are compiled once per constraint (`grammar`, cached, refusals included); a matcher for a
new generation is a copy of the constraint's compiled one. A schema the compiler refuses raises
`ConstraintError` with the compiler's first line, which the gateway returns as a 400.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

if TYPE_CHECKING:  # torch only where masks meet logits: the gateway and the records import this module
    import torch

# Canonical JSON: what json.dumps writes, and what the chat formats render tool calls with.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
KINDS = ("tool_call", "json_schema")
# Compiled grammars and matchers kept per process (a harness sends the same tools every call).
CACHE_ENTRIES = 256


class ConstraintError(ValueError):
    """A constraint that cannot be applied: a schema the grammar compiler refuses, or a bad field."""


class ConstraintViolation(ValueError):
    """A token sequence the constraint's mask does not admit; `index` is the first refused token."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class OutputConstraint:
    """SamplingParams.constraint, without the generated classes (see common.proto)."""

    kind: str
    json_schema: str
    prefix: str = ""
    suffix: str = ""

    @classmethod
    def from_proto(cls, message: Any) -> OutputConstraint:
        """From a polar.v1.OutputConstraint; ConstraintError for an unknown kind or an empty schema."""
        constraint = cls(message.kind, message.json_schema, message.prefix, message.suffix)
        if constraint.kind not in KINDS:
            raise ConstraintError(f"constraint kind {constraint.kind!r} is not one of {', '.join(KINDS)}")
        if not constraint.json_schema:
            raise ConstraintError("constraint json_schema is empty")
        return constraint

    def to_proto(self, message_class: Any) -> Any:
        return message_class(kind=self.kind, json_schema=self.json_schema, prefix=self.prefix, suffix=self.suffix)


# Keywords that say nothing about which values are valid.
ANNOTATIONS = frozenset(
    {"description", "title", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly", "$schema"}
)
# Keywords whose value is one subschema, a list of them, or a mapping of names to them.
_SUBSCHEMA = frozenset(
    {
        "additionalProperties",
        "items",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
    }
)
_SUBSCHEMA_LISTS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def expressible_schema(schema: Any) -> Any:
    """`schema` with each `propertyNames` the grammar compiler lacks rewritten into keywords it has,
    where the rewrite admits exactly the same values; any other `propertyNames` is left for the
    compiler to refuse.

    Zod, which most JavaScript CLIs build their tool schemas with, writes every record as
    `propertyNames: {"type": "string"}` (Claude Code's TaskCreate and TaskUpdate): a name is always a
    string, so that says nothing and goes. A `pattern` becomes `patternProperties`, an `enum` or a
    `const` becomes `properties` with no other property allowed."""
    if isinstance(schema, list):
        return [expressible_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA or key in _SUBSCHEMA_LISTS:
            rewritten[key] = expressible_schema(value)
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            rewritten[key] = {name: expressible_schema(sub) for name, sub in value.items()}
        else:
            rewritten[key] = value
    names = rewritten.get("propertyNames")
    return rewritten if names is None else _without_property_names(rewritten, names)


def _without_property_names(schema: dict[str, Any], names: Any) -> dict[str, Any]:
    names = {} if names is True else names
    if not isinstance(names, dict):
        return schema
    rule = {key: value for key, value in names.items() if key not in ANNOTATIONS and (key, value) != ("type", "string")}
    rest = {key: value for key, value in schema.items() if key != "propertyNames"}
    if not rule:
        return rest
    properties = rest.get("properties", {})
    others = rest.get("additionalProperties", True)
    if "patternProperties" in rest:
        return schema
    if list(rule) == ["pattern"] and isinstance(rule["pattern"], str) and (not properties or others in (True, {})):
        # A named property matching the pattern is also checked against patternProperties: only a
        # schema that admits everything keeps its own unchanged.
        pattern = re.compile(rule["pattern"])
        if not all(pattern.search(name) for name in properties):
            return schema
        return {**rest, "patternProperties": {rule["pattern"]: others}, "additionalProperties": False}
    allowed = rule.get("enum") if list(rule) == ["enum"] else [rule["const"]] if list(rule) == ["const"] else None
    if not isinstance(allowed, list) or not all(isinstance(name, str) for name in allowed):
        return schema
    if not set(rest.get("required", ())) <= set(allowed):
        return schema
    return {
        **rest,
        "properties": {name: properties.get(name, others) for name in allowed},
        "additionalProperties": False,
    }


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


@lru_cache(maxsize=CACHE_ENTRIES)
def _compile(constraint: OutputConstraint) -> tuple[str, str]:
    """(llguidance grammar, "") or ("", the compiler's refusal): refusals are cached as well."""
    try:
        schema = json.loads(constraint.json_schema)
    except ValueError as exc:
        return "", f"the JSON schema is not JSON: {exc}"
    if not isinstance(schema, dict):
        return "", "the JSON schema must be a JSON object"
    schema = {**expressible_schema(schema), "x-guidance": JSON_OPTIONS}
    parts = [_lark_string(constraint.prefix)] if constraint.prefix else []
    parts.append("value")
    if constraint.suffix:
        parts.append(_lark_string(constraint.suffix))
    lark = f"start: {' '.join(parts)}\nvalue: %json {json.dumps(schema, ensure_ascii=False)}\n"
    grammar = LLMatcher.grammar_from_lark(lark)
    problem = LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        return "", _first_line(problem)
    return grammar, ""


def _first_line(problem: str) -> str:
    """The compiler's message without its position in our own Lark text, which the caller never saw."""
    return _POSITION.sub("", problem.splitlines()[0])


_POSITION = re.compile(r"^at \d+\(\d+\): ")


def grammar(constraint: OutputConstraint) -> str:
    """The constraint's llguidance grammar; ConstraintError naming the problem when it has none."""
    compiled, problem = _compile(constraint)
    if problem:
        raise ConstraintError(problem)
    return compiled


def bitmask_to_bool(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """int32 [B, W] bitmask (bit j of word w: token 32w + j) -> bool [B, vocab]; False past 32W.

    numpy's unpackbits, not torch bit shifts: a 32 x 49k mask takes a tenth of a millisecond."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little").view(np.bool_)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))


class TokenGrammar:
    """Constraints bound to one tokenizer: matchers for generations, their masks, replays.

    `vocab_size` is the model's output size (it may exceed the tokenizer's; the extra ids are never
    allowed); `eos_ids` are the ids that end a reply, allowed where the constraint is complete.
    """

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], vocab_size: int) -> None:
        # `tokenizer`: a Hugging Face fast tokenizer or a FileTokenizer; llguidance reads its backend's
        # JSON (added tokens included), as llguidance.hf.from_tokenizer does without importing transformers.
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer: LLTokenizer = LLTokenizer(backend.to_str(), eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.words = (self.tokenizer.vocab_size + 31) // 32  # int32 words of a bitmask row
        self._executor = LLExecutor()
        self._compiled: OrderedDict[OutputConstraint, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, spec: str, vocab_size: int | None = None) -> TokenGrammar:
        """The grammar of a model ("tiny", "smollm2-135m" or a folder), ending replies where its torch
        engine does (polar.inference.models.end_token_ids): what the trainer and `polar verify` replay."""
        from polar.inference import models
        from polar.inference.tokenizer_files import load_tokenizer

        folder = models.resolve_model(spec)
        tokenizer = load_tokenizer(str(folder))
        return cls(tokenizer, models.end_token_ids(folder, tokenizer), vocab_size or len(tokenizer))

    def matcher(self, constraint: OutputConstraint) -> LLMatcher:
        """A fresh matcher at the start of a reply; ConstraintError when the constraint cannot compile."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                compiled = LLMatcher(self.tokenizer, grammar(constraint), log_level=0)
                if compiled.is_error():
                    raise ConstraintError(_first_line(compiled.get_error()))
                self._compiled[constraint] = compiled
                if len(self._compiled) > CACHE_ENTRIES:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint)
        return compiled.deep_copy()

    def bitmasks(self, matchers: Sequence[LLMatcher]) -> np.ndarray:
        """int32 [len(matchers), words]: the tokens each matcher allows next, a bit each (bit j of word
        w: token 32w + j; computed in parallel). A 32nd of the bool masks' bytes, which is what a GPU
        engine sends to the device each step."""
        bitmask = np.zeros((len(matchers), self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(matcher, row) for row, matcher in enumerate(matchers)],
            bitmask.ctypes.data,
            self.words * 4,
            len(matchers),
        )
        return bitmask

    def masks(self, matchers: Sequence[LLMatcher]) -> np.ndarray:
        """bool [len(matchers), vocab_size]: the tokens each matcher allows next."""
        return bitmask_to_bool(self.bitmasks(matchers), self.vocab_size)

    def replay(self, constraint: OutputConstraint, token_ids: Sequence[int]) -> np.ndarray:
        """bool [len(token_ids), vocab_size]: the mask each token was sampled under.

        Raises ConstraintViolation at the first token its mask did not allow (or, for a generation cut
        short, never: a prefix of an admitted reply is admitted token by token)."""
        matcher = self.matcher(constraint)
        masks = np.zeros((len(token_ids), self.vocab_size), dtype=np.bool_)
        for index, token in enumerate(token_ids):
            masks[index] = self.masks([matcher])[0]
            if not masks[index, token] or not matcher.consume_token(token):
                raise ConstraintViolation(
                    index, f"sampled token {index} (id {token}) is not admitted by the {constraint.kind} constraint"
                )
        return masks


class BitmaskUpload:
    """A GPU engine's way for its steps' bitmasks to the device: one pinned host buffer, allocated
    once (pinning a new block every step cost the host more than the rest of the mask's work, on an
    H100), written again only once the previous copy out of it has run."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        import torch

        self._host = torch.empty((rows, words), dtype=torch.int32, pin_memory=True)
        self._device = device
        self._copied: torch.cuda.Event | None = None

    def __call__(self, bitmask: np.ndarray) -> torch.Tensor:
        """int32 [n, words] on the device, queued behind the work already there (n <= rows)."""
        import torch

        if self._copied is not None:
            self._copied.synchronize()
        staged = self._host[: len(bitmask)]
        staged.numpy()[...] = bitmask
        on_device = staged.to(self._device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device


def mask_logits_(
    logits: torch.Tensor, rows: Sequence[int], bitmask: np.ndarray, upload: BitmaskUpload | None = None
) -> None:
    """Set logits [N, V] to -inf in place where bitmask int32 [len(rows), words] (TokenGrammar.bitmasks)
    has no bit, for those rows: the constraint's mask, applied before temperature, top-k and top-p, so
    that the distribution sampled from is renormalised over it. On the CPU through numpy (torch's
    masked fill took ten times as long on two busy cores); on a GPU the bitmask goes over, pinned (a
    32nd of the bool mask's bytes, and a copy the host does not wait for; through the engine's
    `upload`, or a buffer of its own), and is unpacked there."""
    import torch

    from polar.inference.sampling import to_device

    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        allowed = bitmask_to_bool(bitmask, vocab)
        view = logits.numpy()
        if len(rows) == view.shape[0]:
            np.putmask(view, ~allowed, -np.inf)
        else:
            for row, mask in zip(rows, allowed):
                np.putmask(view[row], ~mask, -np.inf)
        return
    words = (upload or BitmaskUpload(len(bitmask), bitmask.shape[1], logits.device))(bitmask)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [rows, words * 32]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, -torch.inf)
        return
    index = to_device(torch.tensor(list(rows), dtype=torch.long), logits.device)
    logits[index] = logits[index].masked_fill(~allowed, -torch.inf)


def masked_logits(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with -inf where allowed [len(rows), V] (bool) is False on those rows; differentiable
    (the trainer's logits), the rows left out untouched."""
    import torch

    if not len(rows):
        return logits
    rows = rows.to(logits.device)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed.to(logits.device), -torch.inf))
