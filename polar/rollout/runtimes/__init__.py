"""Where sessions run: a fresh folder per session, on this machine ("local") or in a container
("docker"). See base.py for what every runtime provides."""

from __future__ import annotations

from pathlib import Path

from polar.rollout.isolation import NO_ISOLATION, Isolation
from polar.rollout.runtimes.base import Runtime, RuntimeFailure, RuntimeProvider, spec_key
from polar.rollout.runtimes.docker import DockerProvider, DockerRuntime, docker_engine_answers
from polar.rollout.runtimes.local import LocalProvider, LocalRuntime
from polar.rollout.templates import TemplateSources

__all__ = [
    "DockerProvider",
    "DockerRuntime",
    "LocalProvider",
    "LocalRuntime",
    "Runtime",
    "RuntimeFailure",
    "RuntimeProvider",
    "available_providers",
    "docker_engine_answers",
    "spec_key",
]


def available_providers(
    work_root: Path,
    templates: TemplateSources | None = None,
    isolation: Isolation = NO_ISOLATION,
    harness_url: str = "",
) -> dict[str, RuntimeProvider]:
    """The runtime kinds this machine offers, by kind: "local" always (its commands sandboxed as
    `isolation` says), "docker" when a Docker engine answers (checked once, now; this blocks for up
    to a few seconds; its containers reach only `harness_url`). Templates come only from
    `templates` (None: anywhere)."""
    providers: dict[str, RuntimeProvider] = {
        "local": LocalProvider(work_root, templates=templates, isolation=isolation)
    }
    if docker_engine_answers():
        providers["docker"] = DockerProvider(work_root, templates=templates, harness_url=harness_url)
    return providers
