"""What every Polar gRPC server shares: no SO_REUSEPORT, health checking, reflection, a clear bind
error, running until SIGINT or SIGTERM, and the event loop its process runs on.

    server, health_servicer = new_server(SERVICE_NAME, max_message_bytes=...)
    add_MyServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0", "the rollout server")
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any

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
