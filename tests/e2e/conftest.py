"""Fixtures the end-to-end tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.agent_clis import installed_clis


@pytest.fixture(scope="module")
def harness_bin() -> Path:
    """The folder holding every harness preset's CLI, installed on first use; skips without Node.js."""
    return installed_clis()
