"""Write the task set of the training example: tasks-train.jsonl and tasks-heldout.jsonl, next to this file.

    python3 examples/train/make_tasks.py

Each task asks the model to "Say the word W and nothing else." (one common English noun W); the harness
(agent.py, one OpenAI Chat Completions call) writes the reply to answer.txt and the evaluator
(check.py W) gives reward 1 when the reply holds W as a whole word, in any letter case, else 0.

Why this task: it has a real, checkable reward on which SmolLM2-135M-Instruct starts in the useful
range. Sampled at temperature 1.0 with a 16-token cap, about 30% of its replies hold the word (32% on
the training words, 17% on the held-out ones; at temperature 0, 97%), so most groups of 8 samples
have both rewards and GRPO has a signal from the first step; stricter checks (the reply is exactly the word, or an exact
arithmetic answer) start near 0 on this model, which leaves GRPO nothing to learn from.

The words are split at random (seeded, so reruns write the same files) into a training set and a
disjoint held-out set. Each task runs a group of GROUP_SIZE sessions at temperature TEMPERATURE with at
most MAX_TOKENS_PER_CALL sampled tokens per call.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 11
GROUP_SIZE = 8
TEMPERATURE = 1.0
MAX_TOKENS_PER_CALL = 16
HELD_OUT = 24
FOLDER = Path(__file__).resolve().parent
TEMPLATE = "examples/train"  # the node's path of this folder, relative to the repository root

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
    "hammer",
    "jacket",
    "kitten",
    "ladder",
    "market",
    "mirror",
    "orange",
    "pepper",
    "pillow",
    "planet",
    "rocket",
    "silver",
    "spider",
    "summer",
    "ticket",
    "tomato",
    "tunnel",
    "turtle",
    "valley",
    "wallet",
    "winter",
    "yellow",
    "basket",
    "butter",
    "castle",
    "cookie",
    "cotton",
    "desert",
    "engine",
    "farmer",
    "finger",
    "guitar",
    "helmet",
    "insect",
    "jungle",
    "kettle",
    "letter",
    "marble",
    "needle",
    "parrot",
    "pocket",
    "puzzle",
    "saddle",
    "shadow",
    "blanket",
    "chicken",
    "diamond",
    "feather",
    "giraffe",
    "library",
    "monster",
    "morning",
    "popcorn",
    "rainbow",
]

HEADER = """\
# The training example's {split} tasks, written by examples/train/make_tasks.py (edit that, not this).
# Run from the repository root: the template examples/train is the node's path. Each task asks the model
# to say one word; agent.py (one OpenAI Chat Completions call, no max_tokens) writes the reply to
# answer.txt and `python3 check.py WORD` rewards 1 when the reply holds the word, else 0. Sampling is
# the task's: temperature {temperature}, at most {cap} tokens per call, groups of {group}.
"""


def task(word: str, split: str) -> dict:
    return {
        "instruction": f"Say the word {word} and nothing else.",
        "groupSize": GROUP_SIZE,
        "harness": {"preset": "command", "command": ["python3", "agent.py"]},
        "runtime": {"kind": "local", "template": TEMPLATE},
        "evaluator": {"kind": "command", "command": f"python3 check.py {word}"},
        "timeoutSeconds": 120,
        "sampling": {"temperature": TEMPERATURE, "maxTokensPerCall": MAX_TOKENS_PER_CALL},
        "metadata": {"example": "say-word", "split": split, "word": word},
    }


def write(path: Path, split: str, words: list[str]) -> None:
    header = HEADER.format(split=split, temperature=TEMPERATURE, cap=MAX_TOKENS_PER_CALL, group=GROUP_SIZE)
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
