"""The harness of the training example: Python's standard library only, one OpenAI Chat Completions call.

    python3 agent.py

A node runs it as the harness of preset "command", in the session's workspace (a copy of this folder),
with OPENAI_BASE_URL and OPENAI_API_KEY (the gateway and the session's key), POLAR_MODEL and
POLAR_INSTRUCTION. It sends the instruction as a single user message, with no tools and no max_tokens
(the task's sampling policy caps the reply), writes the reply's text to answer.txt and exits 0. A call
that fails prints an error and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path


def main() -> int:
    body = {
        "model": os.environ["POLAR_MODEL"],
        "messages": [{"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}],
    }
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.load(response)["choices"][0]["message"].get("content") or ""
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        print(f"agent: the model call failed: {exc}", file=sys.stderr)
        return 1
    Path("answer.txt").write_text(reply)
    print(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
