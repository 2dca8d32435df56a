"""Snapshots: what one Envoy is told, immutable and versioned, and the cache that keeps the latest
per Envoy.

A snapshot holds, per resource type, every resource by name as its serialized `Any` (bytes, so no
caller can change a snapshot after the fact), and one version for all of it. The cache versions
snapshots as `EPOCH.N`: EPOCH is fixed when the cache is made (the control plane's boot), N counts
changes of that Envoy's resources. A restarted control plane so never repeats a version an Envoy
acknowledged from its previous run, and a reconnecting Envoy is always answered; setting the same
resources again keeps the version (nothing is pushed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
INFERENCE_CLUSTER = "inference"  # the inference servers (envoy/envoy.yaml.tmpl)
GATEWAY_CLUSTER = "gateway_http"  # the gateway HTTP listener(s) an Envoy's harness listener forwards to
CLUSTERS = (INFERENCE_CLUSTER, GATEWAY_CLUSTER)
ANY_ENVOY = ""  # an upstream every Envoy sends to


@dataclass(frozen=True)
class Upstream:
    """One endpoint of a cluster, as the membership knows it."""

    cluster: str  # INFERENCE_CLUSTER or GATEWAY_CLUSTER
    host: str  # the address it advertises (an IP or a name Envoy resolves)
    port: int
    draining: bool = False  # leaving: finishes what it has, takes no new calls
    envoy: str = ANY_ENVOY  # the Envoy (its node id) that sends to it; ANY_ENVOY = every Envoy


@dataclass(frozen=True)
class Snapshot:
    """Every resource one Envoy is told, by type and name (serialized `Any.value`), at one version."""

    version: str
    resources: Mapping[str, Mapping[str, bytes]]

    def named(self, type_url: str, names: Iterable[str]) -> dict[str, bytes]:
        """The resources of a type by name: those in `names`, or all when `names` is empty (wildcard)."""
        of_type = self.resources.get(type_url, {})
        wanted = set(names)
        return {name: value for name, value in of_type.items() if not wanted or name in wanted}


def assignments(upstreams: Iterable[Upstream], envoy_id: str) -> dict[str, bytes]:
    """The serialized ClusterLoadAssignment of every cluster for the Envoy `envoy_id`: its upstreams
    (those for any Envoy and those for it), draining ones marked DRAINING so Envoy sends them no new
    calls while their streams finish. Every cluster is present, empty when nothing serves it, so an
    Envoy never waits for one. Endpoints are sorted: the same set is the same bytes."""
    by_cluster: dict[str, list[Upstream]] = {cluster: [] for cluster in CLUSTERS}
    for upstream in upstreams:
        if upstream.envoy in (ANY_ENVOY, envoy_id):
            by_cluster.setdefault(upstream.cluster, []).append(upstream)
    out = {}
    for cluster, members in by_cluster.items():
        endpoints = [
            endpoint_components_pb2.LbEndpoint(
                endpoint=endpoint_components_pb2.Endpoint(
                    address=address_pb2.Address(
                        socket_address=address_pb2.SocketAddress(address=u.host, port_value=u.port)
                    )
                ),
                health_status=health_check_pb2.DRAINING if u.draining else health_check_pb2.UNKNOWN,
            )
            for u in sorted(set(members), key=lambda u: (u.host, u.port, u.draining))
        ]
        assignment = endpoint_pb2.ClusterLoadAssignment(
            cluster_name=cluster, endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=endpoints)]
        )
        out[cluster] = assignment.SerializeToString(deterministic=True)
    return out


def boot_epoch() -> str:
    """This control plane's epoch: milliseconds since 1970 when it started, so a later start's
    versions never equal an earlier one's."""
    return str(time.time_ns() // 1_000_000)


@dataclass
class _Entry:
    snapshot: Snapshot
    changes: int
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class SnapshotCache:
    """The latest snapshot of each Envoy (by node id), and a way to wait for the next one.

    `set` replaces an Envoy's resources as a whole; the version moves only when they differ. A
    stream takes `changed(node)` before it reads `current(node)`, then waits on it, so no change
    is missed."""

    def __init__(self, epoch: str | None = None) -> None:
        self.epoch = epoch or boot_epoch()
        self._entries: dict[str, _Entry] = {}
        self._first: dict[str, asyncio.Event] = {}  # Envoys waiting for their first snapshot

    def set(self, node_id: str, resources: Mapping[str, Mapping[str, bytes]]) -> Snapshot:
        """Replace `node_id`'s resources; the snapshot now current (the same one when nothing changed)."""
        frozen = MappingProxyType({t: MappingProxyType(dict(r)) for t, r in resources.items()})
        entry = self._entries.get(node_id)
        if entry is not None and _same(entry.snapshot.resources, frozen):
            return entry.snapshot
        changes = entry.changes + 1 if entry is not None else 1
        snapshot = Snapshot(f"{self.epoch}.{changes}", frozen)
        if entry is None:
            self._entries[node_id] = _Entry(snapshot, changes)
            if (first := self._first.pop(node_id, None)) is not None:
                first.set()
        else:
            entry.snapshot, entry.changes = snapshot, changes
            entry.changed.set()
            entry.changed = asyncio.Event()
        return snapshot

    def current(self, node_id: str) -> Snapshot | None:
        entry = self._entries.get(node_id)
        return entry.snapshot if entry is not None else None

    def changed(self, node_id: str) -> asyncio.Event:
        """Set when `node_id`'s snapshot is next replaced (or first made)."""
        entry = self._entries.get(node_id)
        if entry is None:
            return self._first.setdefault(node_id, asyncio.Event())
        return entry.changed

    def node_ids(self) -> list[str]:
        return list(self._entries)


def _same(a: Mapping[str, Mapping[str, bytes]], b: Mapping[str, Mapping[str, bytes]]) -> bool:
    return {t: dict(r) for t, r in a.items() if r} == {t: dict(r) for t, r in b.items() if r}
