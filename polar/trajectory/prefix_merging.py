"""The ``prefix_merging`` builder: a session's calls grouped into chains, one trace per chain.

Chains
------
Calls are taken in arrival order. Each chain has a *tip*: the tokens a call must start with to join
it. A call joins the chain whose tip its prompt extends token for token (the prompt starts with the
tip, equal length included); when several tips match, the longest wins (then the chain extended most
recently). Joining sets the tip to ``prompt ‖ sample``, so the chain's trace is
``p1 ‖ a1 ‖ u2 ‖ a2 ‖ …``: every sampled span ``a_i`` has loss mask 1 and its logprobs, every
prompt or interstitial span (``p1``, ``u_i``: tool results, user turns, template tokens) has mask 0.
Each call contributes a PROMPT segment for its new prompt tokens and a SAMPLED segment for its sample;
a SAMPLED segment carries its call's sampling, and a trace is truncated when any call whose sample it
holds was (cut by the task's token limits or the context window).

End of turn: a response that stopped on the end-of-turn token holds it as its last sampled token, and
the next prompt continues after it; a response cut at max tokens does not hold it, and the gateway's
next prompt carries it as its first new token. Both are plain extensions of ``prompt ‖ sample``, so both
merge, the end-of-turn token being trainable in the first case and interstitial (mask 0) in the second.

Interrupted calls (aborted by the client, finish reason ABORTED or ERROR): the harness never received
the whole response, so no later prompt holds the partial sample. Such a call joins a chain like any
other, but moves the tip only to the end of its *prompt*: its prompt is real context (the retry that
usually follows extends it), its sample is not. When the chain ends with it, its partial sample closes
the chain's trace; when a later call joins the chain, the interrupted call is split off as a sibling
trace ``prompt ‖ partial sample`` with fork reason "aborted_call". Either way each partial sample is
trained exactly once, in exactly the context it was sampled in. Calls that sampled nothing have nothing
to train and are left out (they still count in ``MergeStats.calls``).

Forks
-----
A call that extends no tip starts a new chain, a sibling trace holding its whole prompt: nothing is
truncated. Its fork reason is decided against the chain ``K`` it shares the longest common prefix ``l``
with (ties: the chain extended most recently). Let ``n1`` be the length of ``K``'s first prompt,
``m`` the call that last joined ``K``, and ``e`` the point ``m`` extended (the tip before ``m``
joined; ``n1`` when ``m`` is ``K``'s first call). The first matching rule wins:

1. "parallel_branch": ``l >= e``, unless the call diverges inside ``m``'s sample and goes on past the
   divergence (``l >= len(m.prompt)`` and ``len(prompt) > l``, which is a rewritten sample). The call
   extends the same point as ``m``: a concurrent request, a second sample of the same prompt, a retry
   of ``m``, or (indistinguishable in tokens) a rewrite of only the newest messages.
2. "sub_agent": ``l < n1`` and a chain that existed before the call takes another call after it. The
   call shares no more than part of ``K``'s first prompt (the system prompt, the tools block) and runs
   beside the existing chains instead of replacing them.
3. "compaction": ``len(prompt) < len(K's tip)``. The call rewrote ``K``'s history into a shorter one
   (summarised it, cleared old tool results).
4. "edit": otherwise. The call diverges inside ``K``'s history and keeps at least as much of it.

Rule 2 looks ahead: whether the old chains go on is known only once the session is over, and it is what
tells a sub-agent (the main chain resumes after it) from a compaction that keeps the system prompt (the
main chain is abandoned). A sub-agent that is the session's last activity is therefore counted as a
compaction or edit. The first trace of a session has no fork reason; interrupted calls split off as
above have "aborted_call".

Speed: joining compares whole prompts as bytes (``bytes.startswith``) and forks use one numpy
comparison per chain, so the cost is a few memory passes over the session's tokens, no per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

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
        if len(chain.tip) <= len(prompt) and prompt.startswith(chain.tip):
            if best is None or (len(chain.tip), chain.last_index) > (len(best.tip), best.last_index):
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
