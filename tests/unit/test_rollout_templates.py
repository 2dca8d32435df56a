"""polar/rollout/templates.py: a task's template is a remote git URL or a folder inside the node's
template roots once symlinks are resolved; '..', '~', NUL and git's other transports are refused.
Property tests draw paths over a tree with a symlink that leads out of the root."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar.rollout import tasks
from polar.rollout.runtimes import LocalProvider, RuntimeFailure, available_providers
from polar.rollout.templates import TemplateRefused, confine, is_remote, parse_roots, template_problem
from polar.v1 import rollout_pb2

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """base/root/{a/b, link-in -> a, out -> base/outside}, base/outside/secret."""
    base = tmp_path_factory.mktemp("templates")
    root = base / "root"
    (root / "a" / "b").mkdir(parents=True)
    (base / "outside").mkdir()
    (base / "outside" / "secret").write_text("x")
    (root / "link-in").symlink_to(root / "a")
    (root / "out").symlink_to(base / "outside")
    return base


COMPONENTS = ["a", "b", "link-in", "out", "..", ".", "~", "", "secret", "~x"]


@given(st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=6), st.booleans())
def test_an_accepted_template_always_lies_in_a_root(tree, parts, absolute):
    root = tree / "root"
    template = ("/".join([str(root), *parts]) if absolute else "/".join(parts).lstrip("/")) or "."
    try:
        allowed = confine(template, [root], cwd=root)
    except TemplateRefused as exc:
        assert repr(template) in str(exc)
        refused = True
    else:
        refused = False
        resolved = Path(allowed)
        assert resolved == resolved.resolve()
        assert resolved == root or resolved.is_relative_to(root)
    pure = PurePosixPath(template)
    if ".." in pure.parts or template.startswith("~"):
        assert refused
    # Through the symlink that leads out: always refused. Without '..', '~' or it: always accepted.
    if _leaves_through_the_link(parts):
        assert refused
    elif ".." not in pure.parts and not template.startswith("~"):
        assert not refused


def _leaves_through_the_link(parts: list[str]) -> bool:
    """Whether a walk from the root over `parts` (no '..') takes the `out` symlink: a model of the
    tree, independent of the code under test."""
    here: list[str] = []  # the real folder, relative to the root
    for part in parts:
        if part in ("", "."):
            continue
        if part == "out" and here == []:
            return True
        here = ["a"] if part == "link-in" and here == [] else [*here, part]
    return False


@given(st.text(min_size=1, max_size=40))
def test_no_text_escapes_the_root(tree, template):
    root = tree / "root"
    try:
        allowed = confine(template, [root], cwd=root)
    except TemplateRefused:
        return
    if is_remote(template):
        assert allowed == template  # a remote git source: cloned, never read from this machine's disk
        return
    resolved = Path(allowed)
    assert resolved == root or resolved.is_relative_to(root)


@pytest.mark.parametrize(
    "template",
    ["../../../etc", "~/../x", "~", "a/../../x", "file:///etc", "ext::sh -c id", "fd::3", "a\0b", "FILE:///etc"],
)
def test_what_no_node_takes_is_refused_at_submit(template):
    assert template_problem(template) is not None
    task = rollout_pb2.Task(
        task_id="t", instruction="x", harness=rollout_pb2.HarnessSpec(preset="command", command=["true"]),
        runtime=rollout_pb2.RuntimeSpec(kind="local", template=template),
    )  # fmt: skip
    assert any(problem.startswith("runtime.template: ") for problem in tasks.validate_task(tasks.normalize_task(task)))


@pytest.mark.parametrize("template", ["https://github.com/o/r.git", "git@github.com:o/r.git", "ssh://h/r", "examples/agent", "/abs/x"])
def test_remote_git_and_plain_paths_pass_the_submit_check(template):
    assert template_problem(template) is None


def test_a_folder_outside_the_roots_names_them_and_the_option(tree):
    with pytest.raises(TemplateRefused, match=r"outside the node's template roots .*--template-roots allows more"):
        confine(str(tree / "outside"), [tree / "root"], cwd=tree)
    assert confine(str(tree / "outside"), [tree / "root", tree / "outside"]) == str((tree / "outside").resolve())


def test_roots_default_to_the_working_folder(tmp_path):
    assert parse_roots("", cwd=tmp_path) == [tmp_path]
    assert parse_roots(os.pathsep.join(["a", "/b"]), cwd=tmp_path) == [tmp_path / "a", Path("/b")]


async def test_a_node_provider_refuses_a_template_outside_its_roots(tree, tmp_path):
    provider = LocalProvider(tmp_path / "work", template_roots=[tree / "root"])
    with pytest.raises(RuntimeFailure, match="outside the node's template roots"):
        await provider.create(rollout_pb2.RuntimeSpec(kind="local", template=str(tree / "root" / "out")), name="s")
    assert list((tmp_path / "work").iterdir()) == []  # nothing left behind
    runtime = await provider.create(rollout_pb2.RuntimeSpec(kind="local", template=str(tree / "root" / "link-in")), name="s")
    try:
        assert (runtime.workspace / "b").is_dir()
    finally:
        await runtime.close()
    assert available_providers(tmp_path / "w", [tree / "root"])["local"].template_roots == [tree / "root"]
