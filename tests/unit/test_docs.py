"""The manual stays true: every `polar ...` command that README.md and docs/ show exists (its `--help`
runs through the real command line), every relative link leads to a file (and a heading, when it names
one), and README.md stays a front page."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from polar.app.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

# Words that group subcommands (`polar serve inference`): the command is two words long after them.
GROUPS = {command.words[0] for command in COMMANDS if len(command.words) > 1}
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`]+)`")
# `polar` as a command (`polar up`, `.venv/bin/polar up`, `python -m polar up`), then its words.
POLAR_COMMAND = re.compile(r"(?:^|[\s/(])polar[ \t]+([a-z][a-z-]*)(?:[ \t]+([a-z][a-z-]*))?", re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _code(text: str) -> list[str]:
    """The code a page shows: its fenced blocks, then its inline spans outside them."""
    blocks = FENCE.findall(text)
    return blocks + INLINE_CODE.findall(FENCE.sub("", text))


def commands_shown(text: str) -> set[tuple[str, ...]]:
    """The `polar` subcommands a page's code shows, as their words (`("serve", "inference")`)."""
    found = set()
    for code in _code(text):
        for first, second in POLAR_COMMAND.findall(code):
            found.add((first, second) if first in GROUPS and second else (first,))
    return found


def missing_commands(commands: set[tuple[str, ...]]) -> list[str]:
    """Each command whose `polar WORDS --help` does not exit 0 through the real command line."""
    missing = []
    for words in sorted(commands):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([*words, "--help"])
                code = 0
            except SystemExit as exc:
                code = exc.code
        if code != 0:
            missing.append(f"polar {' '.join(words)}: exit {code}: {err.getvalue().strip()}")
    return missing


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _name(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def broken_links(page: Path, text: str) -> list[str]:
    """Each relative link of a page that names no file, or a heading its target does not have."""
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{_name(page)}: {target}: no such file")
        elif anchor and destination.suffix == ".md":
            anchors = {_anchor(h) for h in HEADING.findall(FENCE.sub("", destination.read_text()))}
            if anchor not in anchors:
                broken.append(f"{_name(page)}: {target}: no heading #{anchor}")
    return broken


def test_every_command_shown_exists():
    shown = set().union(*(commands_shown(page.read_text()) for page in _pages()))
    assert ("train",) in shown and ("serve", "inference") in shown, "the pages' commands were not found"
    missing = missing_commands(shown)
    assert not missing, "commands the manual shows that polar lacks:\n" + "\n".join(missing)


def test_every_relative_link_leads_somewhere():
    broken = [problem for page in _pages() for problem in broken_links(page, page.read_text())]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; its manual belongs in docs/"


def test_a_wrong_command_or_link_is_found(tmp_path):
    """The checks themselves: a command polar lacks and a link to nothing are reported, true ones are not."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A heading\n")
    text = (
        "Run `polar bogus --fast`, then:\n\n```sh\n.venv/bin/polar serve nothing --port 1\n"
        "python -m polar up --config stack.toml   # polar status too\n```\n\n"
        "[ok](other.md#a-heading) [gone](missing.md) [no heading](other.md#nowhere) [web](https://example.org)\n"
    )
    page.write_text(text)
    shown = commands_shown(text)
    assert shown == {("bogus",), ("serve", "nothing"), ("up",), ("status",)}
    assert [problem.split(":")[0] for problem in missing_commands(shown)] == ["polar bogus", "polar serve nothing"]
    assert broken_links(page, text) == [
        f"{page}: missing.md: no such file",
        f"{page}: other.md#nowhere: no heading #nowhere",
    ]
