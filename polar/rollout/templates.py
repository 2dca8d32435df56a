"""Where a task's workspace may come from: its `runtime.template`, confined.

A template is a remote git repository (https://, http://, ssh://, git:// or `user@host:path`),
cloned as it is, or a folder of the node (a path relative to where the node runs, or absolute),
copied or, when it is a git repository, cloned. A folder must lie inside one of the node's template
roots (`[node] template_roots`, by default the node's working folder) once every symlink on its way
is resolved; a path with a `..` component or starting with `~` is refused outright, as are git's
other transports (file://, `ext::`, ...), which would reach the node's files by another name. A
remote repository must start with one of the node's allowed git sources (`[node] template_git`,
by default none): a prefix ending in '/' or ':' covers what follows it, any other covers itself and
what follows it after a '/'; a URL with a '.' or '..' path segment, a '%' escape or a backslash is
refused, since git and its servers may resolve those to another repository than the prefix names.

    template_problem(template)            what no node accepts (checked at submit), or None
    confine(template, sources, cwd)       the template to copy or clone; TemplateRefused if not allowed
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REMOTE_SCHEMES = ("https", "http", "ssh", "git")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_TRANSPORT = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::")  # git's `<transport>::<address>`
# git's scp-like syntax: user@host:path, with no slash before the colon.
_SCP_LIKE = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:(?!//)")


class TemplateRefused(ValueError):
    """A template this node does not copy from; the message says why and what allows more."""


@dataclass(frozen=True)
class TemplateSources:
    """What a node fills workspaces from: folders inside `roots`, and remote git repositories under
    one of the `git` prefixes."""

    roots: tuple[Path, ...]
    git: tuple[str, ...] = ()


def is_remote(template: str) -> bool:
    match = _SCHEME.match(template)
    return (match is not None and match.group(1).lower() in REMOTE_SCHEMES) or _SCP_LIKE.match(template) is not None


def template_problem(template: str) -> str | None:
    """Why no node would take `template`, whatever its roots; None if it may be fine."""
    if not template or is_remote(template):
        return None
    if "\0" in template:
        return "a template may not contain a NUL character"
    if (match := _SCHEME.match(template)) is not None:
        return f"{match.group(1)}:// is not a template source (remote git: {', '.join(REMOTE_SCHEMES)}; or a folder of the node)"
    if _TRANSPORT.match(template):
        return "git transports (`name::address`) are not template sources"
    if template.startswith("~"):
        return "a template may not start with '~' (use a path relative to the node's working folder)"
    if ".." in PurePosixPath(template).parts:
        return "a template may not contain a '..' component"
    return None


def confine(template: str, sources: TemplateSources | None, cwd: Path | None = None) -> str:
    """The template to fill a workspace from: "" (none), a remote URL as given, or the folder's
    resolved path, which lies inside one of the roots (resolved themselves). `sources` None: the
    template as given, unchecked (a provider used outside a node). Raises TemplateRefused."""
    if not template or sources is None:
        return template
    if is_remote(template):
        if (problem := _remote_problem(template, sources.git)) is not None:
            raise TemplateRefused(f"template {template!r}: {problem}")
        return template
    if (problem := template_problem(template)) is not None:
        raise TemplateRefused(f"template {template!r}: {problem}")
    path = Path(cwd or os.getcwd()) / template
    resolved = path.resolve()
    allowed = [Path(root).resolve() for root in sources.roots]
    if not any(resolved == root or resolved.is_relative_to(root) for root in allowed):
        where = ", ".join(map(str, allowed)) or "none"
        raise TemplateRefused(
            f"template {template!r} is {resolved}, outside the node's template roots ({where});"
            " the node option --template-roots allows more"
        )
    return str(resolved)


def _remote_problem(url: str, allowed: Sequence[str]) -> str | None:
    """Why the remote repository `url` is not one of `allowed` (URL prefixes), or None."""
    if "%" in url or "\\" in url or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        return "a remote template may not hold a '%' escape, a backslash, a space or a control character"
    address = url.split("://", 1)[1] if "://" in url else url.split(":", 1)[1]
    if any(segment in (".", "..") for segment in re.split(r"[/:]", address)):
        return "a remote template may not hold a '.' or '..' path segment"
    for prefix in allowed:
        if url == prefix or url.startswith(prefix if prefix.endswith(("/", ":")) else prefix + "/"):
            return None
    listed = ", ".join(allowed) or "none"
    return f"remote git repository not among the node's allowed sources ({listed}); the node option --template-git allows more"


def parse_roots(setting: str, cwd: Path | None = None) -> list[Path]:
    """`[node] template_roots`: os.pathsep-separated folders, relative ones to `cwd`; "" = `cwd`."""
    base = Path(cwd or os.getcwd())
    parts = [part for part in setting.split(os.pathsep) if part]
    return [base / part for part in parts] if parts else [base]


def parse_sources(roots: str, git: str, cwd: Path | None = None) -> TemplateSources:
    """`[node] template_roots` and `[node] template_git` (comma-separated URL prefixes)."""
    return TemplateSources(
        tuple(parse_roots(roots, cwd)), tuple(part.strip() for part in git.split(",") if part.strip())
    )
