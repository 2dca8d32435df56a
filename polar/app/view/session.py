"""A session as the page draws it: its calls in order (each call's prompt as the difference from
the call before it), its traces as a fork tree, what the verifier says of them, and one trace's tokens
as the trainer packs them.

The advantage is the trainer's: the group's rewards through trainer.grpo.group_advantages with the
run's advantage settings ([trainer] advantage_scale and leave_one_out of the config the viewer was
given, else their defaults).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from polar.app.view import dialects
from polar.trajectory.records import BuiltTrace, views_from_protos
from polar.trajectory.verify import Problem, verify
from polar.v1 import common_pb2

Decode = Callable[[Sequence[int]], list[str]]


def dialect_name(dialect: int) -> str:
    return common_pb2.Dialect.Name(dialect).removeprefix("DIALECT_").lower()


def finish_name(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


class Tokens:
    """Token ids to text with the served model's tokenizer, loaded once on first use; without a
    model, every token is shown as its id."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._tokenizer = None
        self._lock = threading.Lock()
        self.problem = ""

    def _load(self):
        with self._lock:
            if self._tokenizer is None and self.model and not self.problem:
                try:
                    from polar.inference.tokenizer_files import load_tokenizer

                    self._tokenizer = load_tokenizer(self.model)
                except (OSError, ValueError, LookupError) as exc:
                    self.problem = f"the tokenizer of {self.model} could not be loaded ({exc}); tokens shown as ids"
            return self._tokenizer

    def pieces(self, ids: Sequence[int]) -> list[str] | None:
        """Each token's own text (None without a tokenizer)."""
        tokenizer = self._load()
        if tokenizer is None:
            return None
        return [_piece(tokenizer, int(i)) for i in ids]

    def text(self, ids: Sequence[int]) -> str | None:
        tokenizer = self._load()
        return None if tokenizer is None else tokenizer.decode(list(ids))


@functools.lru_cache(maxsize=1 << 17)
def _piece_cached(tokenizer_id: int, tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _piece(tokenizer, token: int) -> str:
    return _piece_cached(id(tokenizer), tokenizer, token)


def advantages(rewards: Sequence[float], scale: str, leave_one_out: bool) -> list[float]:
    import torch

    from trainer.grpo import group_advantages

    if not rewards:
        return []
    return group_advantages(
        torch.tensor(rewards, dtype=torch.float64), scale=scale, leave_one_out=leave_one_out
    ).tolist()


def _sampling(params: common_pb2.SamplingParams) -> dict[str, Any]:
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "seed": params.seed if params.HasField("seed") else None,
        "constraint": params.constraint.kind if params.HasField("constraint") else "",
    }


def _shared_prefix(a: list, b: list) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _trace_of_call(trajectory: common_pb2.Trajectory) -> dict[str, str]:
    owner = {}
    for trace in trajectory.traces:
        for segment in trace.segments:
            if segment.kind == common_pb2.TraceSegment.KIND_SAMPLED:
                owner[segment.call_id] = trace.trace_id
    return owner


def _calls(trajectory: common_pb2.Trajectory, tokens: Tokens) -> list[dict[str, Any]]:
    owner = _trace_of_call(trajectory)
    out = []
    previous: tuple[str, list, list] | None = None  # system, turns (request + reply), tools of the call before
    for call in trajectory.calls:
        dialect = dialect_name(call.dialect)
        system, turns, tools = dialects.read_request(dialect, call.request_body)
        reply = dialects.read_response(dialect, call.response_body)
        reply_source = "response"
        if not reply and call.sampled_token_ids:
            decoded = tokens.text(call.sampled_token_ids)
            reply_source = "sampled tokens" if decoded is not None else "none"
            reply = [dialects.turn("assistant", [dialects.part(dialects.TEXT, decoded)])] if decoded is not None else []
        shared = 0
        if previous is not None:
            shared = _shared_prefix(previous[1], turns)
        t = call.timings
        out.append(
            {
                "call_id": call.call_id,
                "dialect": dialect,
                "model": call.model,
                "stream": call.stream,
                "finish": finish_name(call.finish_reason),
                "truncated": call.truncated,
                "aborted": call.aborted,
                "error": call.error,
                "prompt_too_long": call.prompt_too_long,
                "bodies_dropped": call.bodies_dropped,
                "policy_version": call.policy_version,
                "last_policy_version": call.last_policy_version,
                "extends": call.extends_call_id,
                "forced_tokens": call.forced_token_count,
                "prompt_tokens": len(call.prompt_token_ids),
                "sampled_tokens": len(call.sampled_token_ids),
                "cached_tokens": call.usage.cached_prompt_tokens,
                "timings": {
                    "received_unix_ns": t.received_unix_ns,
                    "render": t.render_seconds,
                    "queue": t.queue_seconds,
                    "first_token": t.time_to_first_token_seconds,
                    "total": t.total_seconds,
                },
                "sampling": _sampling(call.sampling),
                "system": system if previous is None or previous[0] != system else None,
                "tools": tools if previous is None or previous[2] != tools else None,
                "shared_turns": shared,
                "turns": turns[shared:],
                "reply": reply,
                "reply_source": reply_source,
                "trace_id": owner.get(call.call_id, ""),
            }
        )
        previous = (system, turns + reply, tools)
    return out


def _fork_tree(trajectory: common_pb2.Trajectory) -> list[dict[str, Any]]:
    """Each trace with the trace it forked from: the one holding the latest call before its first."""
    order = {call.call_id: index for index, call in enumerate(trajectory.calls)}
    first_call = {}
    calls_of = {}
    for trace in trajectory.traces:
        ids = [s.call_id for s in trace.segments if s.kind == common_pb2.TraceSegment.KIND_SAMPLED]
        calls_of[trace.trace_id] = ids
        first_call[trace.trace_id] = min((order.get(c, 0) for c in ids), default=0)
    nodes = []
    for index, trace in enumerate(trajectory.traces):
        parent = ""
        if index:
            start = first_call[trace.trace_id]
            earlier = [
                (
                    max((order.get(c, 0) for c in calls_of[t.trace_id] if order.get(c, 0) < start), default=-1),
                    t.trace_id,
                )
                for t in trajectory.traces[:index]
            ]
            latest, owner = max(earlier)
            parent = owner if latest >= 0 else trajectory.traces[0].trace_id
        nodes.append(
            {
                "trace_id": trace.trace_id,
                "parent": parent,
                "fork_reason": trace.fork_reason,
                "tokens": len(trace.token_ids),
                "trainable": int(sum(trace.loss_mask)),
                "weight": trace.weight,
                "truncated": trace.truncated,
                "calls": calls_of[trace.trace_id],
            }
        )
    return nodes


def check(trajectory: common_pb2.Trajectory) -> tuple[Problem, ...]:
    """What `polar verify` says of the session's traces (constraints aside: they need the grammar)."""
    report = verify(views_from_protos(trajectory.calls), [BuiltTrace.from_proto(t) for t in trajectory.traces])
    return report.problems


def session_page(
    trajectory: common_pb2.Trajectory, summary: dict[str, Any], advantage: float | None, tokens: Tokens
) -> dict[str, Any]:
    problems = check(trajectory)
    return {
        "session_id": trajectory.session_id,
        "task_id": trajectory.task_id,
        "group_id": trajectory.group_id,
        "reward": trajectory.reward,
        "advantage": advantage,
        "outcome": common_pb2.SessionOutcome.Name(trajectory.outcome).removeprefix("SESSION_OUTCOME_").lower(),
        "error": trajectory.error,
        "attempt": trajectory.attempt,
        "harness": summary.get("harness", ""),
        "harness_exit_code": trajectory.harness_exit_code,
        "harness_output": trajectory.harness_output,
        "evaluator_output": trajectory.evaluator_output,
        "builder": trajectory.builder,
        "policy_versions": [trajectory.min_policy_version, trajectory.max_policy_version],
        "timings": summary.get("timings", {}),
        "metadata": dict(trajectory.metadata),
        "forks": dict(trajectory.stats.forks),
        "abandoned_calls": len(trajectory.abandoned_calls),
        "calls": _calls(trajectory, tokens),
        "traces": _fork_tree(trajectory),
        "verify": {"ok": not problems, "problems": [str(p) for p in problems[:200]], "count": len(problems)},
    }


def trace_page(
    trajectory: common_pb2.Trajectory, trace_id: str, advantage: float | None, tokens: Tokens
) -> dict[str, Any] | None:
    trace = next((t for t in trajectory.traces if t.trace_id == trace_id), None)
    if trace is None:
        return None
    problems = [p for p in check(trajectory) if p.trace_id in (trace_id, "")]
    pieces = tokens.pieces(trace.token_ids)
    return {
        "session_id": trajectory.session_id,
        "trace_id": trace.trace_id,
        "fork_reason": trace.fork_reason,
        "weight": trace.weight,
        "truncated": trace.truncated,
        "advantage": advantage,
        "token_ids": list(trace.token_ids),
        "pieces": pieces,
        "tokenizer": tokens.model if pieces is not None else "",
        "tokenizer_problem": tokens.problem,
        "loss_mask": list(trace.loss_mask),
        "logprobs": [round(x, 4) for x in trace.behaviour_logprobs],
        "segments": [
            {
                "kind": "sampled" if s.kind == common_pb2.TraceSegment.KIND_SAMPLED else "prompt",
                "start": s.start,
                "end": s.end,
                "call_id": s.call_id,
            }
            for s in trace.segments
        ],
        "bad": [{"position": p.position, "message": str(p)} for p in problems if p.position >= 0],
        "problems": [str(p) for p in problems if p.position < 0],
    }


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)
