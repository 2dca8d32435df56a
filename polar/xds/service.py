"""`polar serve xds`: Envoy's control plane alone, apart from the rollout server, for Envoys and
upstreams whose endpoints should not depend on it (a rollout server restarted for an upgrade, or one
per experiment in front of a shared inference fleet).

It serves what the rollout server serves for the control plane, on one port: ADS (state of the
world, EDS for the inference and gateway clusters) and the rpcs upstreams join with (JoinUpstream,
UpstreamHeartbeat, ListUpstreams of RolloutService, so an inference server's `--rollout` or a node's
`[node] xds_address` may name it); every other RolloutService rpc is UNIMPLEMENTED. Credentials are
checked as on the rollout server (issued ones from `[xds] issued_credentials`, re-read on change,
a revoked one's upstreams removed and its ADS streams ended within a second); TLS and /metrics are the rollout server's too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from polar import credentials as creds
from polar.config import XdsConfig
from polar.credentials import INFERENCE, NODE, OPERATOR, TRAINER
from polar.grpc_server import bind, callers, new_server, serve_until_stopped, set_serving
from polar.metrics import MetricsEndpoint, control_plane_metrics, start_metrics
from polar.rollout.server import SERVICE_NAME, bind_tls
from polar.service_base import Ready, join_host_port
from polar.v1 import rollout_pb2
from polar.xds.membership import Membership
from polar.xds.rpcs import UpstreamRpcs
from polar.xds.server import ADS_SERVICE, AggregatedDiscovery

log = logging.getLogger("polar.xds")

STOP_GRACE_SECONDS = 2.0
REVOCATION_CHECK_S = 0.5  # how soon a revoked credential's upstreams leave every Envoy


@callers(
    {
        "JoinUpstream": (NODE, INFERENCE),
        "UpstreamHeartbeat": (NODE, INFERENCE),
        "ListUpstreams": (TRAINER, OPERATOR),
    }
)
class ControlPlane(UpstreamRpcs):
    """The upstreams' rpcs over a membership of its own."""

    def __init__(self, config: XdsConfig, credentials: creds.Credentials | None) -> None:
        if not config.upstream_timeout_s > config.heartbeat_interval_s:
            raise ValueError(
                f"upstream_timeout_s ({config.upstream_timeout_s}) must exceed heartbeat_interval_s"
                f" ({config.heartbeat_interval_s})"
            )
        self.membership = Membership(config.heartbeat_interval_s, config.upstream_timeout_s)
        self.membership.discovery.credentials = credentials
        self._credentials = credentials
        self._interval = config.heartbeat_interval_s
        self._revocations: asyncio.Task | None = None

    def handlers(self) -> grpc.GenericRpcHandler:
        """The three rpcs as RolloutService's (the generated add_… would want all of its rpcs)."""

        def unary(method, request, response) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method, request_deserializer=request.FromString, response_serializer=response.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "JoinUpstream": unary(
                    self.JoinUpstream, rollout_pb2.JoinUpstreamRequest, rollout_pb2.JoinUpstreamResponse
                ),
                "UpstreamHeartbeat": unary(
                    self.UpstreamHeartbeat, rollout_pb2.UpstreamHeartbeatRequest, rollout_pb2.UpstreamHeartbeatResponse
                ),
                "ListUpstreams": unary(
                    self.ListUpstreams, rollout_pb2.ListUpstreamsRequest, rollout_pb2.ListUpstreamsResponse
                ),
            },
        )

    def start(self) -> None:
        self.membership.start()
        if self._credentials is not None:
            self._revocations = asyncio.create_task(self._remove_revoked(), name="xds revoked credentials")

    async def stop(self) -> None:
        await self.membership.stop()
        if self._revocations is not None:
            self._revocations.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._revocations

    async def _remove_revoked(self) -> None:
        while True:
            await asyncio.sleep(REVOCATION_CHECK_S)
            try:
                self.remove_revoked_upstreams()
            except Exception:
                log.exception("checking for revoked credentials failed")  # the next round retries


@dataclass
class RunningControlPlane:
    server: grpc.aio.Server
    control_plane: ControlPlane
    host: str
    port: int
    tls_port: int = 0
    metrics: MetricsEndpoint | None = None

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)

    async def stop(self, grace: float = 1.0) -> None:
        if self.metrics is not None:
            await self.metrics.stop()
        await self.control_plane.stop()
        await self.server.stop(grace)


async def start_xds_server(config: XdsConfig) -> RunningControlPlane:
    """Serve the control plane on config's host and port (0 picks one), and its TLS listener and
    /metrics where config asks."""
    checked = creds.of_process()
    if checked is not None:
        checked.issued.watch(creds.issued_path(checked.folder, config.issued_credentials))
    control_plane = ControlPlane(config, checked)
    server, health_servicer = new_server(
        SERVICE_NAME, ControlPlane.roles, credentials=checked, more_services={ADS_SERVICE: AggregatedDiscovery.roles}
    )
    server.add_generic_rpc_handlers((control_plane.handlers(),))
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(control_plane.membership.discovery, server)
    port = bind(server, join_host_port(config.host, config.port), "the control plane")
    tls_port = bind_tls(server, config) if config.tls_cert or config.tls_key or config.tls_address else 0
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
    control_plane.start()
    running = RunningControlPlane(server, control_plane, config.host, port, tls_port)
    if config.metrics_address:
        running.metrics = await start_metrics(config.metrics_address, control_plane_metrics(control_plane.membership))
    return running


async def serve_xds(config: XdsConfig, ready: Ready) -> None:
    """`polar serve xds`: serve until SIGINT/SIGTERM, then stop."""
    running = await start_xds_server(config)

    def on_ready(r: RunningControlPlane) -> None:
        tls = f"; TLS on port {r.tls_port}" if r.tls_port else ""
        metrics = f"; metrics {r.metrics.url}" if r.metrics else ""
        ready(r.port, f"xds: Envoy's control plane (ADS, JoinUpstream) on {r.address}{tls}{metrics}")

    await serve_until_stopped(running, lambda: running.stop(STOP_GRACE_SECONDS), on_ready)
