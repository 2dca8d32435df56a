"""Grading a SWE-style task from its test log: pure functions, no processes.

    files_in_patch(patch)                 the files a unified diff (git format) touches
    files_to_test(test_patch, ids)           what the test command runs: the test patch's files and the
                                          files named by the test ids
    parse_pytest_log(log)                 {test id: status} from pytest's `-rA` summary or `-v` lines
    grade(fail_to_pass, pass_to_pass, results)   the reward, the counts and why

A test id is what pytest prints for it: "tests/test_x.py::TestY::test_z[a b-1]". Parametrised ids
may hold spaces, brackets and " - "; a failure line is "FAILED <id> - <message>", so an id is read
up to the bracket that closes its parameters, never split at the first space.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS = "PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"
STATUSES = (PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS)
# Statuses a test "passes" with: SWE-bench counts an expected failure that failed as a pass.
PASSING = frozenset({PASSED, XFAIL})

_DIFF_HEADER = re.compile(r"^diff --git (\S+|\"(?:[^\"\\]|\\.)*\") (\S+|\"(?:[^\"\\]|\\.)*\")$")
_PLUS_HEADER = re.compile(r"^\+\+\+ (?:b/)?(.+?)\t?$")
# pytest's short summary ("-rA"): "PASSED id", "FAILED id - message", "ERROR id - message".
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")
# pytest -v: "id PASSED [ 50%]" (the percentage optional).
_VERBOSE_LINE = re.compile(r"^(.+?::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: +\[ *\d+%\])?$")
_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_SESSION_START = re.compile(r"^=+ test session starts =+$")


def files_in_patch(patch: str) -> list[str]:
    """Paths a git diff creates, changes or deletes (the new name of a rename and its old one), in
    order of first appearance. Quoted names (git's C-style quoting) are unquoted."""
    seen: dict[str, None] = {}
    for line in patch.splitlines():
        match = _DIFF_HEADER.match(line)
        if match is None:
            continue
        for name in match.groups():
            path = _unquote(name)
            if path.startswith(("a/", "b/")):
                path = path[2:]
            seen.setdefault(path, None)
    return list(seen)


def _unquote(name: str) -> str:
    if not (name.startswith('"') and name.endswith('"')):
        return name
    raw = name[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    return raw.encode("latin-1").decode("utf-8", "replace")


def files_to_test(test_patch: str, test_ids: Iterable[str]) -> list[str]:
    """The files the test command runs: those the test patch touches that look like tests (a
    `test` in the name), then each id's file (the part before "::"), each once, in order."""
    files: dict[str, None] = {}
    for path in files_in_patch(test_patch):
        name = path.rsplit("/", 1)[-1]
        if path.endswith(".py") and "test" in name:
            files.setdefault(path, None)
    for test_id in test_ids:
        path = test_id.split("::", 1)[0]
        if "::" in test_id and path.endswith(".py"):
            files.setdefault(path, None)
    return list(files)


def parse_pytest_log(log: str) -> dict[str, str]:
    """Per-test status from a pytest log: the lines of its last short test summary (`-rA`), and
    `-v` result lines before it. Only what follows the last "test session starts" counts, and a
    summary line is read only after the summary's header: output a test printed cannot add results
    once the summary began (it is printed before), and text before the session is not pytest's."""
    lines = log.splitlines()
    start = max((i for i, line in enumerate(lines) if _SESSION_START.match(line)), default=0)
    lines = lines[start:]
    summary = max((i for i, line in enumerate(lines) if _SUMMARY_HEADER.match(line)), default=len(lines))
    results: dict[str, str] = {}
    for line in lines[:summary]:
        match = _VERBOSE_LINE.match(line.rstrip())
        if match is not None:
            results[match.group(1)] = match.group(2)
    for line in lines[summary + 1 :]:
        match = _SUMMARY_LINE.match(line.rstrip())
        if match is None:
            continue
        status, rest = match.groups()
        test_id = _leading_test_id(rest)
        if test_id:
            results[test_id] = status
    return results


def _leading_test_id(text: str) -> str:
    """The test id that `text` starts with ("id" or "id - message"). An id's parameters ("[...]",
    which may hold spaces and " - ") end at the bracket that closes the first "[" after "::"."""
    separator = text.find("::")
    if separator < 0:
        return text.split(" - ", 1)[0].strip()
    bracket = text.find("[", separator)
    space = text.find(" ", separator)
    if bracket >= 0 and (space < 0 or bracket < space):
        depth = 0
        for index in range(bracket, len(text)):
            if text[index] == "[":
                depth += 1
            elif text[index] == "]":
                depth -= 1
                if depth == 0:
                    return text[: index + 1]
        return text.strip()  # unbalanced: the whole line
    return text if space < 0 else text[:space]


@dataclass(frozen=True)
class Grade:
    """A graded log: the reward (1.0 or 0.0), the counts, and in `reason` why it is not 1."""

    reward: float
    fail_to_pass_passed: int
    fail_to_pass_total: int
    pass_to_pass_passed: int
    pass_to_pass_total: int
    reason: str  # "" when the reward is 1
    failing: tuple[str, ...] = ()  # the listed tests that did not pass (failed, errored or missing)

    def counts(self) -> dict[str, str]:
        return {
            "fail_to_pass": f"{self.fail_to_pass_passed}/{self.fail_to_pass_total}",
            "pass_to_pass": f"{self.pass_to_pass_passed}/{self.pass_to_pass_total}",
        }


def grade(fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], results: Mapping[str, str]) -> Grade:
    """1.0 only when every fail_to_pass and every pass_to_pass test passed; a listed test absent
    from `results` did not pass. A log with no results at all is 0 with that reason."""
    f2p_passed = [test for test in fail_to_pass if results.get(test) in PASSING]
    p2p_passed = [test for test in pass_to_pass if results.get(test) in PASSING]
    failing = tuple(test for test in [*fail_to_pass, *pass_to_pass] if results.get(test) not in PASSING)
    counts = (len(f2p_passed), len(fail_to_pass), len(p2p_passed), len(pass_to_pass))
    if not results:
        return Grade(0.0, *counts, "the test log holds no test results", failing)
    if not fail_to_pass:
        return Grade(0.0, *counts, "the task lists no FAIL_TO_PASS test", failing)
    if not failing:
        return Grade(1.0, *counts, "")
    described = ", ".join(f"{test} ({results.get(test, 'missing')})" for test in failing[:5])
    more = f" and {len(failing) - 5} more" if len(failing) > 5 else ""
    return Grade(0.0, *counts, f"{len(failing)} listed tests did not pass: {described}{more}", failing)
