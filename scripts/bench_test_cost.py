"""Where a test run's CPU time goes: pytest runs while every process's CPU time is read from /proc,
and pytest's process and its descendants are summed by kind (test processes, each `polar serve`
service, the Megatron test ranks, the harness sandbox, the CLIs, ...).

The default test run is CPU-bound on 2 cores: only less CPU makes it shorter, and this says where
the CPU goes. A process is sampled every --interval seconds until it ends, so one that lives
shorter than that is missed (the sandbox's processes and the test agents partly are), and so are
the children of a parent that was never seen.

    python scripts/bench_test_cost.py --quick                  # the multi-rank constrained Megatron tests
    python scripts/bench_test_cost.py                          # the default test run, -n 4
    python scripts/bench_test_cost.py -- tests/integration/test_train.py -x
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import benchmark_common

QUICK_TESTS = ["tests/integration/test_constrained_megatron.py"]
DEFAULT_RUN = ["-n", "4"]
SANDBOX_FILES = ("sandbox.py", "sandbox_init.py")
CLIS = {"pi", "qwen", "gemini", "codex", "claude"}


def process_kind(argv: list[str]) -> str:
    """What a process is, from its command line: "pytest worker", "polar serve inference",
    "polar train", "multiprocessing child" (the Megatron tests' ranks), "sandbox", "envoy",
    "cli pi", "python agent.py", ..."""
    if not argv:
        return "(no command line)"
    program = Path(argv[0]).name
    if program.startswith("python"):
        rest = argv[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
        if rest[:1] == ["-c"]:
            code = " ".join(rest[1:2])
            if "exec(eval(sys.stdin.readline()))" in code:  # pytest-xdist's workers, through execnet
                return "pytest worker"
            return "multiprocessing child" if "multiprocessing" in code else "python -c"
        if rest[:1] == ["-m"]:
            return _named(rest[1:]) if rest[1:2] in (["polar"], ["pytest"]) else " ".join(["python -m", *rest[1:2]])
        if rest and Path(rest[0]).name in ("polar", "pytest"):  # a console script, run by its shebang
            return _named([Path(rest[0]).name, *rest[1:]])
        if rest and Path(rest[0]).name in SANDBOX_FILES:
            return "sandbox"
        return f"python {Path(rest[0]).name}" if rest else "python"
    if program in ("polar", "pytest"):
        return _named([program, *argv[1:]])
    if program == "node":
        script = next((a for a in argv[1:] if not a.startswith("-")), "")
        return f"cli {Path(script).name}" if Path(script).name in CLIS else f"node {Path(script).name}".rstrip()
    if program in CLIS:
        return f"cli {program}"
    return program


def _named(argv: list[str]) -> str:
    """ "polar serve NAME", "polar COMMAND" or "pytest" from [name, arguments...]."""
    if argv[0] != "polar":
        return argv[0]
    return " ".join(argv[:3] if argv[1:2] == ["serve"] else argv[:2])


class Sampler:
    """Reads every process's CPU time from /proc every `interval` seconds, on a thread, until stopped:
    the command line, parent and last CPU figure seen of each process that started after it did."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        # (pid, start time): argv, parent pid, CPU s
        self.seen: dict[tuple[int, int], tuple[list[str], int, float]] = {}
        self._before = set(self._processes())
        self._stop = threading.Event()
        self._busy: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _processes() -> dict[tuple[int, int], tuple[int, float]]:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended while read
                continue
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            found[(int(entry), int(fields[19]))] = (int(fields[1]), cpu)
        return found

    @staticmethod
    def _idle_and_total() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return values[3] + values[4], sum(values)

    def _run(self) -> None:
        idle, total = self._idle_and_total()
        while not self._stop.wait(self.interval):
            for key, (parent, cpu) in self._processes().items():
                if key in self._before:
                    continue
                if key not in self.seen:
                    try:
                        raw = Path(f"/proc/{key[0]}/cmdline").read_bytes()
                    except OSError:
                        continue
                    self.seen[key] = ([a.decode(errors="replace") for a in raw.split(b"\0") if a], parent, cpu)
                else:
                    self.seen[key] = (*self.seen[key][:2], cpu)
            now_idle, now_total = self._idle_and_total()
            if now_total > total:
                self._busy.append(1 - (now_idle - idle) / (now_total - total))
            idle, total = now_idle, now_total

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def busy_fraction(self) -> float:
        return sum(self._busy) / len(self._busy) if self._busy else float("nan")


def descendants(seen: dict[tuple[int, int], tuple[list[str], int, float]], root: int) -> list[tuple[list[str], float]]:
    """The command line and CPU seconds of `root` and of every process seen below it."""
    children: dict[int, list[tuple[int, int]]] = {}
    for key, (_, parent, _) in seen.items():
        children.setdefault(parent, []).append(key)
    keys = [key for key in seen if key[0] == root]
    found = []
    while keys:
        key = keys.pop()
        argv, _, cpu = seen[key]
        found.append((argv, cpu))
        keys.extend(children.get(key[0], []))
    return found


def by_kind(processes: list[tuple[list[str], float]]) -> list[dict]:
    """CPU seconds and process counts per kind, the largest first."""
    kinds: dict[str, dict] = {}
    for argv, cpu in processes:
        kind = process_kind(argv)
        row = kinds.setdefault(kind, {"kind": kind, "cpu_s": 0.0, "processes": 0})
        row["cpu_s"] += cpu
        row["processes"] += 1
    return sorted(kinds.values(), key=lambda row: -row["cpu_s"])


def main() -> int:
    parser = benchmark_common.parser(__doc__, f"run {' '.join(QUICK_TESTS)} only, under a minute", "test_cost.json")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between two readings of /proc")
    parser.add_argument("--rows", type=int, default=25, help="kinds of process the table shows")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments instead")
    args = parser.parse_args()
    pytest_args = [a for a in args.pytest_args if a != "--"] or (QUICK_TESTS if args.quick else DEFAULT_RUN)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *pytest_args]
    sampler = Sampler(args.interval)
    sampler.start()
    started = time.monotonic()
    pytest = subprocess.Popen(command, cwd=benchmark_common.ROOT)
    code = pytest.wait()
    wall = time.monotonic() - started
    sampler.stop()
    kinds = by_kind(descendants(sampler.seen, pytest.pid))
    cpu = sum(row["cpu_s"] for row in kinds)
    cores = len(os.sched_getaffinity(0))
    print(
        f"\npytest exit code {code}: {wall:.0f} s of wall clock, {cpu:.0f} s of CPU in it and its descendants "
        f"({cores} cores: {cores * wall:.0f} core-seconds, busy {sampler.busy_fraction:.1%})"
    )
    rows = [(r["kind"], f"{r['cpu_s']:.1f}", str(r["processes"]), f"{r['cpu_s'] / r['processes']:.2f}") for r in kinds]
    benchmark_common.print_table(("process", "CPU s", "processes", "CPU s each"), rows[: args.rows], indent="  ")
    report = {
        "settings": {"pytest_args": pytest_args, "interval_s": args.interval, "quick": args.quick},
        "machine": benchmark_common.machine("torch", "pytest"),
        "pytest_exit_code": code,
        "wall_s": wall,
        "cpu_s": cpu,
        "busy_fraction": sampler.busy_fraction,
        "kinds": kinds,
    }
    benchmark_common.write_json(report, args.out, "test_cost.json")
    return code


if __name__ == "__main__":
    sys.exit(main())
