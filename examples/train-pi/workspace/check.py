"""The evaluator of the Pi example, run in the session's workspace after Pi exits:

    python3 check.py WORD

It reads files, never Pi's reply: reward 1 when answer.txt holds WORD as a whole word (any letter
case); 0.5 when Pi wrote some file (answer.txt without the word, or another file), so a tool call
that ran counts for something; 0 when the workspace holds nothing but this file. The reward is the
last line printed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ANSWER = "answer.txt"
HIDDEN = (".pi", ".git")  # folders a harness may keep in a workspace: not the model's output


def written_files(workspace: Path) -> list[Path]:
    """Files in the workspace other than this evaluator and harness folders."""
    own = Path(__file__).name
    return [
        path
        for path in workspace.rglob("*")
        if path.is_file() and path.name != own and not set(path.relative_to(workspace).parts) & set(HIDDEN)
    ]


def reward(workspace: Path, word: str) -> float:
    answer = workspace / ANSWER
    if answer.is_file():
        text = answer.read_text(errors="replace")
        if re.search(r"\b" + re.escape(word) + r"\b", text, re.IGNORECASE):
            return 1.0
    return 0.5 if written_files(workspace) else 0.0


def main() -> int:
    workspace = Path.cwd()
    for path in written_files(workspace):
        print(f"{path.relative_to(workspace)}: {path.read_text(errors='replace')[:200]!r}")
    print(reward(workspace, sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
