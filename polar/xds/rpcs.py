"""The rpcs upstreams join Envoy's control plane with (JoinUpstream, UpstreamHeartbeat,
ListUpstreams of rollout.proto's RolloutService), shared by the rollout server, which serves the
control plane beside its own rpcs, and `polar serve xds`, which serves it alone (polar.xds.service).

A credential issued by name (polar.credentials) joins only as that name, only the cluster its role
serves, and its heartbeats must carry it; the stack's own node token joins only from the control
plane's machine. Inference servers are told, with each answer, the hashes of the credentials that may
call them.
"""

from __future__ import annotations

import grpc

from polar import credentials as creds
from polar.credentials import INFERENCE, NODE
from polar.grpc_server import caller, peer_is_this_machine, status_codes
from polar.service_base import join_host_port
from polar.v1 import rollout_pb2
from polar.xds.membership import BadUpstream, Membership, UnknownUpstream, WrongUpstreamSecret
from polar.xds.snapshot import GATEWAY_CLUSTER, INFERENCE_CLUSTER


class WrongCredential(PermissionError):
    """A call whose credential may not do what it asks: the stack's own node token from another
    machine, a named credential joining a cluster its role does not serve, or a heartbeat for a node
    or upstream that another credential registered."""


# The cluster each issued role may join.
CLUSTER_OF_ROLE = {NODE: GATEWAY_CLUSTER, INFERENCE: INFERENCE_CLUSTER}


def credential_fields(who: creds.Caller | None) -> dict[str, str]:
    """The `credential` and `credential_role` fields of NodeInfo, UpstreamInfo and EnvoyInfo for a
    caller (None: a server that checks no credentials)."""
    return {"credential": who.name, "credential_role": who.role} if who is not None else {}


@status_codes(
    {
        BadUpstream: grpc.StatusCode.INVALID_ARGUMENT,
        WrongUpstreamSecret: grpc.StatusCode.PERMISSION_DENIED,
        WrongCredential: grpc.StatusCode.PERMISSION_DENIED,
    }
)
class UpstreamRpcs:
    """The control plane's rpcs, for a RolloutService servicer that sets `membership`,
    `_credentials` (None: every caller served) and `_interval` (the heartbeat interval, seconds)."""

    membership: Membership
    _credentials: creds.Credentials | None
    _interval: float

    # Unary.
    async def JoinUpstream(
        self, request: rollout_pb2.JoinUpstreamRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.JoinUpstreamResponse:
        who = caller(self._credentials, context)
        name = self._caller_name(context)
        if name and request.cluster != CLUSTER_OF_ROLE.get(who.role):
            raise WrongCredential(f"credential {name} ({who.role}) may not join the {request.cluster!r} cluster")
        upstream_id, secret = await self.membership.join(
            request.cluster, request.address, request.envoy, credential=name, credential_role=who.role if who else ""
        )
        return rollout_pb2.JoinUpstreamResponse(
            upstream_id=upstream_id,
            upstream_secret=secret,
            heartbeat_interval_seconds=self._interval,
            accepted_credentials=self._accepted(request.cluster),
        )

    # Unary.
    async def UpstreamHeartbeat(
        self, request: rollout_pb2.UpstreamHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpstreamHeartbeatResponse:
        who = caller(self._credentials, context)
        try:
            member = self.membership.heartbeat(
                request.upstream_id,
                request.upstream_secret,
                draining=request.draining,
                gone=request.gone,
                credential=who.name if who is not None else "",
            )
        except UnknownUpstream:
            return rollout_pb2.UpstreamHeartbeatResponse(rejoin=not request.gone)
        drained = member is None or (member.upstream.draining and self.membership.drain_acknowledged(member))
        accepted = self._accepted(member.upstream.cluster) if member is not None else []
        return rollout_pb2.UpstreamHeartbeatResponse(drain_acknowledged=drained, accepted_credentials=accepted)

    # Unary.
    async def ListUpstreams(
        self, request: rollout_pb2.ListUpstreamsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ListUpstreamsResponse:
        membership = self.membership
        discovery = membership.discovery
        return rollout_pb2.ListUpstreamsResponse(
            upstreams=[
                rollout_pb2.UpstreamInfo(
                    upstream_id=m.upstream_id,
                    cluster=m.upstream.cluster,
                    address=join_host_port(m.upstream.host, m.upstream.port),
                    envoy=m.upstream.envoy,
                    draining=m.upstream.draining,
                    seconds_since_heartbeat=membership.seconds_since_heartbeat(m),
                    **credential_fields(creds.Caller(m.credential_role, m.credential) if m.credential_role else None),
                )
                for m in membership.members()
            ],
            envoys=[
                rollout_pb2.EnvoyInfo(
                    node_id=envoy.node_id,
                    connected=envoy.connected,
                    version=snapshot.version if (snapshot := discovery.cache.current(envoy.node_id)) else "",
                    acknowledged_version=envoy.endpoints().accepted,
                    rejected_version=envoy.endpoints().rejected,
                    error=envoy.endpoints().error,
                    **credential_fields(envoy.caller),
                )
                for envoy in discovery.envoys.values()
            ],
        )

    def _caller_name(self, context: grpc.aio.ServicerContext) -> str:
        """The issued name the caller registers or joins as ("" for the stack's own token, or a
        server that checks no credentials). WrongCredential for the stack's own node token from an
        address that is not this machine's: other machines get credentials of their own."""
        who = caller(self._credentials, context)
        if who is None:
            return ""
        if not who.name and who.role == NODE and not peer_is_this_machine(context.peer()):
            raise WrongCredential(
                f"the stack's own node credential is for the control plane's machine, not {context.peer()}:"
                " give another machine its own (`polar credentials issue NAME node|inference`)"
            )
        return who.name

    def _accepted(self, cluster: str) -> list[rollout_pb2.AcceptedCredential]:
        if cluster != INFERENCE_CLUSTER or self._credentials is None:
            return []
        return [
            rollout_pb2.AcceptedCredential(name=entry.name, role=entry.role, sha256=entry.sha256)
            for entry in self._credentials.accepted()
        ]

    def remove_revoked_upstreams(self) -> set[str]:
        """Remove the upstreams of credentials no longer issued, and end the ADS streams opened with
        them; the names still issued."""
        if self._credentials is None:
            return set()
        issued = self._credentials.issued.names()
        self.membership.remove_revoked(issued)
        self.membership.discovery.end_revoked(issued)
        return issued
