"""polar/rollout/templates.py: a task's template is a remote git URL under one of the node's allowed
git sources or a folder inside the node's template roots once symlinks are resolved; '..', '~', NUL
and git's other transports are refused. Property tests draw paths over a tree with a symlink that
leads out of the root, and URLs around an allowed prefix."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar.app.node.runtimes import LocalProvider, RuntimeFailure, available_providers
from polar.rollout import tasks
from polar.rollout.templates import (
    TemplateRefused,
    TemplateSources,
    confine,
    is_remote,
    parse_roots,
    parse_sources,
    template_problem,
)
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
        allowed = confine(template, TemplateSources((root,)), cwd=root)
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
        allowed = confine(template, TemplateSources((root,)), cwd=root)
    except TemplateRefused:
        return
    assert not is_remote(template)  # no git source is allowed here
    resolved = Path(allowed)
    assert resolved == root or resolved.is_relative_to(root)


@pytest.mark.parametrize(
    "template",
    ["../../../etc", "~/../x", "~", "a/../../x", "file:///etc", "ext::sh -c id", "fd::3", "a\0b", "FILE:///etc"],
)
def test_what_no_node_takes_is_refused_at_submit(template):
    assert template_problem(template) is not None
    task = rollout_pb2.Task(
        task_id="t",
        instruction="x",
        harness=rollout_pb2.HarnessSpec(preset="command", command=["true"]),
        runtime=rollout_pb2.RuntimeSpec(kind="local", template=template),
    )
    assert any(problem.startswith("runtime.template: ") for problem in tasks.validate_task(tasks.normalize_task(task)))


@pytest.mark.parametrize(
    "template", ["https://github.com/o/r.git", "git@github.com:o/r.git", "ssh://h/r", "examples/agent", "/abs/x"]
)
def test_remote_git_and_plain_paths_pass_the_submit_check(template):
    assert template_problem(template) is None


def test_a_folder_outside_the_roots_names_them_and_the_option(tree):
    with pytest.raises(TemplateRefused, match=r"outside the node's template roots .*--template-roots allows more"):
        confine(str(tree / "outside"), TemplateSources((tree / "root",)), cwd=tree)
    both = TemplateSources((tree / "root", tree / "outside"))
    assert confine(str(tree / "outside"), both) == str((tree / "outside").resolve())


def test_roots_default_to_the_working_folder(tmp_path):
    assert parse_roots("", cwd=tmp_path) == [tmp_path]
    assert parse_roots(os.pathsep.join(["a", "/b"]), cwd=tmp_path) == [tmp_path / "a", Path("/b")]
    assert parse_sources("", " https://h/a/ ,, git@h:a/", cwd=tmp_path) == TemplateSources(
        (tmp_path,), ("https://h/a/", "git@h:a/")
    )


async def test_a_node_provider_refuses_a_template_outside_its_roots(tree, tmp_path):
    provider = LocalProvider(tmp_path / "work", templates=TemplateSources((tree / "root",)))
    with pytest.raises(RuntimeFailure, match="outside the node's template roots"):
        await provider.create(rollout_pb2.RuntimeSpec(kind="local", template=str(tree / "root" / "out")), name="s")
    assert list((tmp_path / "work").iterdir()) == []  # nothing left behind
    runtime = await provider.create(
        rollout_pb2.RuntimeSpec(kind="local", template=str(tree / "root" / "link-in")), name="s"
    )
    try:
        assert (runtime.workspace / "b").is_dir()
    finally:
        await runtime.close()
    sources = TemplateSources((tree / "root",), ("https://git.example/acme/",))
    assert available_providers(tmp_path / "w", sources)["local"].templates == sources
    with pytest.raises(RuntimeFailure, match="not among the node's allowed sources"):
        await provider.create(
            rollout_pb2.RuntimeSpec(kind="local", template="https://git.example/acme/r.git"), name="s"
        )
    assert list((tmp_path / "work").iterdir()) == []


ALLOWED_GIT = ("https://git.example/acme/", "git@git.example:acme/", "ssh://git.example/team")
URL_PIECES = ["acme", "acme-evil", "r.git", "..", ".", "team", "team2", "%2e%2e", "x", "@evil.example", "\\", ""]


@given(
    st.sampled_from(["https://git.example/", "git@git.example:", "ssh://git.example/", "https://evil.example/"]),
    st.lists(st.sampled_from(URL_PIECES), min_size=1, max_size=4),
)
def test_a_remote_template_is_cloned_only_under_an_allowed_prefix(base, pieces):
    url = base + "/".join(pieces)
    try:
        allowed = confine(url, TemplateSources((), ALLOWED_GIT))
    except TemplateRefused as exc:
        assert repr(url) in str(exc)
        refused = True
    else:
        assert allowed == url
        refused = False
    # A model of the rule, independent of the code: the URL names a path under a listed prefix,
    # with no segment or escape that a server or git could resolve elsewhere.
    address = url.split("://", 1)[1] if "://" in url else url.split(":", 1)[1]
    segments = address.replace(":", "/").split("/")
    clean = not any(s in (".", "..") for s in segments) and "%" not in url and "\\" not in url
    under = url.startswith(("https://git.example/acme/", "git@git.example:acme/")) or (
        url == "ssh://git.example/team" or url.startswith("ssh://git.example/team/")
    )
    assert refused == (not (clean and under)), url


@pytest.mark.parametrize(
    "url",
    [
        "https://git.example/acme-evil/r.git",  # a longer name, not a folder of the prefix
        "ssh://git.example/team2/r",
        "https://git.example/acme/../other/r.git",
        "https://git.example/acme/%2e%2e/other/r.git",
        "https://git.example.evil/acme/r.git",
        "https://git.example/acme/r.git extra",
    ],
)
def test_tricks_around_an_allowed_prefix_are_refused(url):
    with pytest.raises(TemplateRefused):
        confine(url, TemplateSources((), ALLOWED_GIT))
    with pytest.raises(TemplateRefused, match="--template-git allows more|may not hold"):
        confine(url, TemplateSources((), ALLOWED_GIT))
