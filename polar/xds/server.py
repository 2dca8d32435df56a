"""The Aggregated Discovery Service (state of the world) over a SnapshotCache.

Each Envoy opens one ADS stream and names itself (node.id) in its first request. Its stream has one
writer, this servicer's generator: requests (read by a task of their own) and snapshot changes (a
watcher task) arrive on one queue, and the generator alone decides (polar.xds.stream) and sends.
An Envoy the cache has no snapshot for gets one made by `resources_for(node_id)` when it connects,
unless that says None (not known yet: a control plane just started, whose upstreams are still
joining again): then the stream waits for the first snapshot, and Envoy keeps what it has.

`Envoys` keeps what each Envoy acknowledged or refused, and the credential its stream was opened
with, for `polar status` (ListUpstreams) and for an upstream that waits until no Envoy sends it new
calls. A stream opened with a credential issued by name ends (UNAUTHENTICATED) once that credential
is revoked (`end_revoked`); the server's credential check refuses it when it connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from polar import credentials as creds
from polar.credentials import NODE, OPERATOR
from polar.grpc_server import InvalidArgument, caller, callers, status_codes
from polar.xds.snapshot import ENDPOINT_TYPE, Snapshot, SnapshotCache
from polar.xds.stream import NACK, Response, StreamRules, TypeState

log = logging.getLogger("polar.xds")

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
_CHANGED = object()  # the queue's marker for "this Envoy's snapshot changed"
_ENDED = object()  # Envoy closed its side of the stream
_REVOKED = object()  # the stream's credential was revoked


class CredentialRevoked(PermissionError):
    """The credential an open stream was opened with is no longer issued (UNAUTHENTICATED)."""


@dataclass
class EnvoyState:
    """One Envoy as the control plane saw it (kept after it disconnects, for status)."""

    node_id: str
    rules: StreamRules = field(default_factory=StreamRules)  # of its latest stream
    connected: bool = False
    caller: creds.Caller | None = None  # whose credential opened its latest stream (None: none checked)

    def endpoints(self) -> TypeState:
        return self.rules.types.get(ENDPOINT_TYPE, TypeState())


@callers({"StreamAggregatedResources": (NODE, OPERATOR), "DeltaAggregatedResources": (NODE, OPERATOR)})
@status_codes({CredentialRevoked: grpc.StatusCode.UNAUTHENTICATED})
class AggregatedDiscovery(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """ADS, state of the world (the incremental variant stays UNIMPLEMENTED: Polar's Envoys ask for SotW)."""

    def __init__(
        self, cache: SnapshotCache, resources_for: Callable[[str], Mapping[str, Mapping[str, bytes]] | None]
    ) -> None:
        self.cache = cache
        self._resources_for = resources_for
        self.envoys: dict[str, EnvoyState] = {}
        # The server's credentials, set by a server that checks its callers (None: every caller
        # served): each stream's caller is kept, and cut off when its issued credential is revoked.
        self.credentials: creds.Credentials | None = None
        self._streams: dict[asyncio.Queue, creds.Caller | None] = {}  # each open stream's queue -> its caller

    def publish(self) -> None:
        """Every known Envoy's snapshot made again from `resources_for` (a stream is pushed only
        when its Envoy's resources changed)."""
        for node_id in list(self.envoys):
            if (resources := self._resources_for(node_id)) is not None:
                self.cache.set(node_id, resources)

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        queue: asyncio.Queue = asyncio.Queue()
        who = self._streams[queue] = caller(self.credentials, context)
        tasks = [asyncio.create_task(_read(request_iterator, queue))]
        envoy: EnvoyState | None = None
        try:
            while (item := await queue.get()) is not _ENDED:
                if item is _REVOKED:
                    log.warning(
                        "Envoy %s: its credential %s was revoked; its ADS stream ends",
                        envoy.node_id if envoy else "?",
                        who.name,
                    )
                    raise CredentialRevoked(
                        f"the credential {who.name} this ADS stream was opened with was revoked"
                        " (`polar credentials revoke`): issue this machine a new one"
                    )
                if item is _CHANGED:
                    for response in envoy.rules.on_snapshot(self.cache.current(envoy.node_id)):
                        yield _message(response)
                    continue
                if envoy is None:
                    envoy = self._connect(item, who)
                    tasks.append(asyncio.create_task(self._watch(envoy.node_id, queue)))
                response = self._on_request(envoy, item)
                if response is not None:
                    yield _message(response)
        finally:
            self._streams.pop(queue, None)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                    await task
            if envoy is not None and self.envoys.get(envoy.node_id) is envoy:
                envoy.connected = False
                log.info("Envoy %s disconnected", envoy.node_id)

    def _connect(self, first: discovery_pb2.DiscoveryRequest, who: creds.Caller | None) -> EnvoyState:
        node_id = first.node.id
        if not node_id:
            raise InvalidArgument(
                "the first DiscoveryRequest of a stream must carry node.id (the Envoy's bootstrap node)"
            )
        # A reconnecting Envoy starts a new stream: its old one, if still open, is no longer its.
        envoy = self.envoys[node_id] = EnvoyState(node_id, connected=True, caller=who)
        if self.cache.current(node_id) is None and (resources := self._resources_for(node_id)) is not None:
            self.cache.set(node_id, resources)
        log.info("Envoy %s connected", node_id)
        return envoy

    def _on_request(self, envoy: EnvoyState, request: discovery_pb2.DiscoveryRequest) -> Response | None:
        error = request.error_detail.message if request.HasField("error_detail") else ""
        if request.HasField("error_detail") and not error:
            error = f"status code {request.error_detail.code} without a message"
        kind, response = envoy.rules.on_request(
            request.type_url,
            request.version_info,
            request.response_nonce,
            list(request.resource_names),
            error,
            self.cache.current(envoy.node_id),
        )
        if kind == NACK:
            rejected = envoy.rules.types[request.type_url].rejected
            log.warning("Envoy %s rejected %s version %s: %s", envoy.node_id, request.type_url, rejected, error)
        return response

    def close(self) -> None:
        """End every open stream now (the server is stopping; Envoys reconnect to its successor and
        keep their endpoints meanwhile) rather than holding the server's graceful stop."""
        for queue in self._streams:
            queue.put_nowait(_ENDED)

    def end_revoked(self, issued: set[str]) -> int:
        """End (UNAUTHENTICATED) every open stream opened with a credential issued by name that is
        not among `issued` any more; how many."""
        revoked = [
            queue for queue, who in self._streams.items() if who is not None and who.name and who.name not in issued
        ]
        for queue in revoked:
            queue.put_nowait(_REVOKED)
        return len(revoked)

    async def _watch(self, node_id: str, queue: asyncio.Queue) -> None:
        while True:
            await self.cache.changed(node_id).wait()
            queue.put_nowait(_CHANGED)


async def _read(requests: AsyncIterator[discovery_pb2.DiscoveryRequest], queue: asyncio.Queue) -> None:
    try:
        async for request in requests:
            queue.put_nowait(request)
    finally:
        queue.put_nowait(_ENDED)


def _message(response: Response) -> discovery_pb2.DiscoveryResponse:
    return discovery_pb2.DiscoveryResponse(
        version_info=response.version,
        type_url=response.type_url,
        nonce=response.nonce,
        resources=[any_pb2.Any(type_url=response.type_url, value=value) for value in response.resources.values()],
    )


def accepted_snapshot(envoy: EnvoyState) -> Snapshot | None:
    """The endpoint snapshot the Envoy acknowledged on its current stream (None: none yet)."""
    return envoy.endpoints().accepted_snapshot
