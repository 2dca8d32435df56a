"""An upstream's side of membership: join the control plane (the rollout server's JoinUpstream),
beat while serving, and leave gracefully.

    member = UpstreamMember(rollout, "inference", "10.0.0.7:50051")
    await member.start()          # joined: every Envoy sends to it within a second
    ...
    await member.drain()          # DRAINING, until every Envoy acknowledged it (bounded)
    ...                           # the server lets its streams in flight finish
    await member.leave()          # removed

A control plane that forgot it (restarted, or it was silent too long) is joined again on the next
beat. An inference server calls with its machine's inference credential where it has one, and
admits from then on the callers the control plane lists with each answer (`accepted_credentials`:
the stack's own tokens and every credential issued to a machine, as hashes), so a node another
machine runs reaches it with its own credential, and a revoked one no longer does. A rollout server that cannot be reached is retried, never fatal: Envoy keeps its last
endpoints meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from polar import credentials
from polar.service_base import ServiceError
from polar.v1 import rollout_pb2, rollout_pb2_grpc
from polar.xds.snapshot import INFERENCE_CLUSTER

log = logging.getLogger("polar.xds.member")

CALL_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 30.0  # a starting service waits this long for the rollout server to answer its join
# Longest a leaving upstream waits for every Envoy to acknowledge its draining (they answer within
# milliseconds; a stack's services get 10 s to stop, the streams in flight need the rest).
DRAIN_TIMEOUT_S = 3.0
DRAIN_POLL_S = 0.05
# A restarted control plane is reached again within a second (gRPC's own back-off grows to 2 minutes):
# until the upstream joins it again, Envoys wait for it (Membership's warm-up outlasts REJOIN_BOUND_S).
RECONNECT_MAX_BACKOFF_S = 1.0
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_BACKOFF_S * 1000)),
)
# Longest from a control plane's start until an upstream's channel tries it again: the largest back-off
# and gRPC's jitter of up to 20% on it. The upstream's next beat then joins it again.
REJOIN_BOUND_S = 1.2 * RECONNECT_MAX_BACKOFF_S


class UpstreamMember:
    def __init__(self, rollout_address: str, cluster: str, address: str, envoy: str = "", tls_ca: str = "") -> None:
        """`tls_ca`: the PEM CA certificate of the rollout server's TLS listener ("" = plaintext)."""
        self.cluster, self.address, self.envoy = cluster, address, envoy
        self._address = rollout_address
        self._channel = credentials.aio_channel(rollout_address, tls_ca, options=RECONNECT_OPTIONS)
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)
        own = credentials.of_process()
        self._credentials = own
        role = credentials.INFERENCE if cluster == INFERENCE_CLUSTER else credentials.NODE
        self._credential = credentials.metadata(credentials.call_role(own, role), own)
        self._id = self._secret = ""
        self._interval = 1.0
        self._draining = False
        self._beats: asyncio.Task | None = None

    async def start(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Join, waiting up to timeout_s for the rollout server, and beat in the background.
        ServiceError saying why when it cannot join (unreachable, or the join refused)."""
        try:
            await self._join(wait_s=timeout_s)
        except grpc.RpcError as exc:
            await self._channel.close()
            raise ServiceError(
                f"cannot join Envoy's control plane at {self._address} as {self.cluster} {self.address}:"
                f" {exc.code().name}: {exc.details()}"
            ) from None
        self._beats = asyncio.create_task(self._beat_forever(), name=f"{self.cluster} upstream heartbeat")

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Mark it DRAINING and wait until every Envoy has acknowledged that (True), or timeout_s (False)."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (remaining := deadline - loop.time()) > 0:
            with contextlib.suppress(grpc.RpcError, TimeoutError):
                if (await asyncio.wait_for(self._beat(), remaining)).drain_acknowledged:
                    return True
            await asyncio.sleep(DRAIN_POLL_S)
        log.warning("not every Envoy acknowledged that %s %s drains within %g s", self.cluster, self.address, timeout_s)
        return False

    async def leave(self) -> None:
        """Removed from every Envoy (best effort: a control plane that is gone removes it on its timeout)."""
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        if self._id:
            request = rollout_pb2.UpstreamHeartbeatRequest(
                upstream_id=self._id, upstream_secret=self._secret, gone=True
            )
            with contextlib.suppress(grpc.RpcError):
                await self._stub.UpstreamHeartbeat(request, timeout=CALL_TIMEOUT_S, metadata=self._credential)
        await self._channel.close()

    async def _join(self, wait_s: float = CALL_TIMEOUT_S) -> None:
        request = rollout_pb2.JoinUpstreamRequest(cluster=self.cluster, address=self.address, envoy=self.envoy)
        response = await self._stub.JoinUpstream(
            request, timeout=wait_s, metadata=self._credential, wait_for_ready=True
        )
        self._id, self._secret = response.upstream_id, response.upstream_secret
        self._interval = response.heartbeat_interval_seconds or self._interval
        self._learn(response.accepted_credentials)
        log.info("joined the control plane's %s cluster as %s (%s)", self.cluster, self._id, self.address)

    async def _beat(self) -> rollout_pb2.UpstreamHeartbeatResponse:
        request = rollout_pb2.UpstreamHeartbeatRequest(
            upstream_id=self._id, upstream_secret=self._secret, draining=self._draining
        )
        response = await self._stub.UpstreamHeartbeat(request, timeout=CALL_TIMEOUT_S, metadata=self._credential)
        if response.rejoin:
            await self._join()
            if self._draining:
                return await self._beat()
        else:
            self._learn(response.accepted_credentials)
        return response

    def _learn(self, accepted) -> None:
        # A server that checks no credentials tells none; this process then admits what it did.
        if self.cluster == INFERENCE_CLUSTER and self._credentials is not None and accepted:
            self._credentials.issued.learn(
                [credentials.IssuedCredential(entry.name, entry.role, entry.sha256) for entry in accepted]
            )

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval / 2)
            try:
                await self._beat()
            except grpc.RpcError as exc:
                log.warning("heartbeat to the control plane failed (%s); retrying", exc.code().name)
