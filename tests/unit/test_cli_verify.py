"""`polar verify FILE…`: exit 0 for faithful session files, 1 for an unfaithful trace, 2 for an unreadable file."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.app.cli import main
from polar.testing.trajectories import tool_session
from polar.trajectory import build
from polar.trajectory.session_file import read_trajectory, session_trajectory, write_session


@pytest.fixture
def session_file(tmp_path: Path) -> Path:
    calls = tool_session(turns=4, seed=3)
    path = tmp_path / "session.json.zst"
    write_session(path, session_trajectory(calls, build("prefix_merging", calls), session_id="s1"))
    return path


def test_a_faithful_session_passes(session_file, capsys):
    assert main(["verify", str(session_file)]) == 0
    assert str(session_file) in capsys.readouterr().out


def test_a_trace_token_that_was_not_sampled_fails(session_file, tmp_path, capsys):
    trajectory = read_trajectory(session_file)
    trace = trajectory.traces[0]
    sampled = next(i for i, mask in enumerate(trace.loss_mask) if mask)
    trace.token_ids[sampled] += 1
    corrupted = tmp_path / "corrupted.pb"
    write_session(corrupted, trajectory)
    assert main(["verify", str(session_file), str(corrupted)]) == 1
    out = capsys.readouterr().out
    assert str(corrupted) in out


def test_an_unreadable_file_is_a_one_line_error(tmp_path, capsys):
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert main(["verify", str(garbage)]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"cannot read {garbage}") and "Traceback" not in out
