"""The container tier (marked `docker`): tests against a real Docker engine and the images built
on this machine (scripts/setup_docker.sh: the engine, the base image). Where no engine answers or
the base image is missing, every test here skips, saying which; CI's container tier fails on a skip.

After every test, no container of Polar's (label polar.owner) that the test run made may be left:
a leak fails the test that made it. Containers of nodes that other programs run on the machine are
left alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from polar.app.node.runtimes import engine_problem
from tests.helpers import swe_mini
from tests.helpers.docker_engine import polar_containers

BASE_IMAGE = "polar-base:bookworm"
PROBLEM = engine_problem()
if PROBLEM is None and subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode:
    PROBLEM = f"no image {BASE_IMAGE} on this machine: build it with scripts/setup_docker.sh"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(item.fspath).is_relative_to(here):
            item.add_marker(pytest.mark.docker)
            item.add_marker(pytest.mark.slow)
            if PROBLEM is not None:
                item.add_marker(pytest.mark.skip(reason=f"the container tier needs Docker: {PROBLEM}"))


@pytest.fixture(autouse=True)
def no_container_left():
    yield
    if PROBLEM is None:
        left = polar_containers()
        if left:
            subprocess.run(["docker", "rm", "--force", *left], capture_output=True)
        assert left == [], f"containers left behind: {left}"


@pytest.fixture(scope="session")
def swe_mini_images(tmp_path_factory) -> Path:
    """examples/swe-mini's repositories built under a temporary folder, every instance's image
    built (kept between runs when unchanged); the repositories' folder."""
    repos = tmp_path_factory.mktemp("swe-mini") / "repos"
    built = swe_mini.build.build_all(repos)
    swe_mini.build.build_images(repos, built)
    return repos
