"""The agent CLIs behind the harness presets, pinned in tests/e2e/harness_install/ and installed there on first use.

    bin_dir = installed_clis()   # harness_install/node_modules/.bin, after `npm ci` if needed

Tests that run a CLI call this from a fixture; without node and npm they are skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

INSTALL_DIR = Path(__file__).resolve().parents[1] / "e2e" / "harness_install"
BIN_DIR = INSTALL_DIR / "node_modules" / ".bin"
PROGRAMS = ("codex", "claude", "qwen", "gemini", "pi")  # what the presets run
NPM_CI_TIMEOUT_S = 600


def installed_clis() -> Path:
    """The folder holding every preset's CLI (harness_install's node_modules/.bin), installing the
    pinned versions with `npm ci` when one is missing; skips the test without node and npm."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("the harness CLIs need node and npm on PATH")
    if not all((BIN_DIR / program).exists() for program in PROGRAMS):
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=INSTALL_DIR,
            check=True,
            timeout=NPM_CI_TIMEOUT_S,
        )
    return BIN_DIR
