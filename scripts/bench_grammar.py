"""Grammar libraries for constrained decoding, side by side: llguidance (what Polar decodes with)
against xgrammar, on the constraints Polar's gateway makes from real harness requests.

The constraints:
- a forced tool call for each recorded CLI session's first request (tests/fixtures/sessions: its whole
  tool list, tool_choice required): the Hermes tool-call grammar `<tool_call>\\n{"name": N,
  "arguments": A}\\n</tool_call>`, N any of the session's tools and A valid against its parameters,
  exactly as gateway/request_constraint.py builds it;
- JSON-schema output: a small bounded answer (enums, an integer range) and an object with a free string.

Measured per constraint and library, over the tiny model's tokenizer (SmolLM2's, 49,152 tokens), in
alternating rounds (--rounds, default 5, --quick 2; medians over rounds):
- compile: from the constraint to a matcher ready for a first generation, with no cache (llguidance:
  Polar's own Lark grammar, its validation and an LLMatcher; xgrammar: the same JSON schema with the same
  separators, between the same prefix and suffix, compiled by a GrammarCompiler without its cache, and a
  GrammarMatcher);
- the first mask (llguidance computes its token tables lazily, xgrammar while compiling), then the time
  to fill the next-token bitmask per token (median and 99th percentile) over one reply walked token by
  token: a seeded random walk over the tokens both libraries allow (--tokens long, default 256, --quick
  64, ending early where the reply is complete), each step masked by each library into the same int32
  bitmask layout, the token then consumed. `agree` is the share of steps at which the two allowed the
  same tokens: they differ by design where text is forced (llguidance admits only the canonical
  tokenization of forced text, e.g. `{"` but not `{`; xgrammar admits both) and inside JSON strings
  (xgrammar admits the tokenizer's special tokens, `<|im_start|>` among them, as string text).
A constraint a library refuses is reported with its reason instead of figures.

xgrammar is not one of Polar's dependencies: install it beside Polar to compare (`pip install xgrammar`
in a scratch environment that also sees Polar's packages, e.g. `pip install --target DIR --no-deps
xgrammar apache-tvm-ffi` and PYTHONPATH=DIR). Without it, llguidance alone is measured, and the report
says so.

    python scripts/bench_grammar.py [--quick] [--rounds N] [--tokens N] [--out FILE]

Prints a table and writes JSON (default bench-results/grammar.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

import benchmark_common

MODEL = "tiny"  # SmolLM2's tokenizer
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
FREE_STRING = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


@dataclass(frozen=True)
class Point:
    """One constraint under one library (medians over rounds)."""

    constraint: str  # "tool_call <harness> (<tools> tools)" or "json_schema <name>"
    schema_bytes: int  # the constraint's JSON schema, serialized
    library: str  # "llguidance <version>" or "xgrammar <version>"
    refused: str  # the library's reason for refusing the constraint; "" when it compiled (then the rest)
    compile_ms: float = 0.0  # constraint -> a matcher ready for a first generation, uncached
    first_mask_ms: float = 0.0  # the first bitmask of a generation
    mask_us_p50: float = 0.0  # filling the next-token bitmask, per token after the first
    mask_us_p99: float = 0.0
    tokens: int = 0  # tokens of the walked reply
    agree: float = 1.0  # share of steps at which the libraries that compiled allowed the same tokens
    compile_rounds_ms: tuple[float, ...] = ()


class Library:
    """One grammar library behind the three things the bench does with it."""

    name: str

    def compile(self, constraint) -> object:
        """A fresh matcher for `constraint` (a polar OutputConstraint), nothing cached."""
        raise NotImplementedError

    def fill(self, matcher: object, bitmask: np.ndarray) -> None:
        """Write the tokens `matcher` allows next into bitmask int32 [words] (bit j of word w: 32w + j)."""
        raise NotImplementedError

    def consume(self, matcher: object, token: int) -> None:
        raise NotImplementedError


class Llguidance(Library):
    def __init__(self, grammar) -> None:  # grammar: polar.inference.constraints.TokenGrammar
        import llguidance

        from polar.inference import constraints

        self.name = f"llguidance {_version('llguidance')}"
        self._grammar = grammar
        self._compile_uncached = constraints._compile.__wrapped__  # Polar's Lark grammar, without the cache
        self._matcher_class = llguidance.LLMatcher
        self._executor = llguidance.LLExecutor()

    def compile(self, constraint) -> object:
        lark, problem = self._compile_uncached(constraint)
        if problem:
            raise ValueError(problem)
        return self._matcher_class(self._grammar.tokenizer, lark, log_level=0)

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        self._executor.unsafe_compute_mask_ptr([(matcher, 0)], bitmask.ctypes.data, bitmask.nbytes, 1)

    def consume(self, matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise ValueError(f"llguidance refused token {token}: {matcher.get_error()}")


class Xgrammar(Library):
    def __init__(self, hf_tokenizer, eos_ids: list[int], vocab_size: int) -> None:
        import torch
        import xgrammar

        self.name = f"xgrammar {_version('xgrammar')}"
        self.threads = len(os.sched_getaffinity(0))
        self._xgr, self._torch = xgrammar, torch
        self._info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids
        )
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # torch int32 [1, words]

    def compile(self, constraint) -> object:
        xgr = self._xgr
        compiler = xgr.GrammarCompiler(self._info, max_threads=self.threads, cache_enabled=False)
        # Polar's canonical JSON (constraints.JSON_OPTIONS): json.dumps's separators, no other whitespace;
        # properties a schema does not forbid are allowed, as in llguidance.
        parts = [
            xgr.Grammar.from_json_schema(
                constraint.json_schema, any_whitespace=False, separators=(", ", ": "), strict_mode=False
            )
        ]
        if constraint.prefix:
            parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(constraint.prefix)}"))
        if constraint.suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(constraint.suffix)}"))
        grammar = parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)
        return xgr.GrammarMatcher(compiler.compile_grammar(grammar))

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        bitmask[:] = self._bitmask[0].numpy()[: len(bitmask)]

    def consume(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def constraints_of_sessions(quick: bool) -> list[tuple[str, object]]:
    """(label, OutputConstraint): a forced call over each recorded session's tools, then the JSON schemas."""
    from gateway.chat_format import get_chat_format
    from gateway.replay import recorded_request
    from gateway.request_constraint import tool_call_constraint
    from polar.inference.constraints import OutputConstraint
    from polar.trajectory.session_file import read_trajectory

    chat_format = get_chat_format("hermes", _hf_tokenizer())
    found = []
    paths = sorted(benchmark_common.RECORDED_SESSIONS.glob("*.json.zst"))
    for path in paths[:2] if quick else paths:
        first = read_trajectory(path).calls[0]
        request = recorded_request(first)
        parsed = request.dialect.parse_request(json.loads(request.body), request.route)
        tools = parsed.conversation.tools
        # What the gateway makes of the request with tool_choice required (a library may refuse it).
        constraint = tool_call_constraint(tools, chat_format)
        harness = path.name.split(".")[0]
        found.append((f"tool_call {harness} ({len(tools)} tools)", constraint))
    for name, schema in (("answer", ANSWER), ("free string", FREE_STRING)):
        found.append((f"json_schema {name}", OutputConstraint("json_schema", json.dumps(schema))))
    return found


_TOKENIZER = None


def _hf_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from polar.inference.models import resolve_model

        _TOKENIZER = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    return _TOKENIZER


def allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    from polar.inference.constraints import bitmask_to_bool

    return bitmask_to_bool(bitmask[None, :], vocab)[0]


def walk(
    libraries: list[Library], constraint, length: int, vocab: int, words: int, seed: int
) -> tuple[list[int], float]:
    """A reply the constraint admits: at each step a token every library allows, drawn at random (the
    end-of-sequence token only when nothing else is allowed), up to `length` tokens; and the share of
    steps at which the libraries allowed the same tokens."""
    rng = random.Random(seed)
    matchers = [library.compile(constraint) for library in libraries]
    bitmask = np.zeros(words, dtype=np.int32)
    tokens, agreeing, steps = [], 0, 0
    eos = set(_grammar_eos())
    while len(tokens) < length:
        steps += 1
        masks = []
        for library, matcher in zip(libraries, matchers):
            bitmask[:] = 0
            library.fill(matcher, bitmask)
            masks.append(allowed(bitmask, vocab))
        agreeing += all((mask == masks[0]).all() for mask in masks)
        both = np.logical_and.reduce(masks).nonzero()[0].tolist()
        choices = [token for token in both if token not in eos] or both
        if not choices:
            break
        token = rng.choice(choices)
        if token in eos:
            break
        for library, matcher in zip(libraries, matchers):
            library.consume(matcher, token)
        tokens.append(token)
    return tokens, agreeing / steps


def _grammar_eos() -> list[int]:
    from polar.inference import models

    return models.end_token_ids(models.resolve_model(MODEL), _hf_tokenizer())


def measure(library: Library, constraint, tokens: list[int], words: int) -> tuple[float, float, list[float]]:
    """(compile ms, first mask ms, per-token mask µs after the first) for one round."""
    started = time.perf_counter()
    matcher = library.compile(constraint)
    compiled = time.perf_counter()
    bitmask = np.zeros(words, dtype=np.int32)
    library.fill(matcher, bitmask)
    first = time.perf_counter()
    masks = []
    for index, token in enumerate(tokens):
        if index:
            begin = time.perf_counter()
            library.fill(matcher, bitmask)
            masks.append((time.perf_counter() - begin) * 1e6)
        library.consume(matcher, token)
    return (compiled - started) * 1e3, (first - compiled) * 1e3, masks


def main() -> int:
    args = _parse_args()
    from polar.inference.constraints import TokenGrammar

    tokenizer = _hf_tokenizer()
    vocab = len(tokenizer)
    grammar = TokenGrammar(tokenizer, _grammar_eos(), vocab)
    words = (vocab + 31) // 32
    libraries: list[Library] = [Llguidance(grammar)]
    missing = ""
    try:
        libraries.append(Xgrammar(tokenizer, _grammar_eos(), vocab))
    except ImportError as exc:
        missing = f"xgrammar is not installed ({exc}); llguidance alone was measured"
        print(missing, file=sys.stderr)
    points: list[Point] = []
    for label, constraint in constraints_of_sessions(args.quick):
        compiling, refused = [], {}
        for library in libraries:
            try:
                library.compile(constraint)
                compiling.append(library)
            except Exception as exc:
                refused[library.name] = str(exc).splitlines()[0][:200]
        points += [Point(label, len(constraint.json_schema), name, reason) for name, reason in refused.items()]
        if not compiling:
            continue
        tokens, agree = walk(compiling, constraint, args.tokens, vocab, words, seed=len(points))
        results: dict[str, tuple[list[float], list[float], list[float]]] = {lib.name: ([], [], []) for lib in compiling}
        for round_ in range(args.rounds):
            order = compiling if round_ % 2 == 0 else compiling[::-1]  # alternate who goes first
            for library in order:
                compile_ms, first_ms, masks = measure(library, constraint, tokens, words)
                results[library.name][0].append(compile_ms)
                results[library.name][1].append(first_ms)
                results[library.name][2].extend(masks)
        for library in compiling:
            compiles, firsts, masks = results[library.name]
            points.append(
                Point(
                    constraint=label,
                    schema_bytes=len(constraint.json_schema),
                    library=library.name,
                    refused="",
                    compile_ms=statistics.median(compiles),
                    first_mask_ms=statistics.median(firsts),
                    mask_us_p50=float(np.percentile(masks, 50)) if masks else 0.0,
                    mask_us_p99=float(np.percentile(masks, 99)) if masks else 0.0,
                    tokens=len(tokens),
                    agree=agree,
                    compile_rounds_ms=tuple(compiles),
                )
            )
    machine = benchmark_common.machine()
    _print_table(points, machine, args.rounds)
    settings = {
        "quick": args.quick,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "model": MODEL,
        "vocab": vocab,
        "xgrammar_threads": getattr(libraries[-1], "threads", 0),
        "missing": missing,
        "load_average_1min": os.getloadavg()[0],
    }
    report = {"machine": machine, "settings": settings, "points": [asdict(p) for p in points]}
    benchmark_common.write_json(report, args.out, "grammar.json")
    return 0


def _parse_args() -> argparse.Namespace:
    quick = "two sessions' tool lists, short replies: under a minute"
    parser = benchmark_common.parser(__doc__, quick, "grammar.json")
    parser.add_argument("--rounds", type=int, help="alternating rounds per constraint (default: 5, --quick 2)")
    parser.add_argument("--tokens", type=int, help="tokens of each walked reply, at most (default: 256, --quick 64)")
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.tokens = args.tokens or (64 if args.quick else 256)
    return args


def _print_table(points: list[Point], machine: dict, rounds: int) -> None:
    print(
        f"\ngrammar libraries, {machine['cpu']} ({machine['cpu_cores']} cores): medians of {rounds} alternating "
        f"rounds; load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        "constraint",
        "schema B",
        "library",
        "compile ms",
        "1st mask ms",
        "mask µs p50",
        "mask µs p99",
        "tokens",
        "agree",
    )
    rows = [
        (
            p.constraint,
            str(p.schema_bytes),
            p.library,
            f"{p.compile_ms:.1f}",
            f"{p.first_mask_ms:.2f}",
            f"{p.mask_us_p50:.0f}",
            f"{p.mask_us_p99:.0f}",
            str(p.tokens),
            f"{p.agree:.0%}",
        )
        if not p.refused
        else (p.constraint, str(p.schema_bytes), p.library, "refused", "", "", "", "", "")
        for p in points
    ]
    benchmark_common.print_table(header, rows, left=len(header))
    for p in points:
        if p.refused:
            print(f"  {p.library} refused {p.constraint}: {p.refused}")


if __name__ == "__main__":
    sys.exit(main())
