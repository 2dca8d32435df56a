"""examples/swe-mini for the tests: some of its repositories built as git checkouts under a
temporary folder, and an instance file of just those."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.example_modules import EXAMPLES, example_module

SWE_MINI = EXAMPLES / "swe-mini"
INSTANCES = SWE_MINI / "instances.jsonl"
build = example_module("swe-mini/build.py")


def instances(names: list[str] | None = None) -> list[dict]:
    records = [json.loads(line) for line in INSTANCES.read_text().splitlines()]
    return [r for r in records if names is None or r["repo"].split("/", 1)[1] in names]


def prepare(root: Path, names: list[str] | None = None) -> tuple[Path, Path]:
    """(the repositories' folder, an instance file of those repositories) under root."""
    repos = root / "repos"
    build.build_all(repos, names)
    instance_file = root / "instances.jsonl"
    instance_file.write_text("".join(json.dumps(record) + "\n" for record in instances(names)))
    return repos, instance_file
