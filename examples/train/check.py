"""The evaluator of the training example, run in the session's workspace:

    python3 check.py EXPECTED

Reward 1 when answer.txt (the model's reply) holds the word EXPECTED as a whole word, in any letter
case, else 0 (also when there is no answer.txt). The reward is the last line printed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def reward(reply: str, expected: str) -> int:
    return 1 if re.search(r"\b" + re.escape(expected) + r"\b", reply, re.IGNORECASE) else 0


def main() -> int:
    expected = sys.argv[1]
    try:
        reply = Path("answer.txt").read_text(errors="replace")
    except OSError:
        print("no answer.txt")
        print(0)
        return 0
    print(reward(reply, expected))
    return 0


if __name__ == "__main__":
    sys.exit(main())
