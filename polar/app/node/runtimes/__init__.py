"""Where sessions run: a fresh folder per session, on this machine ("local") or in a container
("docker"). See base.py for what every runtime provides."""

from __future__ import annotations

from pathlib import Path

from polar.app.node.isolation import NO_ISOLATION, Isolation
from polar.app.node.runtimes.base import Runtime, RuntimeFailure, RuntimeProvider, spec_key
from polar.app.node.runtimes.docker import (
    DockerProvider,
    DockerRuntime,
    Limits,
    docker_engine_answers,
    engine_problem,
    remove_orphans,
)
from polar.app.node.runtimes.local import LocalProvider, LocalRuntime
from polar.rollout.templates import TemplateSources

__all__ = [
    "DockerProvider",
    "DockerRuntime",
    "Limits",
    "LocalProvider",
    "LocalRuntime",
    "Runtime",
    "RuntimeFailure",
    "RuntimeProvider",
    "available_providers",
    "docker_engine_answers",
    "engine_problem",
    "remove_orphans",
    "spec_key",
]


def available_providers(
    work_root: Path,
    templates: TemplateSources | None = None,
    isolation: Isolation = NO_ISOLATION,
    harness_url: str = "",
    *,
    harness_path: str = "",
    limits: Limits = Limits(),
    start_limit: int = 4,
) -> dict[str, RuntimeProvider]:
    """The runtime kinds this machine offers, by kind: "local" always (its commands sandboxed as
    `isolation` says), "docker" when a Docker engine answers (checked once, now; this blocks for up
    to a few seconds). Its containers reach only `harness_url`, run the CLIs of `harness_path`, have
    `limits` unless a task sets its own, and at most `start_limit` start at once; the containers of
    nodes that no longer run (a crash) are removed first. Templates come only from `templates`
    (None: anywhere)."""
    providers: dict[str, RuntimeProvider] = {
        "local": LocalProvider(work_root, templates=templates, isolation=isolation)
    }
    if docker_engine_answers():
        remove_orphans()
        providers["docker"] = DockerProvider(
            work_root,
            templates=templates,
            harness_url=harness_url,
            harness_path=harness_path,
            limits=limits,
            start_limit=start_limit,
        )
    return providers
