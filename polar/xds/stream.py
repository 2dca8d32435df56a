"""The rules of one state-of-the-world ADS stream, without gRPC: when to answer, and what a request
says (an ACK, a NACK, a stale one). The server (polar.xds.server) feeds it requests and snapshots
and sends what it returns; everything here is a pure function of what it was fed.

Per resource type, as go-control-plane's snapshot cache does:

- a response goes out only when the snapshot's version is not the one Envoy holds, or when the
  names Envoy asks for change; at most one response per type is unanswered at a time (the next is
  decided when Envoy answers it);
- every response carries a fresh nonce; a request whose nonce is not the latest response's is
  stale (Envoy had not seen that response yet) and changes nothing;
- a request with `error_detail` is a NACK of the latest response: Envoy keeps what it had, the
  version is remembered with Envoy's message, and it is not sent again; the next different
  snapshot is;
- a request without it that answers the latest nonce is an ACK of its `version_info`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from polar.xds.snapshot import Snapshot

STALE, FIRST, ACK, NACK = "stale", "first", "ack", "nack"


@dataclass(frozen=True)
class Response:
    """One DiscoveryResponse to send."""

    type_url: str
    version: str
    nonce: str
    resources: dict[str, bytes]  # name -> serialized resource of type_url


@dataclass
class TypeState:
    """Where one resource type stands on the stream."""

    names: frozenset[str] = frozenset()  # what Envoy asks for; empty = every resource (wildcard)
    accepted: str = ""  # the version Envoy holds ("" = none yet on this control plane)
    accepted_snapshot: Snapshot | None = None  # the snapshot of that version, when this stream sent it
    sent: Snapshot | None = None  # the snapshot of the latest response
    nonce: str = ""  # that response's nonce ("" = nothing sent yet)
    rejected: str = ""  # a version Envoy refused (NACK); not sent again
    error: str = ""  # Envoy's message for the refused version
    open: bool = False  # Envoy awaits a response: the next snapshot change may be sent


@dataclass
class StreamRules:
    """One ADS stream's state, per resource type."""

    types: dict[str, TypeState] = field(default_factory=dict)
    _nonces: itertools.count = field(default_factory=lambda: itertools.count(1))

    def on_request(
        self, type_url: str, version: str, nonce: str, names: list[str], error: str, snapshot: Snapshot | None
    ) -> tuple[str, Response | None]:
        """A request of Envoy's: what it was (STALE, FIRST, ACK or NACK) and the response to send
        now, if any. `error` is error_detail's message ("" = none)."""
        state = self.types.setdefault(type_url, TypeState())
        if state.nonce and nonce != state.nonce:
            return STALE, None
        if not state.nonce:
            kind = FIRST
        elif error:
            kind = NACK
            state.rejected, state.error = state.sent.version if state.sent else "", error
        else:
            kind = ACK
            state.accepted_snapshot = state.sent
        # Envoy's version_info is always the version it holds (after a NACK: the one before, whose
        # snapshot stays accepted_snapshot).
        state.accepted = version
        renamed = frozenset(names) != state.names
        state.names = frozenset(names)
        state.open = True
        return kind, self._answer(type_url, state, snapshot, force=renamed)

    def on_snapshot(self, snapshot: Snapshot) -> list[Response]:
        """The responses a new snapshot calls for (to types Envoy awaits one for)."""
        out = []
        for type_url, state in self.types.items():
            response = self._answer(type_url, state, snapshot, force=False)
            if response is not None:
                out.append(response)
        return out

    def _answer(self, type_url: str, state: TypeState, snapshot: Snapshot | None, force: bool) -> Response | None:
        if not state.open or snapshot is None:
            return None
        if not force and snapshot.version in (state.accepted, state.rejected):
            return None
        state.open = False
        state.sent = snapshot
        state.nonce = str(next(self._nonces))
        return Response(type_url, snapshot.version, state.nonce, snapshot.named(type_url, state.names))
