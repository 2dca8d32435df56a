"""One gateway process: the HTTP app and the GatewayService on one event loop, sharing one session store.

`start_gateway` asks the inference service (or Envoy in front of it) for the model, loads its
tokenizer once, and starts both servers, as a `GatewayConfig` says; `serve_gateway` (`polar serve
gateway`) runs them until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from aiohttp import web

from gateway.app import create_app
from gateway.body_store import SpillFolder
from gateway.chat_format import get_chat_format
from gateway.core import Gateway, InferenceClient, ModelSpec
from gateway.dialects.base import Dialect
from gateway.grpc_service import GatewayServicer, start_grpc
from gateway.parsers import get_output_parser
from gateway.sessions import SessionStore
from polar.config import GatewayConfig
from polar.grpc_server import serve_until_stopped
from polar.inference.tokenizer_files import load_tokenizer
from polar.metrics import MetricsEndpoint, gateway_metrics, start_metrics
from polar.service_base import Ready, ServiceError, connectable, join_host_port

# How long start-up waits for the inference service to answer GetModelInfo.
DEFAULT_STARTUP_TIMEOUT_S = 60.0
# How long a stop lets calls in flight finish before they are cancelled (and recorded as aborted).
STOP_GRACE_SECONDS = 5.0
# A closed session stays readable (GetSession, WatchSession) this long, then its records are dropped,
# so a gateway that runs for weeks does not keep every call it ever served. Nodes drop theirs as soon
# as the rollout server holds them.
CLOSED_SESSION_RETENTION_S = 3600.0
# How often idle sessions are expired and closed ones forgotten (at most).
SWEEP_INTERVAL_S = 60.0


class GatewayStartError(ServiceError):
    """The gateway cannot start (inference unreachable, no tokenizer); the message says why."""


@dataclass
class RunningGateway:
    """A started gateway; `stop()` ends it."""

    gateway: Gateway
    http_host: str
    http_port: int
    grpc_port: int
    base_url: str  # what harnesses use: the config's (Envoy's in the stack), else http_url
    _runner: web.AppRunner
    _grpc_server: grpc.aio.Server
    _sweeper: asyncio.Task
    metrics: MetricsEndpoint | None = None  # Prometheus /metrics ([gateway] metrics_address)

    @property
    def store(self) -> SessionStore:
        return self.gateway.store

    @property
    def http_url(self) -> str:
        """The gateway's own HTTP address (behind Envoy, what Envoy forwards to)."""
        return "http://" + join_host_port(connectable(self.http_host), self.http_port)

    @property
    def grpc_address(self) -> str:
        return join_host_port(connectable(self.http_host), self.grpc_port)

    async def stop(self) -> None:
        if self.metrics is not None:
            await self.metrics.stop()
        self._sweeper.cancel()
        await self._grpc_server.stop(STOP_GRACE_SECONDS)
        await self._runner.cleanup()
        await self.gateway.inference.close()
        self.store.spill.remove()


async def start_gateway(
    config: GatewayConfig,
    *,
    http_socket: socket.socket | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    dialects: Mapping[str, Dialect] | None = None,
) -> RunningGateway:
    """Both servers started and serving, as `config` says (its inference_address is required here;
    its tokenizer may also be a model alias such as "tiny"); ports 0 pick free ones; `dialects`
    override the registry's.

    `http_socket`, a listening socket bound by whoever had to know the port first, is served instead
    of binding config's host and port; the gateway owns it from then on and closes it when it stops.
    """
    host, inference_address = config.host, config.inference_address
    # What is undone, in reverse, should any step fail; nothing once all of them succeeded.
    async with contextlib.AsyncExitStack() as on_failure:
        if http_socket is not None:
            on_failure.callback(http_socket.close)
        if not inference_address:
            raise ValueError("the gateway needs an inference address (GatewayConfig.inference_address)")
        output_parser = get_output_parser(config.parser)  # unknown names fail before anything starts
        inference = InferenceClient(inference_address)
        on_failure.push_async_callback(inference.close)
        try:
            info = await inference.model_info(startup_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise GatewayStartError(
                f"no inference service answered on {inference_address} within {startup_timeout_s:g} s: {exc.details()}"
            ) from exc
        tokenizer = _load_tokenizer(config.tokenizer or info.tokenizer_path, info.name)
        store = SessionStore(
            config.history, max_body_bytes=config.max_session_body_bytes, spill=SpillFolder(config.body_spill_dir)
        )
        on_failure.callback(store.spill.remove)
        gateway = Gateway(
            store=store,
            inference=inference,
            model=ModelSpec(info.name, info.context_length, info.constrained_decoding),
            chat_format=get_chat_format(config.chat_format, tokenizer),
            parser=output_parser,
            tokenizer=tokenizer.backend_tokenizer,
            generate_timeout_s=config.generate_timeout_s,
            token_timeout_s=config.token_timeout_s,
            message_interval_s=config.message_interval_s,
        )
        runner = web.AppRunner(create_app(gateway, dialects), access_log=None, shutdown_timeout=STOP_GRACE_SECONDS)
        await runner.setup()
        on_failure.push_async_callback(runner.cleanup)
        if http_socket is not None:
            site: web.BaseSite = web.SockSite(runner, http_socket)
        else:
            site = web.TCPSite(runner, host, config.port, reuse_port=False)
        await site.start()
        bound_http = runner.addresses[0][1]
        base_url = config.base_url or "http://" + join_host_port(connectable(host), bound_http)
        servicer = GatewayServicer(gateway.store, base_url=base_url)
        grpc_server, bound_grpc = await start_grpc(servicer, join_host_port(host, config.grpc_port))
        on_failure.pop_all()
    sweeper = asyncio.create_task(_sweep_sessions(store, config.session_idle_timeout_s), name="session sweeper")
    running = RunningGateway(gateway, host, bound_http, bound_grpc, base_url, runner, grpc_server, sweeper)
    if config.metrics_address:
        try:
            running.metrics = await start_metrics(config.metrics_address, gateway_metrics(store))
        except BaseException:
            await running.stop()
            raise
    return running


async def _sweep_sessions(store: SessionStore, idle_timeout_s: float) -> None:
    # A short idle timeout is kept to within a quarter of itself.
    interval_s = min(SWEEP_INTERVAL_S, idle_timeout_s / 4)
    while True:
        await asyncio.sleep(interval_s)
        store.expire_idle(idle_timeout_s)
        store.forget_closed(CLOSED_SESSION_RETENTION_S)


async def serve_gateway(config: GatewayConfig, ready: Ready, http_socket: socket.socket | None = None) -> None:
    """`polar serve gateway`: serve until cancelled or SIGINT/SIGTERM, then stop gracefully; the
    config's base_url is reported to GetNodeStatus as the URL harnesses use."""
    running = await start_gateway(config, http_socket=http_socket)
    await serve_until_stopped(running, running.stop, lambda r: ready(r.grpc_port, f"gateway: {describe(r)}"))


def describe(running: RunningGateway) -> str:
    """What a started gateway serves, in one line."""
    from gateway.dialects import available_dialects

    dialects = ", ".join(available_dialects()) or "none"
    metrics = f"; metrics {running.metrics.url}" if running.metrics is not None else ""
    return (
        f"{running.gateway.model.name} at {running.http_url} ({dialects}); harness base URL {running.base_url}; "
        f"GatewayService on {join_host_port(running.http_host, running.grpc_port)}; "
        f"inference {running.gateway.inference.address}{metrics}"
    )


def _load_tokenizer(path: str, model: str):
    if not path:
        raise GatewayStartError(
            f"the inference service names no tokenizer for {model!r}; give the gateway one (--tokenizer)"
        )
    return load_tokenizer(path)
