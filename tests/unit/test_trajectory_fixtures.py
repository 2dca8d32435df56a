"""Recorded sessions (tests/fixtures/sessions/) pass the same checks as generated ones.

Every session file there (see its README) is rebuilt with both builders, and the rebuilt traces and
the traces stored in the file must verify against the stored call records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.trajectory import build, read_session, verify
from polar.trajectory.session_file import SUFFIXES

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sessions"
FILES = sorted(p for p in FIXTURES.iterdir() if p.name.endswith(SUFFIXES))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_recorded_session_verifies(path):
    calls, stored = read_session(path)
    assert calls, f"{path.name} holds no call records"
    if stored:
        report = verify(calls, stored)
        assert report.ok, report.render()
    for builder in ("per_request", "prefix_merging"):
        report = verify(calls, build(builder, calls).traces)
        assert report.ok, report.render()
