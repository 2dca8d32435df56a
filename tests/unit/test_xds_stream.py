"""The control plane's pure parts: snapshots and their versions, and one ADS stream's rules (when
to answer; ACK, NACK, stale nonces), as go-control-plane's snapshot cache behaves."""

from __future__ import annotations

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given
from hypothesis import strategies as st

from polar.xds.snapshot import (
    ENDPOINT_TYPE,
    GATEWAY_CLUSTER,
    INFERENCE_CLUSTER,
    SnapshotCache,
    Upstream,
    assignments,
)
from polar.xds.stream import ACK, FIRST, NACK, STALE, StreamRules

EDS = ENDPOINT_TYPE
NAMES = [INFERENCE_CLUSTER, GATEWAY_CLUSTER]


def resources(*upstreams: Upstream, envoy: str = "e1") -> dict:
    return {EDS: assignments(upstreams, envoy)}


A = Upstream(INFERENCE_CLUSTER, "127.0.0.2", 50051)
B = Upstream(INFERENCE_CLUSTER, "127.0.0.3", 50051)


def endpoints(value: bytes) -> list[tuple[str, int, int]]:
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(value)
    return [
        (lb.endpoint.address.socket_address.address, lb.endpoint.address.socket_address.port_value, lb.health_status)
        for locality in cla.endpoints
        for lb in locality.lb_endpoints
    ]


# --- snapshots ----------------------------------------------------------------------------------


def test_assignments_hold_every_cluster_and_mark_draining_endpoints():
    drained = Upstream(INFERENCE_CLUSTER, "127.0.0.4", 50051, draining=True)
    gateway_mine = Upstream(GATEWAY_CLUSTER, "127.0.0.5", 8000, envoy="e1")
    gateway_other = Upstream(GATEWAY_CLUSTER, "127.0.0.6", 8000, envoy="e2")
    out = assignments([A, drained, gateway_mine, gateway_other], "e1")
    assert sorted(out) == sorted(NAMES)
    assert endpoints(out[INFERENCE_CLUSTER]) == [
        ("127.0.0.2", 50051, health_check_pb2.UNKNOWN),
        ("127.0.0.4", 50051, health_check_pb2.DRAINING),
    ]
    # A gateway is sent to only by the Envoy in front of its node.
    assert endpoints(out[GATEWAY_CLUSTER]) == [("127.0.0.5", 8000, health_check_pb2.UNKNOWN)]
    assert endpoints(assignments([], "e1")[INFERENCE_CLUSTER]) == []


@given(st.permutations([A, B, Upstream(GATEWAY_CLUSTER, "127.0.0.9", 1)]))
def test_assignments_do_not_depend_on_the_order_of_joining(order):
    assert assignments(order, "e") == assignments([A, B, Upstream(GATEWAY_CLUSTER, "127.0.0.9", 1)], "e")


def test_versions_move_only_on_change_and_a_new_epoch_never_repeats_one():
    cache = SnapshotCache(epoch="100")
    first = cache.set("e1", resources(A))
    assert first.version == "100.1"
    assert cache.set("e1", resources(A)) is first  # the same resources: no new version
    second = cache.set("e1", resources(A, B))
    assert second.version == "100.2"
    assert cache.current("e1") is second
    # The snapshot an Envoy was sent cannot change under it.
    assert first.named(EDS, []) == resources(A)[EDS]
    try:
        first.resources[EDS]["x"] = b""  # type: ignore[index]
    except TypeError:
        pass
    else:
        raise AssertionError("a snapshot's resources must be read-only")
    restarted = SnapshotCache(epoch="101")
    assert restarted.set("e1", resources(A)).version not in ("100.1", "100.2")


def test_changed_is_set_on_a_new_snapshot_and_on_the_first():
    cache = SnapshotCache(epoch="1")
    first = cache.changed("e1")
    cache.set("e1", resources(A))
    assert first.is_set()
    waiting = cache.changed("e1")
    cache.set("e1", resources(A))
    assert not waiting.is_set()  # nothing changed
    cache.set("e1", resources(B))
    assert waiting.is_set()


# --- one stream ---------------------------------------------------------------------------------


def test_first_request_is_answered_then_an_ack_is_not():
    cache, rules = SnapshotCache(epoch="7"), StreamRules()
    snapshot = cache.set("e1", resources(A))
    kind, response = rules.on_request(EDS, "", "", NAMES, "", snapshot)
    assert kind == FIRST and response.version == "7.1" and sorted(response.resources) == sorted(NAMES)
    kind, again = rules.on_request(EDS, "7.1", response.nonce, NAMES, "", snapshot)
    assert (kind, again) == (ACK, None)
    assert rules.types[EDS].accepted == "7.1" and rules.types[EDS].accepted_snapshot is snapshot


def test_a_change_is_pushed_once_and_nonces_are_fresh():
    cache, rules = SnapshotCache(epoch="7"), StreamRules()
    _, r1 = rules.on_request(EDS, "", "", NAMES, "", cache.set("e1", resources(A)))
    rules.on_request(EDS, r1.version, r1.nonce, NAMES, "", cache.current("e1"))
    [r2] = rules.on_snapshot(cache.set("e1", resources(A, B)))
    assert r2.version == "7.2" and r2.nonce != r1.nonce
    # Not acknowledged yet: a further change waits for Envoy's answer, then goes out.
    assert rules.on_snapshot(cache.set("e1", resources(B))) == []
    kind, r3 = rules.on_request(EDS, r2.version, r2.nonce, NAMES, "", cache.current("e1"))
    assert kind == ACK and r3.version == "7.3" and r3.nonce not in (r1.nonce, r2.nonce)


def test_a_stale_nonce_changes_nothing():
    cache, rules = SnapshotCache(epoch="7"), StreamRules()
    _, r1 = rules.on_request(EDS, "", "", NAMES, "", cache.set("e1", resources(A)))
    rules.on_request(EDS, r1.version, r1.nonce, NAMES, "", cache.current("e1"))
    [r2] = rules.on_snapshot(cache.set("e1", resources(B)))
    # A request answering r1 crossed r2 on the wire: stale, even with other names or an error.
    assert rules.on_request(EDS, r1.version, r1.nonce, [INFERENCE_CLUSTER], "boom", cache.current("e1")) == (
        STALE,
        None,
    )
    state = rules.types[EDS]
    assert state.names == frozenset(NAMES) and state.rejected == "" and state.nonce == r2.nonce


def test_a_nack_is_remembered_and_not_resent_until_the_snapshot_changes():
    cache, rules = SnapshotCache(epoch="7"), StreamRules()
    _, r1 = rules.on_request(EDS, "", "", NAMES, "", cache.set("e1", resources(A)))
    rules.on_request(EDS, r1.version, r1.nonce, NAMES, "", cache.current("e1"))
    [bad] = rules.on_snapshot(cache.set("e1", resources(B)))
    kind, response = rules.on_request(EDS, r1.version, bad.nonce, NAMES, "malformed IP address", cache.current("e1"))
    assert (kind, response) == (NACK, None)
    state = rules.types[EDS]
    assert (state.accepted, state.rejected, state.error) == (r1.version, bad.version, "malformed IP address")
    # Setting the same resources again neither moves the version nor resends it.
    assert rules.on_snapshot(cache.set("e1", resources(B))) == []
    [good] = rules.on_snapshot(cache.set("e1", resources(A, B)))
    assert good.version == "7.3"
    assert rules.on_request(EDS, good.version, good.nonce, NAMES, "", cache.current("e1"))[0] == ACK


def test_new_names_are_answered_at_the_same_version():
    cache, rules = SnapshotCache(epoch="7"), StreamRules()
    snapshot = cache.set("e1", resources(A))
    _, r1 = rules.on_request(EDS, "", "", [INFERENCE_CLUSTER], "", snapshot)
    assert list(r1.resources) == [INFERENCE_CLUSTER]
    kind, r2 = rules.on_request(EDS, r1.version, r1.nonce, NAMES, "", snapshot)
    assert kind == ACK and r2.version == r1.version and sorted(r2.resources) == sorted(NAMES)


def test_a_reconnecting_envoy_with_an_old_epochs_version_is_answered():
    rules = StreamRules()
    snapshot = SnapshotCache(epoch="200").set("e1", resources(A))
    # After a control-plane restart Envoy sends what it holds, with a nonce of the old stream.
    kind, response = rules.on_request(EDS, "100.5", "41", NAMES, "", snapshot)
    assert kind == FIRST and response.version == "200.1"


@given(st.lists(st.sampled_from(["change", "same", "ack", "nack", "stale"]), max_size=30))
def test_at_most_one_response_is_unanswered_and_every_nonce_is_new(steps):
    """Whatever Envoy and the membership do, a type never has two responses awaiting an answer, no
    nonce repeats, and a refused version is never sent again while it is the snapshot's."""
    cache, rules = SnapshotCache(epoch="9"), StreamRules()
    sets = [resources(A), resources(B), resources(A, B)]
    _, last = rules.on_request(EDS, "", "", NAMES, "", cache.set("e1", sets[0]))
    awaiting, nonces, n = last, {last.nonce}, 0
    for step in steps:
        sent = []
        if step in ("change", "same"):
            n += step == "change"
            sent = rules.on_snapshot(cache.set("e1", sets[n % 3]))
        elif step == "stale":
            assert rules.on_request(EDS, "", "stale-nonce", NAMES, "", cache.current("e1")) == (STALE, None)
        elif awaiting is not None:
            error = "bad" if step == "nack" else ""
            version = rules.types[EDS].accepted if error else awaiting.version
            _, response = rules.on_request(EDS, version, awaiting.nonce, NAMES, error, cache.current("e1"))
            awaiting = None
            sent = [response] if response else []
        assert len(sent) <= 1
        for response in sent:
            assert awaiting is None, "a second response before Envoy answered the first"
            assert response.nonce not in nonces
            assert response.version != rules.types[EDS].rejected or not rules.types[EDS].rejected
            nonces.add(response.nonce)
            awaiting = response
