"""The tools every SDK harness here offers its model, and how they run (in the harness's cwd).

Each harness program (openai_chat.py, openai_responses.py, anthropic_messages.py, google_genai.py) is
a minimal agent on one official SDK: it reads the instruction from POLAR_INSTRUCTION and the model,
base URL and key from the variables the harness preset environment sets, calls the model, runs each
tool call it gets, sends the result back, and stops at the first answer without tool calls (printed
on stdout). Run them with the "command" preset, e.g. `python tests/e2e/sdk_harnesses/openai_chat.py`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

MAX_TURNS = 8  # model calls before a harness gives up (exit 1)
SHELL_TIMEOUT_S = 60

TOOLS = [
    {
        "name": "write_file",
        "description": "Write text to a file (relative to the working directory), replacing it if it exists.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "File path, relative to the working directory."},
                "content": {"type": "string", "description": "The file's new content."},
            },
            "required": ["path", "content"],
        },
    },
    {
        "name": "run_shell",
        "description": "Run a shell command in the working directory; returns its exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command, run with sh -c."}},
            "required": ["command"],
        },
    },
]


def instruction() -> str:
    return os.environ["POLAR_INSTRUCTION"]


def model() -> str:
    return os.environ["POLAR_MODEL"]


def run_tool(name: str, arguments: dict) -> str:
    """Carry out one tool call; a failure is reported to the model as the result, not raised."""
    try:
        if name == "write_file":
            path = Path(arguments["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(arguments["content"])
            return f"wrote {len(arguments['content'])} characters to {arguments['path']}"
        if name == "run_shell":
            done = subprocess.run(
                ["sh", "-c", arguments["command"]],
                check=False,  # the exit code is part of the result
                capture_output=True,
                text=True,
                timeout=SHELL_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            return f"exit code {done.returncode}\n{done.stdout}{done.stderr}"
        return f"error: unknown tool {name!r}"
    except (KeyError, TypeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {type(exc).__name__}: {exc}"
