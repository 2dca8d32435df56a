"""What happened to a session's calls, counted: the trainer reports these per step beside its traces
(trainer/screening.py). Pure: call views in arrival order in, counts out.

* ``calls_aborted``: the client went away before the reply was whole (an aborted stream);
* ``calls_failed``: the call failed once its prompt had gone to the engine (a hung or lost engine);
* ``calls_prompt_too_long``: refused before generation, the prompt being longer than the context;
* ``calls_retried``: a call whose prompt is, token for token, that of an earlier call of the three
  kinds above: the harness sent the same request again after the error;
* ``calls_truncated``: cut by a limit the harness did not ask for (the task's cap or budget, the
  context window).

A call is counted once among the first three; ``calls_retried`` and ``calls_truncated`` count beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

from polar.trajectory.records import CallView
from polar.v1 import common_pb2

CALL_COUNTS = ("calls", "calls_aborted", "calls_failed", "calls_prompt_too_long", "calls_retried", "calls_truncated")


def call_counts(calls: Sequence[CallView]) -> dict[str, int]:
    """The counts of CALL_COUNTS over one session's calls (in arrival order)."""
    counts = dict.fromkeys(CALL_COUNTS, 0)
    failed_prompts: set[bytes] = set()
    for call in calls:
        prompt = call.prompt_ids.tobytes()
        counts["calls"] += 1
        if prompt in failed_prompts:
            counts["calls_retried"] += 1
        if call.prompt_too_long:
            counts["calls_prompt_too_long"] += 1
        elif call.aborted or call.finish_reason == common_pb2.FINISH_REASON_ABORTED:
            counts["calls_aborted"] += 1
        elif call.finish_reason == common_pb2.FINISH_REASON_ERROR:
            counts["calls_failed"] += 1
        counts["calls_truncated"] += call.truncated
        if call.prompt_too_long or call.interrupted:
            failed_prompts.add(prompt)
    return counts
