"""Settings for every test tier.

Hypothesis: in CI (CI=true) every property test draws the same examples on every run and has no
per-example deadline, so a 2-core machine under load cannot fail a run on a slow example or a lucky
draw; locally, each run explores fresh examples. The vLLM tier's environment has no Hypothesis (none
of its tests use it), hence the guarded import.

Async tests (AnyIO's pytest plugin) share one asyncio event loop for the whole run, as each of our
services does in production. grpc.aio's completion queue is process-wide and hands each completion
to the loop its call was made on: an operation still pending in C-core when a test's own loop closed
would complete later, inside whichever test polls next, as "RuntimeError: Event loop is closed".

Fixtures every tier shares: the `tiny` model's tokenizer and its hermes chat format, and `gateway`,
the running gateway a module's tests share (what it runs: the module's `gateway_options`).

Order: with `-n 4` each module runs whole on one test process (pyproject's addopts), handed out in
collection order; a long module handed out last would keep its process busy after the others are
done. So the modules that take longest (LONGEST_MODULES, slowest first) are collected first.

Ctrl-C: tests send SIGINT to the commands they start, as a user's Ctrl-C. A run started in the
background by a non-interactive shell (`cmd &` in a script) inherits SIGINT ignored, children keep
an ignored signal across exec, and a Python child then never raises KeyboardInterrupt; so this
process handles SIGINT as Python does by default, and the commands it starts get the default.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.helpers.gateway_options import GatewayOptions, close_client

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, database=None)
    if os.environ.get("CI") == "true":
        settings.load_profile("ci")


# Slowest first, by the seconds each took with -n 3 on a loaded 2-core machine (CI's main tier, with
# the other tiers' setups running beside it), rounded: a module that grows or shrinks a lot moves.
LONGEST_MODULES = (
    "tests/integration/test_bench_loop.py",  # 300-360: three `polar train` runs
    "tests/e2e/test_train_long_prompts.py",  # 230-300
    "tests/integration/test_train.py",  # 200-320: the learning run, once or twice
    "tests/integration/test_cli.py",  # 310-370
    "tests/integration/test_rollout_node.py",  # 330
    "tests/integration/test_megatron_backend.py",  # 290
    "tests/integration/test_security.py",  # 250
    "tests/integration/test_swe_cli.py",  # 250
    "tests/integration/test_megatron_lora.py",  # 220
    "tests/e2e/test_train_harnesses.py",  # 150-190
    "tests/integration/test_train_join.py",  # 170
    "tests/integration/test_constrained_decoding.py",  # 160
    "tests/e2e/test_rollout_harnesses.py",  # 160
    "tests/e2e/test_harness_clis.py",  # 150
    "tests/integration/test_train_resume.py",  # 130
    "tests/integration/test_train_megatron.py",  # 130
    "tests/integration/test_cli_rollout.py",  # 130
    "tests/e2e/test_swe_rollout.py",  # 110-130
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_MODULES)}
    # A stable sort: each module's tests stay together and in their order, the other modules too.
    items.sort(key=lambda item: rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank)))


@pytest.fixture(scope="session")
def anyio_backend() -> Iterator[str]:
    """asyncio, on one loop: AnyIO's test runner (and its loop) stays open while this fixture is."""
    from anyio.pytest_plugin import get_runner

    with get_runner("asyncio", {}):
        yield "asyncio"


@pytest.fixture(scope="session", autouse=True)
def polar_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The state folder of every `polar up` the tests start (its credentials: polar.credentials), a
    temporary one of this run's rather than the user's; the `polar` commands they run find it too."""
    folder = str(tmp_path_factory.mktemp("polar-state"))
    previous = os.environ.get("POLAR_STATE_DIR")
    os.environ["POLAR_STATE_DIR"] = folder
    yield folder
    if previous is None:
        os.environ.pop("POLAR_STATE_DIR", None)
    else:
        os.environ["POLAR_STATE_DIR"] = previous


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (the `tiny` model's), loaded once per session."""
    from transformers import AutoTokenizer

    from polar.inference.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


@pytest.fixture(scope="module")
def hermes(smollm2_tokenizer):
    """The hermes chat format over the `tiny` model's tokenizer."""
    from gateway.chat_format import get_chat_format

    return get_chat_format("hermes", smollm2_tokenizer)


@pytest.fixture(scope="module")
def gateway_options() -> GatewayOptions:
    """What the module's `gateway` runs: a module that uses `gateway` overrides this fixture."""
    raise pytest.UsageError("a module that uses the `gateway` fixture defines `gateway_options` (tests/conftest.py)")


@pytest.fixture(scope="module")
async def gateway(gateway_options: GatewayOptions) -> AsyncIterator:
    """A real gateway over a real inference server (polar.testing.gateway.running_gateway), started
    once for the module's tests as its `gateway_options` say; the module's clients are closed after
    its last test."""
    # Imported here: the gateway's modules take seconds to import, which runs without it never pay.
    from polar.testing.gateway import running_gateway

    options = gateway_options
    async with running_gateway(
        options.script, engine=options.engine, envoy=options.envoy, stop_engine=options.stop_engine
    ) as running:
        yield running
        while options.clients:
            await close_client(options.clients.pop())
