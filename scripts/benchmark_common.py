"""What every benchmark shares: its two standard flags, its table, the machine it ran on, CPU time and
its JSON report.

A benchmark is scripts/bench_NAME.py: it prints a table, writes its figures as JSON to --out (default
bench-results/NAME.json) and takes --quick for a run under a minute on 2 CPU cores. A script run as
`python scripts/bench_NAME.py` has this folder on its path, so it imports this module as
`import benchmark_common`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"
# The harness sessions scripts/record_session.py recorded from the real CLIs, one file per CLI.
RECORDED_SESSIONS = ROOT / "tests" / "fixtures" / "sessions"
# Qwen3 decoder shapes the GPU benches build with random weights; each bench sets its vocabulary.
QWEN3_SHAPES = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
}
# What a model folder needs of a tokenizer's files, copied beside random weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def parser(doc: str, quick: str, out: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: described by the first paragraph of its docstring `doc`, with
    --quick (`quick` says what it leaves out) and --out (`out` names the default file under
    bench-results/, the one the script gives write_json)."""
    result = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    result.add_argument("--quick", action="store_true", help=quick)
    result.add_argument("--out", type=Path, help=f"where the JSON report goes (default: bench-results/{out})")
    return result


def write_json(report: dict, out: Path | None, default: str) -> Path:
    """Write `report` as JSON to `out`, or to bench-results/`default`, and say where. A figure that could
    not be measured (NaN, infinite) is written as null: JSON has no such numbers."""
    path = Path(out) if out else RESULTS / default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def table_row(cells: Sequence[str], widths: Sequence[int], left: int = 1) -> str:
    """One line of a table: the cells two spaces apart, each padded to its width; the first `left`
    left-aligned (names), the others right-aligned (figures)."""
    padded = [cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
    return "  ".join(padded).rstrip()


def print_table(header: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1, indent: str = "") -> None:
    """A table whose columns are as wide as their widest cell, the header's included (see table_row)."""
    lines = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(indent + table_row(line, widths, left))


def machine(*packages: str, device: str = "cpu") -> dict:
    """Where the figures were measured: the CPU's model, the cores this process may run on, the GPU's
    name when `device` is a CUDA device ("" otherwise), and the versions of Python and of `packages`
    (as installed: nothing is imported for it)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = names[0] if names else cpu
    gpu = ""
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device))
    facts = {"cpu": cpu, "cpu_cores": len(os.sched_getaffinity(0)), "gpu": gpu, "python": platform.python_version()}
    return facts | {package: metadata.version(package) for package in packages}


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User and system CPU seconds of process `pid` so far, every thread it ran included (fields 14 and
    15 of /proc/PID/stat, in clock ticks of 10 ms); `children`: those of its children it has waited for
    (fields 16 and 17) instead."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    first = 13 if children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> float:
    """The process's time on a CPU so far, its threads' together, in nanoseconds from each thread's
    /proc/PID/task/TID/schedstat: for windows of a fraction of a second, where clock ticks are too
    coarse. A thread that has ended no longer counts: for processes whose threads live as long as they
    do (a server's). cpu_seconds where the kernel keeps no schedstats."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (FileNotFoundError, ProcessLookupError):  # no schedstats, or a thread ended while read
        return cpu_seconds(pid)
