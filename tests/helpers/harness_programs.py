"""The commands that run this package's harness programs (faulty_harness, attacking_harness) as a
node runs any harness: in a session's workspace, so the repository is put on their PYTHONPATH."""

from __future__ import annotations

import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def harness_command(program: str, *arguments: str) -> list[str]:
    """The argv of tests.helpers.`program` with `arguments`: `env` sets PYTHONPATH and execs Python in
    its place, so the process a node starts, signals and kills is the harness's own."""
    return ["env", f"PYTHONPATH={REPOSITORY}", sys.executable, "-m", f"tests.helpers.{program}", *arguments]
