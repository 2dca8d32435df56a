"""The container tier's view of the Docker engine: Polar's containers on it, and a docker client that
logs when each `docker run` starts and ends (to measure how many start at once)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

from polar.app.node.runtimes.docker import OWNER_LABEL, owner_runs


def polar_containers() -> list[str]:
    """Polar's containers that this test run made: those whose owner (the node that made them) is
    this process or one of its descendants, or no longer runs (a node a test killed). Containers of
    nodes that other programs on the machine run are not the tests' to count or remove."""
    columns = f'{{{{.Names}}}}\t{{{{.Label "{OWNER_LABEL}"}}}}'
    listing = ["docker", "ps", "--all", "--filter", f"label={OWNER_LABEL}", "--format", columns]
    lines = subprocess.run(listing, capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split("\t") + [""] for line in lines]
    return [name for name, owner, *_ in rows if not owner_runs(owner) or _descends_from_us(owner)]


def _descends_from_us(owner: str) -> bool:
    """Whether the process an owner label names is this one or a descendant of it."""
    pid = int(owner.split(":")[1])
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # its parent
    return False


def logging_docker(tmp_path: Path) -> tuple[Path, Path]:
    """A docker client that appends "start T" and "end T" around each `docker run` to a log."""
    log = tmp_path / "runs.log"
    client = tmp_path / "docker"
    real = subprocess.run(["sh", "-c", "command -v docker"], capture_output=True, text=True).stdout.strip()
    client.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = run ]; then
          echo "start $(date +%s.%N)" >> {log}
          {real} "$@"; code=$?
          echo "end $(date +%s.%N)" >> {log}
          exit $code
        fi
        exec {real} "$@"
        """)
    )
    client.chmod(0o755)
    return client, log


def most_at_once(log: Path) -> int:
    """The most `docker run`s in flight at one time (an end sorts before a start at the same time)."""
    lines = [line.split() for line in log.read_text().splitlines()]
    now = peak = 0
    for _, starting in sorted((float(stamp), kind == "start") for kind, stamp in lines):
        now += 1 if starting else -1
        peak = max(peak, now)
    return peak
