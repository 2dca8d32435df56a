"""scripts/bench_test_cost.py: a pytest run's CPU time, summed by kind over pytest's process and its
descendants, and nothing else the machine runs meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_test_that_burns_cpu_in_a_child_shows_it_under_the_childs_kind(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(
        textwrap.dedent(
            """
            import subprocess, sys

            def test_burn():
                subprocess.run([sys.executable, "burner.py"], check=True, cwd=__file__.rsplit("/", 1)[0])
            """
        )
    )
    # About a second of CPU: the sampler reads /proc every 0.1 s here.
    (tmp_path / "burner.py").write_text(
        "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n"
    )
    # The same program outside pytest, at the same time: not pytest's, so not counted.
    bystander = subprocess.Popen([sys.executable, str(tmp_path / "burner.py")])
    out = tmp_path / "cost.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_test_cost.py", "--interval", "0.1", "--out", str(out), "--", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    bystander.wait(timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    kinds = {row["kind"]: row for row in report["kinds"]}
    assert kinds["python burner.py"]["processes"] == 1
    assert 0.7 <= kinds["python burner.py"]["cpu_s"] <= 1.3
    assert kinds["pytest"]["processes"] == 1
    assert report["cpu_s"] == pytest.approx(sum(row["cpu_s"] for row in report["kinds"]))
    assert report["pytest_exit_code"] == 0 and report["wall_s"] > 1
    assert "python burner.py" in result.stdout and "CPU s" in result.stdout
