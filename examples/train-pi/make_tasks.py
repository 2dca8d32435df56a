"""Write the Pi example's task sets: tasks-train.jsonl and tasks-heldout.jsonl, next to this file.

    python3 examples/train-pi/make_tasks.py

Each task asks Pi (the unmodified CLI, in its default Chat Completions dialect) to save one word in
answer.txt with its write tool, and shows the tool call to reply with. The workspace is a copy of
workspace/: the evaluator (check.py WORD) and Pi's project system prompt, .pi/SYSTEM.md, which Pi reads
from the folder it runs in instead of its own. The reward is read from the files, never from Pi's
reply: 1 when answer.txt holds the word, 0.5 when a tool call wrote some other file, 0 when nothing
was written.

Why this task (SmolLM2-135M-Instruct through Pi, counted from the sessions' files): with Pi's own
1.5k-token system prompt the model never called a tool, not even when the instruction spelled out the
exact call (0 of 2 greedy, 0 of 8 sampled at temperature 1.0), nor when it gave the call's format
(0 of 2, 0 of 16); asked only to "create a file named answer.txt that contains the word W", 0 of 8 and
0 of 32. Every reward 0 leaves GRPO nothing to learn from. Pi's project system prompt of five lines,
showing one tool call, and the call in the instruction, sampled at temperature 0.7 (at 1.0 the
model's text was incoherent and wrote nothing: 0 of 16), are what bring its first tool calls into
reach: a few sessions of a group write the file, most print text.

The words are split at random (seeded, so reruns write the same files) into a training set and a
disjoint held-out set. Each task runs a group of GROUP_SIZE sessions at temperature TEMPERATURE, each
call capped at MAX_TOKENS_PER_CALL sampled tokens and each session at MAX_TOKENS_PER_SESSION (a model
that calls the tool again and again is cut off there; the files it wrote still count).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 7
GROUP_SIZE = 8
TEMPERATURE = 0.7
MAX_TOKENS_PER_CALL = 64
MAX_TOKENS_PER_SESSION = 192
HELD_OUT = 16
FOLDER = Path(__file__).resolve().parent
TEMPLATE = "examples/train-pi/workspace"  # the node's path of the workspace, relative to the repository root

WORDS = [
    "apple",
    "river",
    "stone",
    "green",
    "house",
    "table",
    "music",
    "light",
    "water",
    "plant",
    "cloud",
    "bread",
    "horse",
    "chair",
    "dream",
    "smile",
    "ocean",
    "tiger",
    "paper",
    "glass",
    "money",
    "night",
    "sugar",
    "train",
    "field",
    "heart",
    "mouse",
    "piano",
    "queen",
    "storm",
    "candy",
    "eagle",
    "fruit",
    "grape",
    "lemon",
    "melon",
    "onion",
    "peach",
    "robot",
    "snake",
    "sword",
    "tooth",
    "truck",
    "wheel",
    "zebra",
    "beach",
    "brush",
    "clock",
    "dance",
    "flame",
    "garden",
    "window",
    "pencil",
    "rabbit",
    "forest",
    "island",
    "bottle",
    "camera",
    "circle",
    "doctor",
    "dragon",
    "flower",
]

HEADER = """\
# The Pi example's {split} tasks, written by examples/train-pi/make_tasks.py (edit that, not this).
# Run from the repository root: the template examples/train-pi/workspace is the node's path. Each task
# asks Pi to save one word in answer.txt with its write tool; `python3 check.py WORD` rewards 1 when
# answer.txt holds the word, 0.5 when some other file was written, else 0. Sampling is the task's:
# temperature {temperature}, at most {cap} tokens per call and {budget} per session, groups of {group}.
"""


def instruction(word: str) -> str:
    call = json.dumps({"name": "write", "arguments": {"path": "answer.txt", "content": word}})
    return f"Save the word {word} in answer.txt. Reply with this tool call:\n<tool_call>\n{call}\n</tool_call>"


def task(word: str, split: str) -> dict:
    return {
        "instruction": instruction(word),
        "groupSize": GROUP_SIZE,
        "harness": {"preset": "pi"},
        "runtime": {"kind": "local", "template": TEMPLATE},
        "evaluator": {"kind": "command", "command": f"python3 check.py {word}"},
        "timeoutSeconds": 600,
        "sampling": {
            "temperature": TEMPERATURE,
            "maxTokensPerCall": MAX_TOKENS_PER_CALL,
            "maxTokensPerSession": str(MAX_TOKENS_PER_SESSION),
        },
        "metadata": {"example": "pi-write", "split": split, "word": word},
    }


def write(path: Path, split: str, words: list[str]) -> None:
    header = HEADER.format(
        split=split, temperature=TEMPERATURE, cap=MAX_TOKENS_PER_CALL, budget=MAX_TOKENS_PER_SESSION, group=GROUP_SIZE
    )
    lines = [json.dumps(task(word, split)) for word in words]
    path.write_text(header + "\n".join(lines) + "\n")


def main() -> None:
    words = sorted(set(WORDS))
    random.Random(SEED).shuffle(words)
    heldout, train = sorted(words[:HELD_OUT]), sorted(words[HELD_OUT:])
    assert not set(heldout) & set(train)
    write(FOLDER / "tasks-train.jsonl", "train", train)
    write(FOLDER / "tasks-heldout.jsonl", "held-out", heldout)


if __name__ == "__main__":
    main()
