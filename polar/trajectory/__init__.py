"""Trajectory reconstruction: a session's call records → trainer-ready traces.

``build(name, calls)`` runs a builder over a session's calls (``CallView``, in arrival order):

* ``per_request`` (per_request.py): one trace per call;
* ``prefix_merging`` (prefix_merging.py): calls whose prompts extend one another merge into one trace
  per chain; forks become sibling traces with a reason.

``verify`` (verify.py) proves traces faithful to the calls; rewards.py attaches a session's reward and
weight to its traces; session_file.py reads and writes session files; synthetic.py generates sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polar.trajectory.per_request import build_per_request
from polar.trajectory.prefix_merging import FORK_REASONS, build_prefix_merging
from polar.trajectory.records import (
    BuildResult,
    BuiltTrace,
    CallView,
    InvalidCallError,
    MergeStats,
    Segment,
    SegmentKind,
    SessionFileError,
    TrajectoryError,
    UnknownBuilderError,
    VerificationError,
    views_from_protos,
)
from polar.trajectory.rewards import TraceCredit, credit_traces, session_loss, token_share_weights
from polar.trajectory.session_file import read_session, session_trajectory, write_session
from polar.trajectory.verify import (
    Problem,
    VerificationReport,
    verify,
    verify_command,
    verify_file,
    verify_or_raise,
)

BUILDERS: dict[str, Callable[[Sequence[CallView]], BuildResult]] = {
    "per_request": build_per_request,
    "prefix_merging": build_prefix_merging,
}


def build(builder: str, calls: Sequence[CallView]) -> BuildResult:
    """Run the builder registered as ``builder`` over one session's calls."""
    try:
        run = BUILDERS[builder]
    except KeyError:
        raise UnknownBuilderError(
            f"unknown trajectory builder {builder!r}; known builders: {', '.join(sorted(BUILDERS))}"
        ) from None
    return run(calls)


__all__ = [
    "BUILDERS",
    "FORK_REASONS",
    "BuildResult",
    "BuiltTrace",
    "CallView",
    "InvalidCallError",
    "MergeStats",
    "Problem",
    "Segment",
    "SegmentKind",
    "SessionFileError",
    "TraceCredit",
    "TrajectoryError",
    "UnknownBuilderError",
    "VerificationError",
    "VerificationReport",
    "build",
    "credit_traces",
    "read_session",
    "session_loss",
    "session_trajectory",
    "token_share_weights",
    "verify",
    "verify_command",
    "verify_file",
    "verify_or_raise",
    "views_from_protos",
    "write_session",
]
