"""polar/grpc_server.py: a taken port is a clear OSError, not grpcio's RuntimeError; services run on
uvloop with grpc.aio working on it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from polar.grpc_server import bind, new_server, run_service, set_serving

pytestmark = pytest.mark.anyio


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


def test_a_service_runs_on_uvloop_and_serves_grpc_on_it() -> None:
    uvloop = pytest.importorskip("uvloop")
    seen = {}

    async def main() -> None:
        seen["loop"] = asyncio.get_running_loop()
        server, health_servicer = new_server("polar.v1.RolloutService")
        port = bind(server, "127.0.0.1:0", "the test server")
        await set_serving(health_servicer, "polar.v1.RolloutService")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                request = health_pb2.HealthCheckRequest(service="polar.v1.RolloutService")
                seen["status"] = (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)).status
        finally:
            await server.stop(0)

    run_service(main())
    assert isinstance(seen["loop"], uvloop.Loop)
    assert seen["status"] == health_pb2.HealthCheckResponse.SERVING
