"""The example agent (examples/agent/agent.py) bent into the faults a real harness shows, for the rollout tests.

    python -m tests.helpers.faulty_harness MODE    (tests.helpers.harness_programs gives the command)

It reads the environment a node gives every harness (OPENAI_BASE_URL, OPENAI_API_KEY, POLAR_MODEL,
POLAR_INSTRUCTION) and talks OpenAI Chat Completions through the example agent's `chat` and
`take_reply`. MODE:

    normal   the example agent's loop: carry out each tool call, stop at the first plain answer
    crash    one call, then exit 3
    hang     one call, then start a background child and sleep until killed
    silent   exit 0 without calling the model
    flood    write 20 MB to stdout, then the normal loop
    slow     the normal loop, pausing POLAR_TEST_PAUSE seconds (default 2) between calls
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers.example_modules import example_module

agent = example_module("agent/agent.py")


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
        message = agent.chat(messages)
        if mode == "crash":
            print("harness: giving up", file=sys.stderr)
            return 3
        if mode == "hang":
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            time.sleep(600)
        answer = agent.take_reply(messages, message)
        if answer is not None:
            print(answer)
            return 0
        if mode == "slow":
            time.sleep(float(os.environ.get("POLAR_TEST_PAUSE", "2")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "normal"))
