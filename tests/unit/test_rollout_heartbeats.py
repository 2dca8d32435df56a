"""What a node's heartbeat carries (polar/app/node/node.py, Node._heartbeat_request): its id and
secret, and the calls completed since the last acknowledged heartbeat, within the rollout server's
request limit: calls that do not fit wait for a later heartbeat, one that fits in none is left out."""

from __future__ import annotations

import pytest

from gateway.sessions import SessionStore
from polar.app.node.node import Node, SessionRun
from polar.config import NodeConfig
from polar.v1 import common_pb2, rollout_pb2

pytestmark = pytest.mark.anyio


@pytest.fixture
async def node():
    built = Node(NodeConfig(prewarm=False), gateway=None, providers={}, rollout_address="127.0.0.1:1")
    built.node_id, built._node_secret = "node-1", "s3cret"
    yield built
    await built.stop()


def hold(node: Node, store: SessionStore, session_id: str, body_sizes: list[int]) -> SessionRun:
    """A session the node runs, with one recorded call per size (its request body's bytes)."""
    session = store.open(session_id=session_id)
    for size in body_sizes:
        session.finish_call(common_pb2.CallRecord(call_id=session.begin_call(), request_body=b"x" * size))
    run = SessionRun(rollout_pb2.SessionAssignment(session_id=session_id))
    run.gateway_session = session
    node.runs[session_id] = run
    return run


def sent_calls(request: rollout_pb2.HeartbeatRequest) -> dict[str, list[str]]:
    return {progress.session_id: [call.call_id for call in progress.new_calls] for progress in request.sessions}


def heartbeat_request(node: Node) -> tuple[rollout_pb2.HeartbeatRequest, int, dict[str, int]]:
    """The node's next heartbeat, parsed, its size in bytes, and what it delivers."""
    serialized, delivers = node._heartbeat_request()
    return rollout_pb2.HeartbeatRequest.FromString(serialized), len(serialized), delivers


async def test_without_a_limit_every_new_call_goes(node) -> None:
    store = SessionStore()
    hold(node, store, "a", [3000, 3000])
    request, _, delivers = heartbeat_request(node)
    assert (request.node_id, request.node_secret) == ("node-1", "s3cret")
    assert sent_calls(request) == {"a": ["c0001", "c0002"]} and delivers == {"a": 2}


async def test_calls_over_the_limit_wait_and_one_too_large_for_any_heartbeat_is_left_out(node) -> None:
    store = SessionStore()
    a = hold(node, store, "a", [3000, 3000, 3000])
    b = hold(node, store, "b", [20_000, 1000])
    node.max_request_bytes = 8000

    request, size, delivers = heartbeat_request(node)
    assert size <= 8000
    # a's third call waits; b's first exceeds any heartbeat, so it is passed over for good.
    assert sent_calls(request) == {"a": ["c0001", "c0002"], "b": ["c0002"]}
    assert delivers == {"a": 2, "b": 2}
    assert [p.call_count for p in request.sessions] == [3, 2]  # the counts are whole all the same

    a.calls_delivered, b.calls_delivered = delivers["a"], delivers["b"]  # acknowledged
    request, _, delivers = heartbeat_request(node)
    assert sent_calls(request) == {"a": ["c0003"], "b": []} and delivers == {"a": 3, "b": 2}
