"""Who serves behind Envoy: the upstreams that joined (inference servers, gateways' HTTP listeners),
turned into every Envoy's snapshot on each change.

An upstream joins (an id and a secret that proves it; only the secret's hash is kept), beats, and
leaves in two steps: draining (its endpoint DRAINING, so Envoy sends it no new calls while its
streams finish), then gone (removed). One silent for the timeout is removed as dead. Membership is
soft state: a restarted control plane knows none, and each upstream's next heartbeat is told to
join again. So that Envoys keep their last endpoints meanwhile rather than being told of an empty
set, a membership tells Envoys nothing until its upstreams have reconnected and beaten (`warm_up_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from polar.xds.member import REJOIN_BOUND_S
from polar.xds.server import AggregatedDiscovery, accepted_snapshot
from polar.xds.snapshot import CLUSTERS, ENDPOINT_TYPE, Snapshot, SnapshotCache, Upstream, assignments

log = logging.getLogger("polar.xds")

SECRET_BYTES = 32


class UnknownUpstream(LookupError):
    """An id the membership does not know (never joined, removed, or a restarted control plane)."""


class WrongUpstreamSecret(PermissionError):
    """A heartbeat whose secret is not its id's."""


class BadUpstream(ValueError):
    """A join that names an unknown cluster or an address that is not HOST:PORT."""


@dataclass
class Member:
    upstream_id: str
    upstream: Upstream
    secret_hash: bytes
    heard: float  # monotonic time of its latest heartbeat
    credential: str = ""  # the name of the issued credential it joined with; "" = the stack's own
    credential_role: str = ""  # that credential's role; "" = a control plane that checks none


class Membership:
    """The upstreams, and the ADS servicer whose Envoys are told about them."""

    def __init__(
        self,
        heartbeat_interval_s: float,
        timeout_s: float,
        cache: SnapshotCache | None = None,
        clock: Callable[[], float] = time.monotonic,
        warm_up_s: float | None = None,
    ) -> None:
        """`warm_up_s`: how long after `start` Envoys are first told anything (None: two heartbeat
        intervals, and at least an upstream's reconnection and one interval more; 0: at once,
        without `start`)."""
        self.heartbeat_interval_s = heartbeat_interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._members: dict[str, Member] = {}
        self.discovery = AggregatedDiscovery(cache or SnapshotCache(), self.resources_for)
        if warm_up_s is None:
            # Two intervals alone were shorter than a reconnection when the interval is short (0.4 s
            # at 0.2 s): Envoys were then told of an empty set before the upstreams were back.
            warm_up_s = max(2 * heartbeat_interval_s, REJOIN_BOUND_S + heartbeat_interval_s)
        self.warm_up_s = warm_up_s
        self._warm = self.warm_up_s == 0
        self._reaper: asyncio.Task | None = None

    # -- what Envoys are told -------------------------------------------------------------------

    def resources_for(self, envoy_id: str) -> dict[str, dict[str, bytes]] | None:
        """What Envoy `envoy_id` is told; None while warming up (upstreams are still joining)."""
        if not self._warm:
            return None
        return {ENDPOINT_TYPE: assignments((m.upstream for m in self._members.values()), envoy_id)}

    # -- joining and leaving --------------------------------------------------------------------

    async def join(
        self, cluster: str, address: str, envoy: str = "", credential: str = "", credential_role: str = ""
    ) -> tuple[str, str]:
        """A new upstream; its id and secret. BadUpstream when the cluster is unknown or the address
        is not HOST:PORT or does not resolve (EDS endpoints are IP addresses: a name is resolved
        here, once). A `credential` issued by name holds one upstream per cluster: its earlier one
        there is removed; `credential_role` is kept for status."""
        if cluster not in CLUSTERS:
            raise BadUpstream(f"cluster: {cluster!r} is not one of {', '.join(CLUSTERS)}")
        host, port = split_address(address)
        try:
            resolved = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise BadUpstream(f"address: {host!r} does not resolve: {exc.strerror or exc}") from None
        host = resolved[0][4][0]
        upstream_id = f"{'inference' if cluster == CLUSTERS[0] else 'gateway'}-{uuid.uuid4().hex[:12]}"
        secret = secrets.token_hex(SECRET_BYTES)
        upstream = Upstream(cluster, host, port, envoy=envoy)
        if credential:
            for earlier in [
                m for m in self._members.values() if (m.credential, m.upstream.cluster) == (credential, cluster)
            ]:
                self._members.pop(earlier.upstream_id)
                log.info("%s (credential %s) replaced by a new join", earlier.upstream_id, credential)
        self._members[upstream_id] = Member(
            upstream_id, upstream, _hash(secret), self._clock(), credential, credential_role
        )
        log.info("%s joined %s at %s%s", upstream_id, cluster, address, f" (for Envoy {envoy})" if envoy else "")
        self.discovery.publish()
        return upstream_id, secret

    def heartbeat(
        self, upstream_id: str, secret: str, draining: bool = False, gone: bool = False, credential: str = ""
    ) -> Member | None:
        """Record a sign of life (and a step of leaving) sent with `credential` (its issued name);
        the member, or None once it is gone."""
        member = self._members.get(upstream_id)
        if member is None:
            raise UnknownUpstream(upstream_id)
        if not hmac.compare_digest(member.secret_hash, _hash(secret)):
            raise WrongUpstreamSecret(f"the secret is not {upstream_id}'s")
        if credential != member.credential:
            raise WrongUpstreamSecret(f"{upstream_id} joined with another credential")
        member.heard = self._clock()
        if gone:
            self._remove(upstream_id, "left")
            return None
        if draining and not member.upstream.draining:
            member.upstream = replace(member.upstream, draining=True)
            log.info("%s is draining", upstream_id)
            self.discovery.publish()
        return member

    def members(self) -> list[Member]:
        return list(self._members.values())

    def seconds_since_heartbeat(self, member: Member) -> float:
        return self._clock() - member.heard

    def drain_acknowledged(self, member: Member) -> bool:
        """Every connected Envoy that sends to `member` has acknowledged a snapshot in which it is
        draining or absent."""
        for envoy in self.discovery.envoys.values():
            if not envoy.connected or member.upstream.envoy not in ("", envoy.node_id):
                continue
            snapshot = accepted_snapshot(envoy)
            if snapshot is None or takes_new_calls(snapshot, member.upstream):
                return False
        return True

    def remove_silent(self) -> list[str]:
        """Remove every upstream silent for longer than the timeout; their ids."""
        now = self._clock()
        dead = [m.upstream_id for m in self._members.values() if now - m.heard > self.timeout_s]
        for upstream_id in dead:
            self._remove(upstream_id, f"sent no heartbeat for {self.timeout_s:g} s: removed as dead")
        return dead

    def remove_revoked(self, issued: set[str]) -> list[str]:
        """Remove every upstream that joined with a named credential no longer in `issued`; their ids."""
        revoked = [m.upstream_id for m in self._members.values() if m.credential and m.credential not in issued]
        for upstream_id in revoked:
            self._remove(upstream_id, f"its credential {self._members[upstream_id].credential} was revoked: removed")
        return revoked

    def _remove(self, upstream_id: str, why: str) -> None:
        member = self._members.pop(upstream_id)
        log.info(
            "%s (%s %s:%d) %s", upstream_id, member.upstream.cluster, member.upstream.host, member.upstream.port, why
        )
        self.discovery.publish()

    # -- the dead-upstream check -----------------------------------------------------------------

    def start(self) -> None:
        """Check for dead upstreams from now on; tell Envoys once the warm-up is over."""
        self._reaper = asyncio.create_task(self._reap(), name="xds dead-upstream check")

    async def stop(self) -> None:
        self.discovery.close()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    async def _reap(self) -> None:
        await asyncio.sleep(self.warm_up_s)
        self._warm = True
        self.discovery.publish()
        while True:
            await asyncio.sleep(min(self.timeout_s / 4, 0.5))
            self.remove_silent()


def takes_new_calls(snapshot: Snapshot, upstream: Upstream) -> bool:
    """Whether `upstream` is in `snapshot` and not draining there."""
    value = snapshot.resources.get(ENDPOINT_TYPE, {}).get(upstream.cluster)
    if value is None:
        return False
    assignment = endpoint_pb2.ClusterLoadAssignment.FromString(value)
    for locality in assignment.endpoints:
        for lb in locality.lb_endpoints:
            address = lb.endpoint.address.socket_address
            if (address.address, address.port_value) == (upstream.host, upstream.port):
                return lb.health_status != health_check_pb2.DRAINING
    return False


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT ("[v6]:port") as (host, port); BadUpstream saying what is wrong."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadUpstream(f"address: {address!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port)


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
