"""The agent's change to a repository task: its workspace's `git diff` from the base commit, read
without trusting anything in the workspace.

The workspace's own `.git` is the agent's to edit (its config could name a program git would run,
its refs could point anywhere, its index could hide files), so git never reads it here: the diff is
taken with the `.git` of a fresh copy of the task (made by the node, at the base commit), from the
fresh copy's files to the workspace's, with a private index, a private object folder (the fresh
copy's objects are only read) and no user or system configuration. What it leaves out:

- harness config folders (`.pi/`, `.codex/`, `.claude/`, `.gemini/`, `.qwen/`) and caches
  (`__pycache__/`, `.pytest_cache/`), which a harness writes and no fix needs;
- the test patch's files: the test patch replaces them after the change is applied, so an agent
  cannot grade itself by editing the tests (SWE-bench resets them the same way);
- symbolic links and nested repositories (git writes them as links and gitlinks): a link could make
  a later write land outside the copy, and no task needs one.

A change of more than `max_bytes` or MAX_FILES files is refused (`ChangeRefused`), as is one that git
cannot read in time. What was left out is reported, so a session's metadata says why a change did less than the
agent wrote.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HARNESS_FOLDERS = (".pi", ".codex", ".claude", ".gemini", ".qwen")
CACHE_FOLDERS = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache")
DEFAULT_MAX_BYTES = 1 << 20
GIT_TIMEOUT_S = 120.0
READ_CAP = 64 << 20  # the most any other git output here is read
MAX_FILES = 5000  # changed files in one change; more is refused (each is an argument to git)
# Modes git records for a symbolic link and for a nested repository (a gitlink).
_LINK_MODES = ("120000", "160000")


class ChangeRefused(Exception):
    """The change cannot be graded (too large, unreadable); the message says why."""


@dataclass(frozen=True)
class Change:
    """The agent's change as a git diff (binary-safe), and the paths it left out, each with why."""

    patch: bytes
    dropped: tuple[str, ...]  # "path (why)"


def git_env(home: Path) -> dict[str, str]:
    """Variables for git to read no configuration but the repository's own, and never ask."""
    return {
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "LANG": "C.UTF-8",
    }


async def workspace_change(
    workspace: Path, fresh_workspace: Path, test_files: Sequence[str], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Change:
    """The change from the files of `fresh_workspace` (a fresh copy of the task, its `.git` at the
    base commit, prepared as the agent's was) to those of `workspace`, less what the module
    docstring lists. Raises ChangeRefused."""
    base_git_dir = fresh_workspace / ".git"
    with tempfile.TemporaryDirectory(prefix="polar-change-") as scratch:
        scratch_path = Path(scratch)
        env = {
            **git_env(scratch_path),
            "PATH": os.environ.get("PATH", os.defpath),
            "GIT_DIR": str(base_git_dir),
            "GIT_INDEX_FILE": str(scratch_path / "index"),
            "GIT_OBJECT_DIRECTORY": str(scratch_path / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(base_git_dir / "objects"),
        }
        (scratch_path / "objects").mkdir()
        excluded = [f":(exclude,glob)**/{folder}/**" for folder in (*HARNESS_FOLDERS, *CACHE_FOLDERS)]

        def git(arguments: list[str], tree: Path, limit: int | None = None):
            tree_env = {**env, "GIT_WORK_TREE": str(tree)}
            return asyncio.to_thread(run_git, arguments, env=tree_env, cwd=tree, stderr_dir=scratch_path, limit=limit)

        async def snapshot(tree: Path) -> None:
            """The private index := every file of `tree` (less the exclusions)."""
            await git(["read-tree", "HEAD"], tree)
            await git(["add", "--all", "--", ".", *excluded], tree)

        # The base is the fresh copy as its prepare steps left it (files they made included), so the
        # change applies to it exactly.
        await snapshot(fresh_workspace)
        base = (await git(["write-tree"], fresh_workspace)).decode().strip()
        await snapshot(workspace)
        run = functools.partial(git, tree=workspace)
        raw = await run(["diff", "--cached", "--raw", "-z", "--no-renames", base])
        kept, dropped = split_raw(raw.decode("utf-8", "surrogateescape"), frozenset(test_files))
        if not kept:
            return Change(b"", tuple(dropped))
        if len(kept) > MAX_FILES:
            raise ChangeRefused(f"the change touches {len(kept)} files, more than {MAX_FILES}")
        pathspecs = [f":(literal){path}" for path in kept]
        diff = ["diff", "--cached", "--binary", "--no-renames", "--full-index", base, "--", *pathspecs]
        patch = await run(diff, limit=max_bytes)
    return Change(patch, tuple(dropped))


def split_raw(raw: str, test_files: frozenset[str]) -> tuple[list[str], list[str]]:
    """`git diff --raw -z` entries into the paths to keep and the dropped ones ("path (why)")."""
    fields = raw.split("\0")
    kept, dropped = [], []
    for index in range(0, len(fields) - 1, 2):
        meta, path = fields[index], fields[index + 1]
        if not meta.startswith(":"):
            continue
        old_mode, new_mode = meta[1:].split(" ", 2)[:2]
        if path in test_files:
            dropped.append(f"{path} (a test patch file: the test patch replaces it)")
        elif new_mode in _LINK_MODES or old_mode in _LINK_MODES:
            dropped.append(f"{path} (a symbolic link or nested repository)")
        else:
            kept.append(path)
    return kept, dropped


def run_git(
    arguments: Sequence[str], *, env: dict[str, str], cwd: Path, stderr_dir: Path, limit: int | None = None
) -> bytes:
    """git's stdout as bytes (a diff of files in any encoding stays exact); ChangeRefused when it
    fails, runs past GIT_TIMEOUT_S, or writes more than `limit` bytes."""
    cap = READ_CAP if limit is None else limit
    with tempfile.TemporaryFile(dir=stderr_dir) as errors:
        try:
            # The fresh copy's files may belong to another user (a container's root): git would
            # refuse the repository as of dubious ownership, though only the node made it.
            process = subprocess.Popen(
                ["git", "-c", "safe.directory=*", *arguments],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
            )
        except OSError as exc:
            raise ChangeRefused(f"git {arguments[0]}: cannot start: {exc}") from exc
        timer = threading.Timer(GIT_TIMEOUT_S, process.kill)
        timer.start()
        try:
            output = process.stdout.read(cap + 1)
            if len(output) > cap:
                process.kill()
            process.stdout.close()
            code = process.wait()
        finally:
            timer.cancel()
        if len(output) > cap:
            raise ChangeRefused(f"the change is larger than {cap} bytes")
        if code != 0:
            if code < 0:
                raise ChangeRefused(f"git {arguments[0]} took more than {GIT_TIMEOUT_S:g} s on the workspace")
            errors.seek(0)
            text = errors.read(4096).decode("utf-8", "replace").strip()
            raise ChangeRefused(f"git {arguments[0]} failed (exit code {code}): {text}")
    return output
