"""polar/grpc_server.py: a taken port is a clear OSError, not grpcio's RuntimeError; services run on
uvloop with grpc.aio working on it; a servicer's exceptions become status codes by its table; a
served service stops on cancellation; messages assembled already serialized go as they are, either way."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from polar.grpc_server import (
    InvalidArgument,
    Unavailable,
    add_servicer,
    bind,
    new_server,
    run_service,
    serve_until_stopped,
    set_serving,
    status_codes,
    stub_taking_bytes,
)

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


class _Aborted(Exception):
    pass


class _Context:
    """What status_codes needs of a grpc.aio.ServicerContext: abort, which raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class _Missing(LookupError):
    pass


class _MissingHere(_Missing):
    pass


@status_codes({_Missing: grpc.StatusCode.NOT_FOUND})
class _Servicer:
    async def Unary(self, request, context):
        raise request

    async def Stream(self, request, context):
        yield 1
        raise request

    async def helper(self, request, context):  # not an rpc: left as it is
        raise request


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (_Missing("no such thing"), grpc.StatusCode.NOT_FOUND),
        (_MissingHere("no such thing"), grpc.StatusCode.NOT_FOUND),  # a subclass takes its base's code
        (InvalidArgument("no such thing"), grpc.StatusCode.INVALID_ARGUMENT),  # every table has these
        (Unavailable("no such thing"), grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_a_servicer_s_exceptions_become_its_status_codes(error, code) -> None:
    with pytest.raises(_Aborted) as unary:
        await _Servicer().Unary(error, _Context())
    assert unary.value.args == (code, "no such thing")
    stream = _Servicer().Stream(error, _Context())
    assert await anext(stream) == 1
    with pytest.raises(_Aborted) as streamed:
        await anext(stream)
    assert streamed.value.args == (code, "no such thing")


async def test_other_exceptions_and_helpers_are_left_alone() -> None:
    with pytest.raises(KeyError):
        await _Servicer().Unary(KeyError("a bug"), _Context())
    with pytest.raises(_Missing):
        await _Servicer().helper(_Missing("not an rpc"), _Context())


async def test_serve_until_stopped_stops_when_cancelled() -> None:
    events = []

    async def stop() -> None:
        events.append("stopped")

    task = asyncio.create_task(serve_until_stopped("running", stop, lambda running: events.append(f"ready: {running}")))
    await asyncio.sleep(0.05)
    assert events == ["ready: running"]
    assert gc.get_freeze_count() > 0  # what starting made is out of the collections while it serves
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["ready: running", "stopped"]
    assert gc.get_freeze_count() == 0


class _AssemblingHealth(health_pb2_grpc.HealthServicer):
    """Answers "assembled" with bytes it serialized itself, anything else with a message."""

    async def Check(self, request, context):
        if request.service == "assembled":
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Watch(self, request, context):
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


async def test_servicers_and_stubs_send_bytes_they_serialized_as_they_are_and_messages_as_ever() -> None:
    server = grpc.aio.server()
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, _AssemblingHealth(), server)
    port = bind(server, "127.0.0.1:0", "the test server")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = stub_taking_bytes(health_pb2_grpc.HealthStub, channel)
            assembled = health_pb2.HealthCheckRequest(service="assembled").SerializeToString()
            assert (await stub.Check(assembled, timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
            message = health_pb2.HealthCheckRequest(service="other")
            assert (await stub.Check(message, timeout=10)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            statuses = [response.status async for response in stub.Watch(message, timeout=10)]
            assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
    finally:
        await server.stop(0)
