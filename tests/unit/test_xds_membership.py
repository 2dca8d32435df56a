"""Membership: upstreams joining, proving their id, draining, leaving and dying, as the snapshots
every Envoy is told show it (no gRPC: the servicer's state is driven directly)."""

from __future__ import annotations

import asyncio

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from polar.rollout.report import render_envoys
from polar.v1 import rollout_pb2
from polar.xds.member import REJOIN_BOUND_S
from polar.xds.membership import BadUpstream, Membership, UnknownUpstream, WrongUpstreamSecret, takes_new_calls
from polar.xds.server import EnvoyState
from polar.xds.snapshot import ENDPOINT_TYPE, GATEWAY_CLUSTER, INFERENCE_CLUSTER, SnapshotCache, Upstream
from polar.xds.stream import TypeState

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def membership(clock: Clock) -> Membership:
    return Membership(heartbeat_interval_s=1.0, timeout_s=5.0, cache=SnapshotCache(epoch="1"), clock=clock, warm_up_s=0)


def connect(members: Membership, node_id: str) -> None:
    members.discovery.envoys[node_id] = EnvoyState(node_id, connected=True)
    members.discovery.publish()


def inference_hosts(members: Membership, node_id: str) -> dict[tuple[str, int], int]:
    snapshot = members.discovery.cache.current(node_id)
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(snapshot.resources[ENDPOINT_TYPE][INFERENCE_CLUSTER])
    return {
        (lb.endpoint.address.socket_address.address, lb.endpoint.address.socket_address.port_value): lb.health_status
        for locality in cla.endpoints
        for lb in locality.lb_endpoints
    }


async def test_join_drain_leave_and_death_reach_every_envoys_snapshot():
    clock = Clock()
    members = membership(clock)
    connect(members, "e1")
    a_id, a_secret = await members.join(INFERENCE_CLUSTER, "127.0.0.2:50051")
    b_id, b_secret = await members.join(INFERENCE_CLUSTER, "localhost:50052")  # a name is resolved once
    assert inference_hosts(members, "e1") == {("127.0.0.2", 50051): 0, ("127.0.0.1", 50052): 0}
    version = members.discovery.cache.current("e1").version
    members.heartbeat(b_id, b_secret, draining=True)
    assert inference_hosts(members, "e1")[("127.0.0.1", 50052)] == health_check_pb2.DRAINING
    assert members.discovery.cache.current("e1").version != version
    assert members.heartbeat(b_id, b_secret, gone=True) is None
    assert inference_hosts(members, "e1") == {("127.0.0.2", 50051): 0}
    with pytest.raises(UnknownUpstream):
        members.heartbeat(b_id, b_secret)
    # One whose heartbeats stop is removed after the timeout, not before.
    clock.now += 5.0
    assert members.remove_silent() == []
    clock.now += 0.1
    assert members.remove_silent() == [a_id]
    assert inference_hosts(members, "e1") == {}


async def test_a_heartbeat_with_another_upstreams_secret_changes_nothing():
    members = membership(Clock())
    connect(members, "e1")
    a_id, _ = await members.join(INFERENCE_CLUSTER, "127.0.0.2:1")
    _, b_secret = await members.join(INFERENCE_CLUSTER, "127.0.0.3:1")
    with pytest.raises(WrongUpstreamSecret):
        members.heartbeat(a_id, b_secret, draining=True)
    assert inference_hosts(members, "e1")[("127.0.0.2", 1)] == 0


@pytest.mark.parametrize(
    ("cluster", "address", "problem"),
    [
        ("nope", "127.0.0.1:1", "cluster"),
        (INFERENCE_CLUSTER, "127.0.0.1", "HOST:PORT"),
        (INFERENCE_CLUSTER, "127.0.0.1:0", "HOST:PORT"),
        (INFERENCE_CLUSTER, "no-such-host.invalid:1", "does not resolve"),
    ],
)
async def test_a_bad_join_is_refused_saying_why(cluster, address, problem):
    with pytest.raises(BadUpstream, match=problem):
        await membership(Clock()).join(cluster, address)


async def test_a_gateway_is_told_only_to_its_own_envoy():
    members = membership(Clock())
    connect(members, "e1")
    connect(members, "e2")
    await members.join(GATEWAY_CLUSTER, "127.0.0.5:8000", envoy="e1")
    cache = members.discovery.cache
    assert takes_new_calls(cache.current("e1"), Upstream(GATEWAY_CLUSTER, "127.0.0.5", 8000))
    assert not takes_new_calls(cache.current("e2"), Upstream(GATEWAY_CLUSTER, "127.0.0.5", 8000))


async def test_draining_is_acknowledged_once_every_connected_envoy_holds_it():
    members = membership(Clock())
    connect(members, "e1")
    connect(members, "e2")
    b_id, b_secret = await members.join(INFERENCE_CLUSTER, "127.0.0.3:1")
    member = members.heartbeat(b_id, b_secret, draining=True)
    cache = members.discovery.cache
    assert not members.drain_acknowledged(member)  # neither Envoy has acknowledged anything
    for node_id in ("e1", "e2"):
        state = members.discovery.envoys[node_id].rules.types.setdefault(ENDPOINT_TYPE, TypeState())
        state.accepted_snapshot = cache.current(node_id)
        if node_id == "e1":
            assert not members.drain_acknowledged(member)  # e2 still sends it new calls
    assert members.drain_acknowledged(member)
    members.discovery.envoys["e2"].connected = False
    assert members.drain_acknowledged(member)


async def test_nothing_is_told_during_the_warm_up():
    members = Membership(heartbeat_interval_s=0.05, timeout_s=1.0, cache=SnapshotCache(epoch="1"))
    members.discovery.envoys["e1"] = EnvoyState("e1", connected=True)
    await members.join(INFERENCE_CLUSTER, "127.0.0.2:1")
    assert members.discovery.cache.current("e1") is None
    members.start()
    try:
        await asyncio.wait_for(members.discovery.cache.changed("e1").wait(), 2.0)
    finally:
        await members.stop()
    assert ("127.0.0.2", 1) in inference_hosts(members, "e1")


@pytest.mark.parametrize("heartbeat_s", [0.05, 0.2, 1.0, 5.0])
def test_the_warm_up_outlasts_an_upstreams_reconnection_and_next_beat(heartbeat_s):
    """An upstream of a restarted control plane joins again once its channel reconnects (up to
    REJOIN_BOUND_S) and it beats (every half interval): Envoys told before would get an empty set."""
    members = Membership(heartbeat_interval_s=heartbeat_s, timeout_s=5 * heartbeat_s)
    assert members.warm_up_s >= REJOIN_BOUND_S + heartbeat_s / 2
    assert members.warm_up_s >= 2 * heartbeat_s


def test_status_shows_each_envoys_acknowledged_and_refused_versions_and_who_joined_with_which_credential():
    response = rollout_pb2.ListUpstreamsResponse(
        upstreams=[
            rollout_pb2.UpstreamInfo(
                upstream_id="inference-1",
                cluster="inference",
                address="10.0.0.2:50051",
                draining=True,
                credential="gpu-3",
                credential_role="inference",
            )
        ],
        envoys=[
            rollout_pb2.EnvoyInfo(
                node_id="edge-1",
                connected=True,
                version="9.3",
                acknowledged_version="9.2",
                rejected_version="9.3",
                error="malformed IP address",
                credential_role="node",
            ),
        ],
    )
    text = render_envoys(response)
    [upstream] = [line for line in text.splitlines() if line.startswith("inference-1")]
    assert "draining" in upstream and "10.0.0.2:50051" in upstream and upstream.endswith("gpu-3 (inference)")
    [row] = [line for line in text.splitlines() if line.startswith("edge-1")]
    assert row.split()[:4] == ["edge-1", "yes", "9.3", "9.2"] and row.endswith(
        "stack's own (node)  9.3: malformed IP address"
    )
    assert render_envoys(rollout_pb2.ListUpstreamsResponse()) == ""
