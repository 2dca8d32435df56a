"""A minimal agent harness for the rollout tests: the standard library only, OpenAI Chat Completions.

    python rollout_harness.py MODE

It reads the environment a node gives every harness (OPENAI_BASE_URL, OPENAI_API_KEY, POLAR_MODEL,
POLAR_INSTRUCTION), offers the model a `write_file` tool, carries out each call the model makes in
its working directory, and stops at the first answer without a tool call. MODE bends it into the
faults a real harness shows:

    normal   the loop above
    crash    one call, then exit 3
    hang     one call, then start a background child and sleep until killed
    silent   exit 0 without calling the model
    flood    write 20 MB to stdout, then the normal loop
    slow     the normal loop, pausing POLAR_TEST_PAUSE seconds (default 2) between calls
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file in the working directory.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    }
]


def chat(messages: list[dict]) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": os.environ["POLAR_MODEL"], "messages": messages, "tools": TOOLS}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["choices"][0]["message"]


def main(mode: str) -> int:
    if mode == "silent":
        return 0
    if mode == "flood":
        chunk = b"x" * 65536 + b"\n"
        for _ in range(320):
            sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
    messages = [{"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}]
    while True:
        message = chat(messages)
        if mode == "crash":
            print("harness: giving up", file=sys.stderr)
            return 3
        if mode == "hang":
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            time.sleep(600)
        messages.append({k: v for k, v in message.items() if v is not None})
        if not message.get("tool_calls"):
            print(message.get("content") or "")
            return 0
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            with open(arguments["path"], "w") as f:
                f.write(arguments["content"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "written"})
        if mode == "slow":
            time.sleep(float(os.environ.get("POLAR_TEST_PAUSE", "2")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "normal"))
