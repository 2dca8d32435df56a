"""What every runtime is: a session folder on the host and a place to run commands in it.

A session's folder (`root`) holds `work/`, the workspace the harness starts in (filled from the task's
template), and `home/`, a private HOME. `RuntimeProvider.create` makes the folder, fills the
workspace and runs the prepare commands; any failing step raises `RuntimeFailure`, whose message is
meant for the task's author (the step, its exit code, the tail of its output), and leaves nothing
behind. The steps every kind shares live here; a kind supplies how commands run (`Runtime.run`).
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from polar import credentials
from polar.app.node.process import OUTPUT_LIMIT, ProcessResult, ProcessStartError, exit_text, run_process
from polar.rollout.templates import TemplateRefused, TemplateSources, confine, is_remote
from polar.v1 import rollout_pb2

log = logging.getLogger("polar.app.node.runtimes")

# How long one creation step (a template clone, one prepare command, a container start) may take.
STEP_TIMEOUT_S = 600.0
# Characters of a failed step's output quoted in its RuntimeFailure.
FAILURE_TAIL_CHARS = 2000


class RuntimeFailure(Exception):
    """A runtime could not be made ready; the message says which step failed and how."""


class Runtime(abc.ABC):
    """One session's place to run commands. Commands run one at a time."""

    kind: str

    def __init__(self, root: Path) -> None:
        self.root = root  # the session's folder on the host
        self.workspace = root / "work"  # the harness's working folder
        self.home = root / "home"  # private HOME for the harness (created empty)

    @abc.abstractmethod
    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        timeout_s: float | None,
        output_limit: int = OUTPUT_LIMIT,
        cancel: asyncio.Event | None = None,
        preparing: bool = False,
    ) -> ProcessResult:
        """Run argv in the workspace (see `run_process`); nothing it started is left running after.
        `preparing`: a prepare step (the task author's, before anything model-written ran there),
        which keeps the network that a harness or an evaluator may be denied."""

    def harness_base_url(self, base_url: str) -> str:
        """The gateway's harness URL as a harness here dials it."""
        return base_url

    @abc.abstractmethod
    def command_env(self, variables: Mapping[str, str]) -> dict[str, str]:
        """The environment for the node's own commands here (prepare steps, evaluators): what such a
        command usually needs from its surroundings, HOME set to `home`, then `variables`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Remove everything this runtime made; calling it again does nothing."""


class RuntimeProvider(abc.ABC):
    """Makes runtimes of one kind, each in a fresh folder under `work_root`."""

    kind: str

    def __init__(
        self, work_root: Path, *, step_timeout_s: float = STEP_TIMEOUT_S, templates: TemplateSources | None = None
    ) -> None:
        self.work_root = work_root
        self.step_timeout_s = step_timeout_s
        # Where a template may come from (polar.rollout.templates); None: anywhere (outside a node).
        self.templates = templates
        self._cleanups: set[asyncio.Task] = set()

    async def create(self, spec: rollout_pb2.RuntimeSpec, *, name: str) -> Runtime:
        """A ready runtime for spec: the workspace filled from spec.template, then each spec.prepare
        command run in it (`sh -c`). name (a session id) labels the folder. Raises RuntimeFailure,
        after removing whatever was made, when a step fails."""
        root = new_session_folder(self.work_root, name)
        try:
            await fill_workspace(
                spec.template,
                root / "work",
                timeout_s=self.step_timeout_s,
                sources=self.templates,
                revision=spec.revision,
            )
        except BaseException:
            await asyncio.shield(asyncio.to_thread(remove_tree, root))
            raise
        try:
            runtime = await self._start(spec, root)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(remove_tree, root))
            raise
        try:
            await run_prepare(runtime, spec.prepare, timeout_s=self.step_timeout_s)
        except BaseException:
            await self.cleanup(runtime.close())
            raise
        return runtime

    async def cleanup(self, coroutine) -> None:
        """Run a cleanup to its end even if the caller is cancelled meanwhile; `settle` waits for it."""
        task = asyncio.create_task(coroutine)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def settle(self) -> None:
        """Wait for the cleanups still running (of runtimes whose creation was cancelled: a node
        stopping)."""
        await asyncio.gather(*self._cleanups, return_exceptions=True)

    @abc.abstractmethod
    async def _start(self, spec: rollout_pb2.RuntimeSpec, root: Path) -> Runtime:
        """The runtime over a session folder whose workspace is filled (RuntimeFailure if it
        cannot start; create then removes the folder)."""


def spec_key(spec: rollout_pb2.RuntimeSpec) -> str:
    """A stable fingerprint of what makes two runtimes interchangeable (kind, template, prepare
    commands, image, workdir, limits): prewarmed runtimes are matched to sessions by it."""
    fields = [spec.kind, spec.template, list(spec.prepare), spec.image]
    if spec.revision:
        fields.append(spec.revision)
    if spec.workdir or spec.cpus or spec.memory_bytes or spec.max_processes:
        fields += [spec.workdir, spec.cpus, spec.memory_bytes, spec.max_processes]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- steps every kind shares


def new_session_folder(work_root: Path, name: str) -> Path:
    """A fresh folder under work_root named after name, with an empty `home/` in it."""
    work_root.mkdir(parents=True, exist_ok=True)
    label = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "session"
    root = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work_root))
    (root / "home").mkdir()
    return root


async def fill_workspace(
    template: str,
    workspace: Path,
    *,
    timeout_s: float,
    sources: TemplateSources | None = None,
    revision: str = "",
) -> None:
    """Make workspace: empty (no template), a copy of a template folder, or a clone of a git
    repository (a URL, or a local folder that is a repository: then only its committed files); with
    `revision`, that commit of the repository alone, so no later commit (a task's fix) is in it.
    It must be one of `sources` (polar.rollout.templates.confine; None: anywhere)."""
    if not template:
        if revision:
            raise RuntimeFailure(f"revision {revision!r}: a revision needs a git repository as the template")
        workspace.mkdir()
        return
    try:
        allowed = confine(template, sources)
    except TemplateRefused as exc:
        raise RuntimeFailure(str(exc)) from None
    source = Path(allowed).expanduser() if sources is None else Path(allowed)
    is_repository = is_remote(allowed) or (source / ".git").exists()
    if revision:
        if not is_repository:
            raise RuntimeFailure(f"template {template!r}: revision {revision!r} needs a git repository, not a folder")
        await _fetch_revision(template, allowed, revision, workspace, timeout_s)
        return
    if not is_repository and source.is_dir():
        try:
            await asyncio.to_thread(shutil.copytree, source, workspace, symlinks=True)
        except (OSError, shutil.Error) as exc:
            raise RuntimeFailure(f"template {template!r}: copying the folder failed: {exc}") from exc
        return
    # The node's own environment: its git configuration (credentials, proxies) applies; prompting
    # for a password would only wait for the timeout.
    env = {**credentials.without(os.environ), "GIT_TERMINAL_PROMPT": "0"}
    argv = ["git", "clone", "--depth", "1", "--quiet", "--", allowed, str(workspace)]
    await checked_step(f"template {template!r}: git clone", argv, cwd=workspace.parent, env=env, timeout_s=timeout_s)


async def _fetch_revision(template: str, source: str, revision: str, workspace: Path, timeout_s: float) -> None:
    """workspace = a new repository holding only `revision` of `source`, checked out (detached)."""
    env = {**credentials.without(os.environ), "GIT_TERMINAL_PROMPT": "0"}
    workspace.mkdir()
    step = f"template {template!r} at {revision!r}"
    git = ["git", "-C", str(workspace)]
    await checked_step(f"{step}: git init", [*git, "init", "--quiet"], cwd=workspace, env=env, timeout_s=timeout_s)
    fetch = [*git, "fetch", "--quiet", "--depth", "1", "--no-tags", "--", source, revision]
    await checked_step(f"{step}: git fetch", fetch, cwd=workspace, env=env, timeout_s=timeout_s)
    checkout = [*git, "checkout", "--quiet", "--detach", "FETCH_HEAD"]
    await checked_step(f"{step}: git checkout", checkout, cwd=workspace, env=env, timeout_s=timeout_s)


async def run_prepare(runtime: Runtime, commands: Sequence[str], *, timeout_s: float) -> None:
    """Run each prepare command in the runtime's workspace, in order; the first failure raises."""
    for index, command in enumerate(commands):
        step = f"prepare[{index}] {command!r}"
        try:
            result = await runtime.run(
                ["sh", "-c", command], env=runtime.command_env({}), timeout_s=timeout_s, preparing=True
            )
        except ProcessStartError as exc:
            raise RuntimeFailure(f"{step}: {exc}") from exc
        _check(step, result, timeout_s)


async def checked_step(
    step: str, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout_s: float
) -> ProcessResult:
    """Run one host command of a creation step; RuntimeFailure unless it exits 0."""
    try:
        result = await run_process(argv, cwd=cwd, env=env, timeout_s=timeout_s)
    except ProcessStartError as exc:
        raise RuntimeFailure(f"{step}: {exc}") from exc
    _check(step, result, timeout_s)
    return result


def _check(step: str, result: ProcessResult, timeout_s: float) -> None:
    if result.timed_out:
        problem = f"timed out after {timeout_s:g} s"
    elif result.exit_code != 0:
        problem = exit_text(result.exit_code)
    else:
        return
    tail = output_tail(result.output)
    raise RuntimeFailure(f"{step}: {problem}" + (f"; output ends:\n{tail}" if tail else "; no output"))


def output_tail(output: str, chars: int = FAILURE_TAIL_CHARS) -> str:
    output = output.strip()
    return output if len(output) <= chars else "…" + output[-chars:]


def remove_tree(path: Path) -> None:
    """Remove a folder tree, including read-only folders in it (module caches make those); a
    leftover is logged, not raised, so a failed cleanup never fails a session."""

    def make_writable_and_retry(function, failed_path, error) -> None:
        error = error[1] if isinstance(error, tuple) else error  # onerror passes sys.exc_info()
        if isinstance(error, FileNotFoundError):
            return
        if not isinstance(error, PermissionError) or Path(failed_path) == path:
            raise error
        os.chmod(os.path.dirname(failed_path), 0o700)
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, 0o700)
        function(failed_path)

    handler = {"onexc" if sys.version_info >= (3, 12) else "onerror": make_writable_and_retry}
    try:
        shutil.rmtree(path, **handler)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
