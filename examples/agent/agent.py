"""A small agent for the example tasks: Python's standard library only, OpenAI Chat Completions.

    python3 agent.py

A node runs it as the harness of preset "command", in the session's workspace (a copy of this folder),
with the environment every harness gets: OPENAI_BASE_URL and OPENAI_API_KEY (the gateway, through
Envoy, and the session's key), POLAR_MODEL and POLAR_INSTRUCTION. It offers the model two tools,
`write_file` and `read_file`, carries out each call in the workspace, and stops at the first answer
without a tool call or after MAX_TURNS calls. The evaluator of each task then checks the workspace.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

MAX_TURNS = 4
# A busy proxy or server answers 429, 502, 503 or 504 for a moment: the call is tried again after 1 s
# and 2 s, as the official SDKs do, before the agent gives up.
RETRIED_STATUSES = (429, 502, 503, 504)
RETRY_DELAYS_S = (1.0, 2.0)
# Each answer is short; a bound also keeps a small model on a CPU from writing until its context is full.
MAX_TOKENS = 128
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file in the working directory, replacing what it held.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file in the working directory.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]


def chat(messages: list[dict]) -> dict:
    """One model call; returns the assistant message."""
    body = {"model": os.environ["POLAR_MODEL"], "messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    for delay in RETRY_DELAYS_S:
        try:
            return _reply(request)
        except urllib.error.HTTPError as error:
            if error.code not in RETRIED_STATUSES:
                raise
        time.sleep(delay)
    return _reply(request)


def _reply(request: urllib.request.Request) -> dict:
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]


def run_tool(name: str, arguments: str) -> str:
    """Carry out one tool call; a malformed call gets an error the model can read, not a crash."""
    try:
        args = json.loads(arguments)
        path = Path(args["path"])
        if path.is_absolute() or ".." in path.parts:
            return "error: paths must stay inside the working directory"
        if name == "write_file":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(args["content"]))
            return f"wrote {path}"
        if name == "read_file":
            return path.read_text()
        return f"error: no tool named {name!r}"
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return f"error: {exc}"


def take_reply(messages: list[dict], message: dict) -> str | None:
    """Add the model's reply to the conversation and, when it calls tools, carry them out and add
    their results; the answer when it calls none, else None (the model is called again)."""
    messages.append({key: value for key, value in message.items() if value is not None})
    if not message.get("tool_calls"):
        return message.get("content") or ""
    for call in message["tool_calls"]:
        result = run_tool(call["function"]["name"], call["function"]["arguments"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None


def main() -> int:
    messages = [{"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}]
    for _ in range(MAX_TURNS):
        try:
            message = chat(messages)
        except (urllib.error.URLError, OSError) as exc:
            print(f"agent: the model call failed: {exc}", file=sys.stderr)
            return 1
        answer = take_reply(messages, message)
        if answer is not None:
            print(answer)
            return 0
    print(f"agent: stopped after {MAX_TURNS} model calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
