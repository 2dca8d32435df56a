"""scripts/bench_loop.py --device cpu --quick: the whole loop's benchmark stays runnable off the GPU.

Three `polar train` runs of one step each (per_request, prefix_merging, prefix_merging with
shared-prefix packing) over a group of two Pi-shaped replayed sessions on the tiny model; the JSON holds every mode
with its wall clock and busy fractions (null without a GPU), and a merged session's trace holds about
half the tokens of its traces per call, whose second call repeats the first. A layout that puts one
service on the CPU and the other on a GPU, or a device it cannot read, is refused saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# Three `polar train` runs: about 55 s on 2 idle cores, past the default 300 s on a loaded machine. One
# step each: every figure the JSON holds is there after one (a second step cost each run about 4 s of
# CPU and checked nothing more).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_quick_loop_benchmark_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench_loop.py",
            "--device",
            "cpu",
            "--quick",
            "--steps",
            "1",
            "--group-size",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["per_request", "prefix_merging", "prefix_merging+packing"]
    for mode in modes.values():
        assert mode["wall_s"] > 0 and [step["step"] for step in mode["steps"]] == [1]
        assert mode["tokens_generated"] > 0 and mode["tokens_trained"] > 0
        assert mode["train_s"] > 0 and mode["rollout_wait_s"] >= 0 and mode["weight_sync_s"] > 0
        for key in ("gpu_busy_fraction", "inference_busy_fraction", "trainer_busy_fraction"):
            assert key in mode and mode[key] is None  # no GPU here
        assert mode["gpus"] == {}
    assert report["settings"]["layout"] == "cpu" and report["settings"]["trainer_device"] == "cpu"
    assert report["machine"]["devices"] == {"inference": "cpu", "trainer": "cpu"}

    # Two calls a Pi session: one trace per call holds the first call's prompt and reply twice, the
    # merged trace once.
    def tokens_per_session(mode: dict) -> list[float]:
        return [step["trace_tokens"] / step["sessions"] for step in mode["steps"]]

    assert min(tokens_per_session(modes["per_request"])) > 1.5 * max(tokens_per_session(modes["prefix_merging"]))
    assert report["ratios_to_prefix_merging"]["prefix_merging"] == 1.0
    assert "per_request" in result.stdout and "wall s" in result.stdout


@pytest.mark.parametrize(
    ("devices", "said"),
    [
        (["--device", "cpu", "--trainer-device", "cuda:1"], "--device and --trainer-device: both cpu, or both CUDA"),
        (
            ["--device", "cuda:0", "--trainer-device", "gpu1"],
            "argument --trainer-device: 'gpu1' is not cpu, cuda or cuda:N",
        ),
    ],
)
def test_a_layout_it_cannot_run_is_refused_saying_why(devices: list[str], said: str) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/bench_loop.py", *devices], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr
