"""The contracts: committed stubs match protos/ (and the check can tell when they do not), and the
protos pass buf lint (STANDARD + COMMENTS, protos/buf.yaml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF_DIR = ROOT / "tests" / "buf"  # package.json + package-lock.json pinning @bufbuild/buf
BUF = BUF_DIR / "node_modules" / ".bin" / "buf"


def _gen_protos_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_stubs_match_protos():
    result = _gen_protos_check(ROOT)
    assert result.returncode == 0, result.stderr


def test_drift_check_fails_when_a_proto_changes(tmp_path):
    # A copy of just what the generator reads and compares, with one field added to a proto.
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(ROOT / "polar" / "v1", tmp_path / "polar" / "v1", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gen_protos.py", tmp_path / "scripts")
    assert _gen_protos_check(tmp_path).returncode == 0, "the unchanged copy must pass"

    proto = tmp_path / "protos" / "polar" / "v1" / "inference.proto"
    text = proto.read_text()
    marker = "message PauseRequest {}"
    assert marker in text
    proto.write_text(text.replace(marker, "message PauseRequest {\n  // Added.\n  bool drift = 1;\n}"))

    result = _gen_protos_check(tmp_path)
    assert result.returncode == 1
    assert "inference_pb2.py" in result.stderr


@pytest.mark.node
def test_buf_lint():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("buf lint needs Node.js and npm")
    if not BUF.exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=BUF_DIR,
            check=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
    result = subprocess.run([str(BUF), "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
