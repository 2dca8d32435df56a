"""The verifier: are a session's traces faithful to what the engine sampled?

Every trainable token must be a token the engine sampled, with its recorded logprob, in exactly the
context the engine was given; constrained calls are replayed against their grammar. Every problem
names the trace, the position and the call. The checks: docs/design/trajectories.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np

from polar.inference.constraints import ConstraintError, ConstraintViolation, TokenGrammar
from polar.trajectory.records import (
    BuiltTrace,
    CallView,
    SegmentKind,
    SessionFileError,
    VerificationError,
)
from polar.trajectory.session_file import read_session

_WEIGHT_TOLERANCE = 1e-4  # Trace.weight is a float32


@dataclass(frozen=True)
class Problem:
    trace_id: str  # empty when the problem is about a call, not a trace
    position: int  # token position in the trace; -1 when it is about no single position
    call_id: str  # empty when no call is involved
    message: str

    def __str__(self) -> str:
        where = [f"trace {self.trace_id}"] if self.trace_id else []
        if self.position >= 0:
            where.append(f"position {self.position}")
        if self.call_id:
            where.append(f"call {self.call_id}")
        return f"{', '.join(where)}: {self.message}"


@dataclass(frozen=True)
class VerificationReport:
    problems: tuple[Problem, ...]
    traces: int  # traces checked
    calls: int  # calls in the session
    sampled_tokens: int  # mask-1 tokens checked against their call

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        head = (
            f"{'ok' if self.ok else 'FAILED'}: {self.traces} traces, {self.calls} calls, "
            f"{self.sampled_tokens} sampled tokens checked, {len(self.problems)} problems"
        )
        return "\n".join([head, *(f"  {problem}" for problem in self.problems)])


def _first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """First index where ``a`` and ``b`` differ, counting a length difference; None if equal."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    if differ.size:
        return int(differ[0])
    return None if len(a) == len(b) else n


class _Checker:
    def __init__(self, calls: Sequence[CallView]) -> None:
        self.calls = {call.call_id: call for call in calls}
        self.problems: list[Problem] = []
        self.sampled_tokens = 0
        self.occurrences: dict[str, list[str]] = {}

    def problem(self, trace_id: str, position: int, call_id: str, message: str) -> None:
        self.problems.append(Problem(trace_id, position, call_id, message))

    def check_trace(self, trace: BuiltTrace) -> None:
        tid, n = trace.trace_id, len(trace.token_ids)
        if len(trace.loss_mask) != n or len(trace.logprobs) != n:
            self.problem(
                tid,
                -1,
                "",
                f"{n} tokens but {len(trace.loss_mask)} mask entries and {len(trace.logprobs)} logprobs",
            )
            return
        bad_mask = np.flatnonzero(trace.loss_mask > 1)
        if bad_mask.size:
            self.problem(tid, int(bad_mask[0]), "", f"loss mask {trace.loss_mask[bad_mask[0]]} is not 0 or 1")
        stray = np.flatnonzero((trace.loss_mask == 0) & (trace.logprobs != 0))
        if stray.size:
            self.problem(tid, int(stray[0]), "", "logprob set on a token with loss mask 0")
        sampled_segments = sum(1 for s in trace.segments if s.kind == SegmentKind.SAMPLED)
        if sampled_segments != len(trace.policy_versions):
            self.problem(
                tid,
                -1,
                "",
                f"{sampled_segments} sampled segments but {len(trace.policy_versions)} policy versions",
            )
        expected_start, sampled_seen, truncated = 0, 0, False
        for segment in trace.segments:
            if segment.start != expected_start or not segment.start < segment.end <= n:
                self.problem(
                    tid,
                    segment.start,
                    segment.call_id,
                    f"segment [{segment.start}, {segment.end}) does not continue the previous one "
                    f"(expected start {expected_start}) inside a trace of {n} tokens",
                )
                return
            expected_start = segment.end
            call = self.calls.get(segment.call_id)
            if call is None:
                self.problem(tid, segment.start, segment.call_id, "segment names a call that is not in the session")
                continue
            if segment.kind == SegmentKind.SAMPLED:
                version = trace.policy_versions[sampled_seen] if sampled_seen < len(trace.policy_versions) else None
                sampled_seen += 1
                truncated = truncated or call.truncated
                self.check_sampled(trace, segment.start, segment.end, call, version)
                if segment.sampling != call.sampling:
                    self.problem(
                        tid,
                        segment.start,
                        segment.call_id,
                        f"segment sampling {segment.sampling} is not the call's {call.sampling}",
                    )
            else:
                self.check_prompt(trace, segment.start, segment.end, call)
        if expected_start != n:
            self.problem(tid, expected_start, "", f"segments end at {expected_start}, the trace has {n} tokens")
        if trace.truncated != truncated:
            self.problem(
                tid,
                -1,
                "",
                f"marked {'' if trace.truncated else 'not '}truncated, but "
                f"{'a' if truncated else 'no'} call whose sample it holds was truncated",
            )

    def check_prompt(self, trace: BuiltTrace, start: int, end: int, call: CallView) -> None:
        tid = trace.trace_id
        trained = np.flatnonzero(trace.loss_mask[start:end])
        if trained.size:
            self.problem(tid, start + int(trained[0]), call.call_id, "loss mask 1 inside a prompt segment")
        if end > len(call.prompt_ids):
            self.problem(
                tid,
                start,
                call.call_id,
                f"prompt segment ends at {end}, past the call's {len(call.prompt_ids)}-token prompt",
            )
            return
        diff = _first_difference(trace.token_ids[start:end], call.prompt_ids[start:end])
        if diff is not None:
            self.problem(tid, start + diff, call.call_id, "prompt segment token differs from the call's prompt")

    def check_sampled(self, trace: BuiltTrace, start: int, end: int, call: CallView, version: int | None) -> None:
        tid, cid = trace.trace_id, call.call_id
        self.occurrences.setdefault(cid, []).append(tid)
        self.sampled_tokens += end - start
        untrained = np.flatnonzero(trace.loss_mask[start:end] != 1)
        if untrained.size:
            self.problem(tid, start + int(untrained[0]), cid, "loss mask 0 inside a sampled segment")
        context = _first_difference(trace.token_ids[:start], call.prompt_ids)
        if context is not None:
            self.problem(
                tid,
                context,
                cid,
                f"context differs from the prompt the engine was given ({len(call.prompt_ids)} tokens; "
                f"the sampled span starts at {start})",
            )
        diff = _first_difference(trace.token_ids[start:end], call.sampled_ids)
        if diff is not None:
            self.problem(
                tid,
                start + diff,
                cid,
                f"sampled span of {end - start} tokens differs from the call's {len(call.sampled_ids)} "
                f"sampled tokens at offset {diff}",
            )
        diff = _first_difference(trace.logprobs[start:end], call.logprobs)
        if diff is not None:
            self.problem(tid, start + diff, cid, "behaviour logprob differs from the recorded one")
        if version is not None and version != call.policy_version:
            self.problem(tid, start, cid, f"policy version {version}, the call was sampled by {call.policy_version}")

    def check_coverage(self, calls: Sequence[CallView]) -> None:
        for call in calls:
            seen = self.occurrences.get(call.call_id, [])
            if len(call.sampled_ids) and not seen:
                self.problem("", -1, call.call_id, f"its {len(call.sampled_ids)} sampled tokens appear in no trace")
            elif len(seen) > 1:
                traces = ", ".join(seen)
                self.problem("", -1, call.call_id, f"its sampled tokens appear {len(seen)} times (traces {traces})")

    def check_weights(self, traces: Sequence[BuiltTrace]) -> None:
        for trace in traces:
            if trace.weight < 0:
                self.problem(trace.trace_id, -1, "", f"negative weight {trace.weight}")
        if any(trace.trainable_tokens for trace in traces):
            total = sum(trace.weight for trace in traces)
            if abs(total - 1.0) > _WEIGHT_TOLERANCE:
                self.problem("", -1, "", f"trace weights sum to {total}, not 1")


def verify(calls: Sequence[CallView], traces: Sequence[BuiltTrace]) -> VerificationReport:
    """Check ``traces`` against the session's ``calls``; never raises on unfaithful traces."""
    checker = _Checker(calls)
    for trace in traces:
        checker.check_trace(trace)
    checker.check_coverage(calls)
    checker.check_weights(traces)
    return VerificationReport(tuple(checker.problems), len(traces), len(calls), checker.sampled_tokens)


def verify_or_raise(calls: Sequence[CallView], traces: Sequence[BuiltTrace]) -> VerificationReport:
    """Like ``verify``, but raise ``VerificationError`` listing every problem."""
    report = verify(calls, traces)
    if not report.ok:
        raise VerificationError(report.render())
    return report


def check_constraints(calls: Sequence[CallView], grammar: TokenGrammar | None) -> list[Problem]:
    """A problem for each constrained call whose sampled ids its constraint's mask did not all admit
    (the first refused one named), or, without a grammar, for each constrained call not re-checked."""
    problems = []
    for call in calls:
        constraint = call.sampling.constraint if call.sampling is not None else None
        if constraint is None:
            continue
        if grammar is None:
            problems.append(
                Problem(
                    "", -1, call.call_id, f"a {constraint.kind} constraint applied: give --model to re-check its mask"
                )
            )
            continue
        try:
            grammar.replay(constraint, call.sampled_ids.tolist())
        except ConstraintViolation as exc:
            problems.append(Problem("", exc.index, call.call_id, str(exc)))
        except ConstraintError as exc:
            problems.append(Problem("", -1, call.call_id, f"its constraint cannot be compiled: {exc}"))
    return problems


def verify_file(path: str | Path, grammar: TokenGrammar | None = None) -> VerificationReport:
    """Verify the traces stored in a session file against the call records stored with them, and its
    constrained calls against their grammar (`grammar`: the model's)."""
    calls, traces = read_session(path)
    report = verify(calls, traces)
    constraint_problems = check_constraints(calls, grammar)
    return replace(report, problems=report.problems + tuple(constraint_problems)) if constraint_problems else report


def verify_command(path: str | Path, out: TextIO, grammar: TokenGrammar | None = None) -> int:
    """``polar verify FILE``: write the report to ``out``; exit status 0 ok, 1 unfaithful, 2 unreadable."""
    try:
        report = verify_file(path, grammar)
    except SessionFileError as exc:
        out.write(f"cannot read {path}: {exc}\n")
        return 2
    out.write(f"{path}: {report.render()}\n")
    return 0 if report.ok else 1
