"""Fixtures the integration tests share: `polar` commands started as a user starts them, an aiohttp
client session, and two tiny-model inference servers of the test's own process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import pytest

from tests.helpers.polar_command import spawned
from tests.helpers.tiny_inference_server import TinyServer


@pytest.fixture
def spawn() -> Iterator[Callable]:
    """Starts a `polar` subprocess with piped output (tests.helpers.polar_command.spawned); whatever
    still runs when the test ends is killed."""
    with spawned() as start:
        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp client session, for requests sent as they are written (no SDK in between)."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def tiny_servers() -> AsyncIterator[list[TinyServer]]:
    """Two inference servers of the tiny model on loopback ports (tests.helpers.tiny_inference_server)."""
    started = [await TinyServer().start(), await TinyServer().start()]
    yield started
    for server in started:
        await server.stop()
