"""polar/grpc_server.py: a taken port is a clear OSError, not grpcio's RuntimeError."""

from __future__ import annotations

import pytest

from polar.grpc_server import bind, new_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_taken_port_is_a_clear_error() -> None:
    first, _ = new_server("polar.v1.RolloutService")
    second, _ = new_server("polar.v1.RolloutService")
    port = bind(first, "127.0.0.1:0", "the first server")
    await first.start()
    try:
        with pytest.raises(OSError, match=rf"cannot bind the second server to 127\.0\.0\.1:{port}: the port is taken"):
            bind(second, f"127.0.0.1:{port}", "the second server")
    finally:
        await first.stop(0)
        await second.stop(0)
