"""The ``per_request`` builder: one trace per call, ``prompt ‖ sample``.

The baseline prefix merging is measured against. Every call that sampled something becomes one trace:
its prompt with loss mask 0, its sampled tokens with mask 1 and their logprobs (the SAMPLED segment
carries the call's sampling; the trace is truncated when the call was). Calls that sampled
nothing have nothing to train on and produce no trace. The first trace has no fork reason, every other
one has "per_request": each of them repeats the history the previous call already held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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

NAME = "per_request"


def call_trace(call: CallView, trace_id: str, fork_reason: str) -> BuiltTrace:
    """The trace ``prompt ‖ sample`` of a single call."""
    prompt_len, sampled_len = len(call.prompt_ids), len(call.sampled_ids)
    total = prompt_len + sampled_len
    loss_mask = np.zeros(total, dtype=np.uint8)  # (T,)
    loss_mask[prompt_len:] = 1
    logprobs = np.zeros(total, dtype=np.float32)  # (T,)
    logprobs[prompt_len:] = call.logprobs
    segments = [Segment(SegmentKind.SAMPLED, prompt_len, total, call.call_id, call.sampling)]
    if prompt_len:
        segments.insert(0, Segment(SegmentKind.PROMPT, 0, prompt_len, call.call_id))
    return BuiltTrace(
        trace_id=trace_id,
        token_ids=np.concatenate((call.prompt_ids, call.sampled_ids)),
        loss_mask=loss_mask,
        logprobs=logprobs,
        segments=tuple(segments),
        policy_versions=(call.policy_version,),
        fork_reason=fork_reason,
        truncated=call.truncated,
    )


def build_per_request(calls: Sequence[CallView]) -> BuildResult:
    check_unique_ids(calls)
    traces = []
    for call in calls:
        if len(call.sampled_ids):
            reason = "per_request" if traces else ""
            traces.append(call_trace(call, f"t{len(traces)}", reason))
    return BuildResult(NAME, with_token_share_weights(traces), make_stats(calls, traces))
