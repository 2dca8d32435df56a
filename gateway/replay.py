"""A recorded call as its request again: the body the harness sent, on the route its dialect serves it.

A `CallRecord` keeps the request body as the harness sent it and the dialect, but not the URL; each
dialect has one route, and Gemini's names the model and whether the reply streams, both recorded too.
Used to check rendering against recorded sessions and to replay them as load
(scripts/bench_gateway_replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.dialects import available_dialects
from gateway.dialects.base import Dialect, Route
from polar.v1 import common_pb2

PATHS = {
    "openai_chat": "/v1/chat/completions",
    "openai_responses": "/v1/responses",
    "anthropic": "/v1/messages",
}


class NotReplayable(ValueError):
    """The record holds no request body, or its dialect is not served here."""


@dataclass(frozen=True)
class RecordedRequest:
    dialect: Dialect
    route: Route
    target: str  # the HTTP request target: path and query
    body: bytes


def recorded_request(record: common_pb2.CallRecord) -> RecordedRequest:
    """The request a record was made from (`NotReplayable` for a record without its body)."""
    if not record.request_body:
        raise NotReplayable(f"call {record.call_id} was recorded without its request body")
    dialect = next((d for d in available_dialects().values() if d.record_dialect == record.dialect), None)
    if dialect is None:
        raise NotReplayable(f"call {record.call_id}: no dialect records as {record.dialect}")
    if dialect.name == "gemini":
        method = "streamGenerateContent" if record.stream else "generateContent"
        path = f"/v1beta/models/{record.model}:{method}"
        query = {"alt": "sse"} if record.stream else {}
        target = path + ("?alt=sse" if record.stream else "")
        return RecordedRequest(dialect, Route(path, record.model, record.stream, query), target, record.request_body)
    path = PATHS[dialect.name]
    return RecordedRequest(dialect, Route(path), path, record.request_body)
