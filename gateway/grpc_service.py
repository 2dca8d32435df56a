"""The gRPC GatewayService (protos/polar/v1/gateway.proto) over the gateway's session store.

Thin over `gateway.sessions`; its typed errors become status codes here, and only here:

    UnknownSession -> NOT_FOUND    SessionExists -> ALREADY_EXISTS    Draining -> UNAVAILABLE
    an unknown HistoryPolicy value, a SamplingPolicy out of range -> INVALID_ARGUMENT

`start_grpc` also serves gRPC health checking (overall and `polar.v1.GatewayService`) and server
reflection, like the inference server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from gateway.sessions import HISTORY_FROM_PROTO, Draining, SessionExists, SessionStore, UnknownSession
from polar.codec import length_delimited
from polar.credentials import OPERATOR, TRAINER
from polar.grpc_server import InvalidArgument, add_servicer, bind, callers, new_server, set_serving, status_codes
from polar.sampling_policy import SamplingPolicy
from polar.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
_CALLS = gateway_pb2.GetSessionResponse.CALLS_FIELD_NUMBER
_CALL = gateway_pb2.WatchSessionResponse.CALL_FIELD_NUMBER


# Who may call what (polar.credentials): sessions and their keys are the operator's alone (the node
# that owns this gateway reaches its sessions in-process, never over gRPC).
@callers(
    {
        "OpenSession": (OPERATOR,),
        "CloseSession": (OPERATOR,),
        "GetSession": (OPERATOR,),
        "WatchSession": (OPERATOR,),
        "Drain": (OPERATOR,),
        "GetNodeStatus": (TRAINER, OPERATOR),
    }
)
@status_codes(
    {
        UnknownSession: grpc.StatusCode.NOT_FOUND,
        SessionExists: grpc.StatusCode.ALREADY_EXISTS,
        Draining: grpc.StatusCode.UNAVAILABLE,
    }
)
class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """See GatewayService in gateway.proto for each rpc's contract."""

    def __init__(self, store: SessionStore, *, base_url: str = "", node_id: str = "") -> None:
        self._store = store
        self._base_url = base_url
        self._node_id = node_id

    # Unary.
    async def OpenSession(
        self, request: gateway_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.OpenSessionResponse:
        if request.history not in (gateway_pb2.HISTORY_POLICY_UNSPECIFIED, *HISTORY_FROM_PROTO):
            raise InvalidArgument(f"unknown history policy {request.history}")
        sampling = SamplingPolicy.from_proto(request.sampling)
        if problems := sampling.problems():
            raise InvalidArgument("; ".join(problems))
        session = self._store.open(
            session_id=request.session_id,
            task_id=request.task_id,
            history=HISTORY_FROM_PROTO.get(request.history),
            metadata=dict(request.metadata),
            sampling=sampling,
            adapter=request.adapter,
        )
        return gateway_pb2.OpenSessionResponse(session=session.to_proto())

    # Unary.
    async def CloseSession(
        self, request: gateway_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CloseSessionResponse:
        session = self._store.close(request.key)
        return gateway_pb2.CloseSessionResponse(session=session.to_proto())

    # Unary.
    async def GetSession(
        self, request: gateway_pb2.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> bytes:  # a GetSessionResponse, serialized: its records are put in serialized (Session.serialized)
        session = self._store.find(request.key)
        response = gateway_pb2.GetSessionResponse(session=session.to_proto()).SerializeToString()
        if request.omit_calls:
            return response
        return response + b"".join(length_delimited(_CALLS, session.serialized(r)) for r in session.in_order())

    # Server-streaming.
    async def WatchSession(
        self, request: gateway_pb2.WatchSessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:  # WatchSessionResponses, serialized, as GetSession's
        session = self._store.find(request.key)
        if request.until_caught_up:
            for record in session.in_order():  # taken now: calls completing later are not sent
                yield length_delimited(_CALL, session.serialized(record))
            return
        async for record in session.watch():
            yield length_delimited(_CALL, session.serialized(record))

    # Unary.
    async def Drain(
        self, request: gateway_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DrainResponse:
        return gateway_pb2.DrainResponse(open_sessions=await self._store.drain(request.timeout_seconds))

    # Unary.
    async def GetNodeStatus(
        self, request: gateway_pb2.GetNodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetNodeStatusResponse:
        return gateway_pb2.GetNodeStatusResponse(
            status=gateway_pb2.NodeStatus(
                node_id=self._node_id,
                open_sessions=self._store.open_sessions(),
                calls_in_flight=self._store.calls_in_flight(),
                calls_total=self._store.calls_total,
                draining=self._store.draining,
                base_url=self._base_url,
            )
        )


async def start_grpc(servicer: GatewayServicer, address: str) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server for the servicer on `address`; returns it and the bound port."""
    server, health_servicer = new_server(SERVICE_NAME, GatewayServicer.roles)
    add_servicer(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer, server)
    port = bind(server, address, "the gateway's gRPC server")
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
    return server, port
