"""What every Polar gRPC server shares: no SO_REUSEPORT, health checking, reflection, a clear bind
error, typed exceptions turned into status codes in one place, serving until SIGINT or SIGTERM, and
the event loop its process runs on.

    @status_codes({UnknownTask: grpc.StatusCode.NOT_FOUND})   # + InvalidArgument, Unavailable
    class MyServicer(my_pb2_grpc.MyServiceServicer): ...      # rpcs raise; none calls context.abort

    server, health_servicer = new_server(SERVICE_NAME, max_message_bytes=...)
    add_MyServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0", "the rollout server")
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
    await serve_until_stopped(running, running.stop, on_ready)   # `polar serve …`
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def new_server(service_name: str, *, max_message_bytes: int = 0) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with health checking and reflection for `service_name` (a full name, e.g.
    "polar.v1.RolloutService"); `max_message_bytes` > 0 raises both message limits to it."""
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would silently share its
    # traffic instead of failing to bind.
    options = [("grpc.so_reuseport", 0)]
    if max_message_bytes:
        options += [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    server = grpc.aio.server(options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, health_servicer


def bind(server: grpc.aio.Server, address: str, what: str) -> int:
    """Listen on `address` ("host:port", port 0 for a free one); the bound port. OSError naming
    `what` and the address when it cannot bind (grpcio itself raises a RuntimeError that says only
    to turn on debug logging)."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {what} to {address}: the port is taken or the address is not this machine's")
    return port


async def set_serving(health_servicer: health.aio.HealthServicer, service_name: str) -> None:
    """Report SERVING overall and for the service."""
    for service in ("", service_name):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)


async def until_stop_signal() -> None:
    """Return once SIGINT or SIGTERM reaches this process (how every `polar serve …` ends); the
    handlers are removed again on the way out, also when the wait is cancelled."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


class InvalidArgument(ValueError):
    """A request a servicer refuses as malformed (INVALID_ARGUMENT); the message says what is wrong."""


class Unavailable(RuntimeError):
    """The service cannot answer now, e.g. while it stops (UNAVAILABLE); the client may retry."""


# Every servicer's table starts from these.
COMMON_STATUS_CODES: Mapping[type[BaseException], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_codes(table: Mapping[type[BaseException], grpc.StatusCode]):
    """Class decorator for a servicer: an exception of a type in `table` (or COMMON_STATUS_CODES;
    the most specific class wins) that leaves one of its rpcs (methods named in CamelCase) ends the
    call with that status code and the exception's message. Anything else is a bug and reaches the
    client as UNKNOWN, as grpc does by default."""
    codes = {**COMMON_STATUS_CODES, **table}

    def decorate(cls: type) -> type:
        for name, method in list(vars(cls).items()):
            if name[:1].isupper() and inspect.isfunction(method):
                setattr(cls, name, _with_status_codes(method, codes))
        return cls

    return decorate


def _with_status_codes(method: Callable, codes: Mapping[type[BaseException], grpc.StatusCode]) -> Callable:
    handled = tuple(codes)

    def code(exc: BaseException) -> grpc.StatusCode:
        return next(codes[cls] for cls in type(exc).__mro__ if cls in codes)

    if inspect.isasyncgenfunction(method):  # server-streaming, written as a generator

        @functools.wraps(method)
        async def stream(self, request, context: grpc.aio.ServicerContext):
            try:
                async for response in method(self, request, context):
                    yield response
            except handled as exc:
                await context.abort(code(exc), str(exc))

        return stream

    @functools.wraps(method)
    async def call(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except handled as exc:
            await context.abort(code(exc), str(exc))

    return call


Running = TypeVar("Running")


async def serve_until_stopped(
    running: Running, stop: Callable[[], Awaitable[Any]], on_ready: Callable[[Running], None] | None = None
) -> None:
    """How every `polar serve …` ends: with `running` started, tell `on_ready`, wait for SIGINT or
    SIGTERM (or cancellation), then `stop()`, which runs whatever happens."""
    try:
        if on_ready is not None:
            on_ready(running)
        await until_stop_signal()
    finally:
        await stop()


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service process's main coroutine to its end, on uvloop where it is installed.

    libuv's loop costs less per callback and per socket write than asyncio's own, which tells in the
    gateway: it takes a loop turn per streamed token. grpc.aio runs on any asyncio loop. The node
    starts its children with subprocess.Popen (polar.rollout.process), never the loop's
    subprocess_exec: uvloop's spawns them with fork(), which runs gRPC's fork handlers in the parent.
    """
    with asyncio.Runner(loop_factory=_uvloop_factory()) as runner:
        runner.run(main)


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # not on every platform (no Windows build)
        return None
    return uvloop.new_event_loop
