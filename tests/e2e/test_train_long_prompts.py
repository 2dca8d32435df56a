"""`polar train` through Codex, Claude Code, Qwen Code and Gemini CLI: test_train_harnesses.py's run over
their long prompts (9k to 21k tokens a call), with every check of that module on what the run left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_train_harnesses import RUN_TIMEOUT_S, check_training_run

pytestmark = [pytest.mark.slow, pytest.mark.node]


@pytest.mark.timeout(RUN_TIMEOUT_S["long-prompts"] + 120)
def test_polar_train_takes_steps_on_long_prompt_cli_sessions(harness_bin: Path, tmp_path: Path) -> None:
    check_training_run("long-prompts", harness_bin, tmp_path)
