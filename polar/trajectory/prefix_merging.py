"""The ``prefix_merging`` builder: a session's calls grouped into chains, one trace per chain.

A call joins the chain whose tip (``prompt ‖ sample`` of its last call) its prompt extends; a call that
extends none starts a sibling trace with a fork reason (parallel_branch, sub_agent, compaction, edit),
and an interrupted call's partial sample is trained once, in its own context (aborted_call). The rules
and why they are so: docs/design/trajectories.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from polar.trajectory.per_request import call_trace
from polar.trajectory.records import (
    BuildResult,
    BuiltTrace,
    CallView,
    Segment,
    SegmentKind,
    check_unique_ids,
    make_stats,
)
from polar.trajectory.rewards import with_token_share_weights

NAME = "prefix_merging"
FORK_REASONS = ("compaction", "edit", "sub_agent", "parallel_branch", "aborted_call")
_TOKEN_BYTES = np.dtype(np.int32).itemsize


@dataclass(frozen=True)
class _Member:
    call: CallView
    index: int  # arrival position of the call in the session
    start: int  # the chain's length when the call joined: where its new prompt tokens begin


@dataclass(frozen=True)
class _Fork:
    """What rules 1–4 need to know about a call that started a new chain."""

    index: int
    parallel: bool  # rule 1 holds
    within_first_prompt: bool  # l < n1
    shorter: bool  # len(prompt) < len(K's tip)


@dataclass
class _Chain:
    first_index: int
    fork: _Fork | None  # None for the session's first chain
    members: list[_Member] = field(default_factory=list)
    tip: bytes = b""  # int32 token ids a joining prompt must start with

    @property
    def tip_len(self) -> int:
        return len(self.tip) // _TOKEN_BYTES

    @property
    def last_index(self) -> int:
        return self.members[-1].index


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _extended_chain(chains: list[_Chain], prompt: bytes) -> _Chain | None:
    best = None
    for chain in chains:
        extends = len(chain.tip) <= len(prompt) and prompt.startswith(chain.tip)
        if extends and (best is None or (len(chain.tip), chain.last_index) > (len(best.tip), best.last_index)):
            best = chain
    return best


def _fork(chains: list[_Chain], call: CallView, index: int) -> _Fork:
    prompt = call.prompt_ids
    best, shared = chains[0], -1
    for chain in chains:
        common = _common_prefix(prompt, np.frombuffer(chain.tip, dtype=np.int32))
        if (common, chain.last_index) > (shared, best.last_index):
            best, shared = chain, common
    first_prompt = len(best.members[0].call.prompt_ids)
    latest = best.members[-1]
    point = latest.start if len(best.members) > 1 else first_prompt
    rewrote_sample = shared >= len(latest.call.prompt_ids) and len(prompt) > shared
    return _Fork(
        index=index,
        parallel=shared >= point and not rewrote_sample,
        within_first_prompt=shared < first_prompt,
        shorter=len(prompt) < best.tip_len,
    )


def _reason(fork: _Fork | None, chains: list[_Chain]) -> str:
    if fork is None:
        return ""
    if fork.parallel:
        return "parallel_branch"
    beside = any(c.first_index < fork.index < c.last_index for c in chains)
    if fork.within_first_prompt and beside:
        return "sub_agent"
    return "compaction" if fork.shorter else "edit"


def _chain_trace(chain: _Chain, reason: str) -> tuple[BuiltTrace, list[_Member]]:
    """The chain's trace and the interrupted members split off from it."""
    last = chain.members[-1]
    token_ids = np.concatenate((last.call.prompt_ids, last.call.sampled_ids))  # (T,)
    loss_mask = np.zeros(len(token_ids), dtype=np.uint8)  # (T,)
    logprobs = np.zeros(len(token_ids), dtype=np.float32)  # (T,)
    segments: list[Segment] = []
    versions: list[int] = []
    split_off: list[_Member] = []
    truncated = False
    for member in chain.members:
        call = member.call
        prompt_end = len(call.prompt_ids)
        if prompt_end > member.start:
            segments.append(Segment(SegmentKind.PROMPT, member.start, prompt_end, call.call_id))
        if call.interrupted and member is not last:
            split_off.append(member)
            continue
        sampled_end = prompt_end + len(call.sampled_ids)
        segments.append(Segment(SegmentKind.SAMPLED, prompt_end, sampled_end, call.call_id, call.sampling))
        loss_mask[prompt_end:sampled_end] = 1
        logprobs[prompt_end:sampled_end] = call.logprobs
        versions.append(call.policy_version)
        truncated = truncated or call.truncated
    trace = BuiltTrace(
        "", token_ids, loss_mask, logprobs, tuple(segments), tuple(versions), reason, truncated=truncated
    )
    return trace, split_off


def build_prefix_merging(calls: Sequence[CallView]) -> BuildResult:
    check_unique_ids(calls)
    chains: list[_Chain] = []
    for index, call in enumerate(calls):
        if not len(call.sampled_ids):
            continue
        prompt = call.prompt_ids.tobytes()
        chain = _extended_chain(chains, prompt)
        if chain is None:
            chain = _Chain(first_index=index, fork=_fork(chains, call, index) if chains else None)
            chains.append(chain)
        chain.members.append(_Member(call, index, chain.tip_len))
        chain.tip = prompt if call.interrupted else prompt + call.sampled_ids.tobytes()

    ordered: list[tuple[tuple[int, int], BuiltTrace]] = []
    for chain in chains:
        trace, split_off = _chain_trace(chain, _reason(chain.fork, chains))
        ordered.append(((chain.first_index, 0), trace))
        for member in split_off:
            ordered.append(((member.index, 1), call_trace(member.call, "", "aborted_call")))
    ordered.sort(key=lambda item: item[0])
    traces = [replace(trace, trace_id=f"t{i}") for i, (_, trace) in enumerate(ordered)]
    return BuildResult(NAME, with_token_share_weights(traces), make_stats(calls, traces))
