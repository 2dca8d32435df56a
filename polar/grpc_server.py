"""What every Polar gRPC server shares: no SO_REUSEPORT, health checking, reflection, a clear bind
error, typed exceptions turned into status codes in one place, serving until SIGINT or SIGTERM, and
the event loop its process runs on, and the one check of every caller's credential and role.

    @callers({"SubmitTasks": (TRAINER, OPERATOR), ...})       # every rpc: the roles that may call it
    @status_codes({UnknownTask: grpc.StatusCode.NOT_FOUND})   # + InvalidArgument, Unavailable
    class MyServicer(my_pb2_grpc.MyServiceServicer): ...      # rpcs raise; none calls context.abort

    server, health_servicer = new_server(SERVICE_NAME, MyServicer.roles, max_message_bytes=...)
    add_MyServiceServicer_to_server(servicer, server)   # or add_servicer(add_…, servicer, server)
    port = bind(server, "127.0.0.1:0", "the rollout server")
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
    await serve_until_stopped(running, running.stop, on_ready)   # `polar serve …`
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import ipaddress
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from polar import credentials as creds

log = logging.getLogger("polar.grpc_server")

_UNSET: Any = object()


def new_server(
    service_name: str,
    roles: Mapping[str, frozenset[str]] | None = None,
    *,
    max_message_bytes: int = 0,
    max_receive_bytes: int = 0,
    credentials: creds.Credentials | None = _UNSET,
    more_services: Mapping[str, Mapping[str, frozenset[str]]] | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with health checking and reflection for `service_name` (a full name, e.g.
    "polar.v1.RolloutService"); `max_message_bytes` > 0 raises both message limits to it, and
    `max_receive_bytes` > 0 then sets the receive limit alone.

    With `credentials` (default: the process's, $POLAR_CREDENTIALS) every call of the service must
    carry a role's token (else UNAUTHENTICATED) and that role must be among `roles[rpc]` (the
    servicer's `callers` table; an rpc not in it is no role's: PERMISSION_DENIED). Health checking
    and reflection stay open. Without credentials every caller is served (`polar serve NAME` alone
    says so when it is ready). `more_services` are further services of the same server, each by its
    full name with its servicer's `callers` table, checked the same way."""
    if credentials is _UNSET:
        credentials = creds.of_process()
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would silently share its
    # traffic instead of failing to bind.
    options = [("grpc.so_reuseport", 0)]
    if max_message_bytes:
        options.append(("grpc.max_send_message_length", max_message_bytes))
    if max_receive_bytes or max_message_bytes:
        options.append(("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes))
    interceptors = []
    if credentials is not None:
        interceptors.append(CallerCheck({service_name: roles or {}, **(more_services or {})}, credentials))
    else:
        log.info("%s serves every caller: no credentials ($%s unset)", service_name, creds.ENV_VAR)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (service_name, *(more_services or {}), health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
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


# --------------------------------------------------------------------------------- callers


def callers(table: Mapping[str, Collection[str]]):
    """Class decorator for a servicer: the roles (polar.credentials.ROLES) that may call each of its
    rpcs, kept as `cls.roles` for `new_server`. Every rpc of the class must be listed, and only
    those: a new rpc cannot be left open by omission."""
    roles = {rpc: frozenset(allowed) for rpc, allowed in table.items()}

    def decorate(cls: type) -> type:
        rpcs = {
            name for base in cls.__mro__ for name, value in vars(base).items() if name[:1].isupper() and callable(value)
        }
        if missing := rpcs - set(roles):
            raise TypeError(f"{cls.__name__}: no callers declared for {', '.join(sorted(missing))}")
        if unknown := set(roles) - rpcs:
            raise TypeError(f"{cls.__name__}: callers declared for unknown rpcs {', '.join(sorted(unknown))}")
        if bad := {r for allowed in roles.values() for r in allowed} - set(creds.ROLES):
            raise TypeError(f"{cls.__name__}: unknown roles {', '.join(sorted(bad))}")
        cls.roles = roles
        return cls

    return decorate


OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})


class CallerCheck(grpc.aio.ServerInterceptor):
    """Every call of the `services` (full name -> the roles of each rpc) carries a role's token
    (`authorization: Bearer <token>`) and that role may call the rpc; health checking and
    reflection are open to all."""

    def __init__(self, services: Mapping[str, Mapping[str, frozenset[str]]], credentials: creds.Credentials) -> None:
        self._roles = {
            f"/{service}/{rpc}": allowed for service, roles in services.items() for rpc, allowed in roles.items()
        }
        self._credentials = credentials

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method
        allowed = self._roles.get(method)
        if allowed is None and method[1:].partition("/")[0] in OPEN_SERVICES:
            return await continuation(details)
        authorization = next((value for key, value in details.invocation_metadata or () if key == creds.HEADER), None)
        caller = self._credentials.caller_of(authorization)
        role = caller.role if caller is not None else None
        if role is not None and allowed is not None and role in allowed:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None  # an unknown method: grpc answers UNIMPLEMENTED
        service, _, rpc = method[1:].rpartition("/")
        if role is None:
            why = "no credential" if authorization is None else "a credential this stack did not issue"
            return _refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{service}.{rpc} was called with {why}: send the metadata `{creds.HEADER}: Bearer <token>`"
                f" with your role's token from {self._credentials.folder}/<node|trainer|operator> (`polar up`"
                f" writes them; `polar` commands read ${creds.ENV_VAR} or {creds.default_folder()}), or"
                " another machine's own credential (`polar credentials issue NAME ROLE`; a revoked one is refused)",
            )
        who = ", ".join(sorted(allowed or ())) or "no role"
        return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, f"{service}.{rpc} is for {who}, not the {role}")


def caller(credentials: creds.Credentials | None, context: grpc.aio.ServicerContext) -> creds.Caller | None:
    """Who made this call, for a servicer whose rpcs depend on the caller's name (None: a server
    without credentials, which serves everyone)."""
    if credentials is None:
        return None
    authorization = next((value for key, value in context.invocation_metadata() or () if key == creds.HEADER), None)
    return credentials.caller_of(authorization)


_THIS_MACHINE: dict[str, bool] = {}


def peer_is_this_machine(peer: str) -> bool:
    """Whether a call's peer (`context.peer()`: "ipv4:10.0.0.7:41234", "ipv6:[::1]:5", "unix:...")
    is an address of this machine: a loopback one, or one a socket here can bind."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host not in _THIS_MACHINE:
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = False
        if not local and host:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((host, 0))
                local = True
        _THIS_MACHINE[host] = local
    return _THIS_MACHINE[host]


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that ends the call with code and message."""

    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


# ------------------------------------------------------------------ already serialized messages


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """`add_to_server(servicer, server)` (a generated add_…Servicer_to_server), with every rpc free
    to answer with a message it assembled already serialized (bytes), which is sent as it is."""
    add_to_server(servicer, _ServerTakingBytes(server))


def stub_taking_bytes(stub_class: Callable[[Any], Stub], channel: grpc.aio.Channel) -> Stub:
    """`stub_class(channel)` (a generated stub) whose rpcs also take a request already serialized."""
    return stub_class(_ChannelTakingBytes(channel))


Stub = TypeVar("Stub")


def _unless_bytes(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    # A message a servicer or client assembled from serialized parts (polar.codec) goes as it is:
    # parsing it into a message only for gRPC to write it out again would undo the assembling.
    if serializer is None:
        return None

    def serialize(message: Any) -> bytes:
        return message if message.__class__ is bytes else serializer(message)

    return serialize


def _taking_bytes(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return handler._replace(response_serializer=_unless_bytes(handler.response_serializer))


class _HandlerTakingBytes(grpc.GenericRpcHandler):
    def __init__(self, handler: grpc.GenericRpcHandler) -> None:
        self._handler = handler

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._handler.service(handler_call_details)
        return None if handler is None else _taking_bytes(handler)


class _ServerTakingBytes:
    """A server as a generated add_…Servicer_to_server sees it: the handlers it adds take bytes."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Collection[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_HandlerTakingBytes(handler) for handler in handlers))

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, {name: _taking_bytes(h) for name, h in handlers.items()})


class _ChannelTakingBytes:
    """A channel as a generated stub sees it: the calls it makes take bytes."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def unary_unary(self, method: str, request_serializer=None, response_deserializer=None, **options):
        return self._channel.unary_unary(method, _unless_bytes(request_serializer), response_deserializer, **options)

    def unary_stream(self, method: str, request_serializer=None, response_deserializer=None, **options):
        return self._channel.unary_stream(method, _unless_bytes(request_serializer), response_deserializer, **options)

    def stream_unary(self, method: str, request_serializer=None, response_deserializer=None, **options):
        return self._channel.stream_unary(method, _unless_bytes(request_serializer), response_deserializer, **options)

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None, **options):
        return self._channel.stream_stream(method, _unless_bytes(request_serializer), response_deserializer, **options)


# --------------------------------------------------------------------------------- serving


Running = TypeVar("Running")


async def serve_until_stopped(
    running: Running, stop: Callable[[], Awaitable[Any]], on_ready: Callable[[Running], None] | None = None
) -> None:
    """How every `polar serve …` ends: with `running` started, tell `on_ready`, wait for SIGINT or
    SIGTERM (or cancellation), then `stop()`, which runs whatever happens.

    While it serves, what importing and starting made (modules, a tokenizer, the app: hundreds of
    thousands of objects in the gateway) is frozen: it lives as long as the service, and left in
    the collector's oldest generation every full collection that requests' garbage sets off would
    walk it again."""
    gc.freeze()
    try:
        if on_ready is not None:
            on_ready(running)
        await until_stop_signal()
    finally:
        gc.unfreeze()
        await stop()


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service process's main coroutine to its end, on uvloop where it is installed.

    libuv's loop costs less per callback and per socket write than asyncio's own, which tells in the
    gateway: it takes a loop turn per streamed token. grpc.aio runs on any asyncio loop. The node
    starts its children with subprocess.Popen (polar.app.node.process), never the loop's
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
