"""`polar up`'s plan: which services start, with which arguments (no process is started)."""

from __future__ import annotations

import pytest

from polar.app.cli import build_parser
from polar.app.stack import Service, StackError, _resolve, plan
from polar.config import ConfigError, EnvoyConfig, GatewayConfig, NodeConfig, RolloutConfig, StackConfig, load_config


def _option(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def _parse(argv: tuple[str, ...]):
    """The child's argv as `polar` itself parses it (after `python -m polar`)."""
    assert argv[1:3] == ("-m", "polar")
    return build_parser(argv[3:]).parse_args(argv[3:])


def test_the_rollout_server_starts_first_and_the_node_last():
    services = plan(StackConfig())
    assert [s.name for s in services] == ["rollout", "inference", "envoy", "node"]
    rollout, *_, node = services
    assert rollout.health_service == "polar.v1.RolloutService"
    assert node.health_service == "polar.v1.GatewayService"
    # The node dials the rollout server the stack started, whatever port it bound.
    assert _option(node.argv, "--rollout") == "{rollout}"
    assert _option(node.argv, "--inference") == "{envoy}"


def test_the_node_is_given_envoys_harness_listener_as_its_base_url():
    *_, envoy, node = plan(StackConfig(envoy=EnvoyConfig(harness_port=0), gateway=GatewayConfig(port=8001)))
    # Envoy binds its harness port itself and reports the URL when ready; the node gets what it reported.
    assert _option(envoy.argv, "--harness-port") == "0"
    assert _option(node.argv, "--base-url") == "{envoy.base_url}"
    assert "harness base URL {base_url}" in envoy.detail
    # The supervisor binds the gateway port for the node, which joins Envoy's control plane with it.
    assert _option(node.argv, "--port") == "8001"
    assert node.takes_http_socket and not envoy.takes_http_socket


def test_envoy_learns_its_upstreams_from_the_rollout_servers_control_plane():
    _, inference, envoy, node = plan(StackConfig(envoy=EnvoyConfig(node_id="edge-1")))
    assert _option(envoy.argv, "--xds") == "{rollout}" and _option(envoy.argv, "--node-id") == "edge-1"
    assert "--inference" not in envoy.argv and "--gateway" not in envoy.argv
    # The inference server joins it; the node's gateway joins it for this Envoy.
    assert _option(inference.argv, "--rollout") == "{rollout}"
    assert _option(node.argv, "--envoy-node-id") == "edge-1"


def test_the_gateway_port_must_be_bound_before_planning():
    with pytest.raises(ValueError, match="must be fixed"):
        plan(StackConfig(gateway=GatewayConfig(port=0)))


def test_a_service_s_reports_fill_later_arguments_and_its_table_line():
    [envoy] = [spec for spec in plan(StackConfig()) if spec.name == "envoy"]
    service = Service(
        envoy,
        process=None,
        port=50051,
        reported={"base_url": "http://127.0.0.1:8123", "admin": "unix:/tmp/e/admin.sock"},
    )
    started = {"envoy": service}
    assert _resolve("{envoy}", started) == "127.0.0.1:50051"
    assert _resolve("{envoy.base_url}", started) == "http://127.0.0.1:8123"
    assert _resolve("{rollout}", started) == "{rollout}"  # not started (yet): left as it is
    assert service.detail.startswith("harness base URL http://127.0.0.1:8123 -> gateway 127.0.0.1:8000")
    assert service.detail.endswith("admin unix:/tmp/e/admin.sock")
    with pytest.raises(StackError, match="did not report 'harness'"):
        _resolve("{envoy.harness}", started)


def test_every_rollout_and_node_setting_reaches_its_command_line():
    rollout_config = RolloutConfig(
        host="0.0.0.0", port=0, store="runs/a.db", heartbeat_interval_s=0.25, node_timeout_s=7.5, max_attempts=5
    )
    node_config = NodeConfig(
        rollout_address="10.0.0.2:50070",
        init_workers=3,
        ready_slots=0,
        running_slots=9,
        postrun_workers=2,
        prewarm=False,
        work_root="/srv/sessions",
        harness_path="/opt/clis/bin",
        harness_output_limit=999,
    )
    gateway_config = GatewayConfig(
        port=8001, grpc_port=0, history="template", tokenizer="tiny", generate_timeout_s=3600.0
    )
    rollout, *_, node = plan(StackConfig(rollout=rollout_config, node=node_config, gateway=gateway_config))

    served = _parse(rollout.argv)
    assert (served.host, served.port, served.store) == ("0.0.0.0", 0, "runs/a.db")
    assert (served.heartbeat_interval_s, served.node_timeout_s, served.max_attempts) == (0.25, 7.5, 5)

    node_args = _parse(node.argv)
    assert node_args.rollout_address == "10.0.0.2:50070"
    assert (node_args.init_workers, node_args.ready_slots, node_args.running_slots, node_args.postrun_workers) == (
        3,
        0,
        9,
        2,
    )
    assert node_args.prewarm is False
    assert (node_args.work_root, node_args.harness_path, node_args.harness_output_limit) == (
        "/srv/sessions",
        "/opt/clis/bin",
        999,
    )
    assert (node_args.port, node_args.grpc_port, node_args.history, node_args.tokenizer) == (
        8001,
        0,
        "template",
        "tiny",
    )
    assert node_args.generate_timeout_s == 3600.0
    assert "reports to 10.0.0.2:50070" in node.detail


@pytest.mark.parametrize("prewarm", [True, False])
def test_the_node_prewarms_unless_told_not_to(prewarm):
    *_, node = plan(StackConfig(node=NodeConfig(prewarm=prewarm)))
    assert _parse(node.argv).prewarm is prewarm


def test_rollout_and_node_sections_load_from_a_config_file(tmp_path):
    path = tmp_path / "stack.toml"
    path.write_text('[rollout]\nstore = "run-1.db"\nnode_timeout_s = 4\n[node]\nrunning_slots = 2\nprewarm = false\n')
    config = load_config(path)
    assert (config.rollout.store, config.rollout.node_timeout_s) == ("run-1.db", 4.0)
    assert (config.node.running_slots, config.node.prewarm) == (2, False)
    path.write_text("[node]\nruning_slots = 2\n")
    with pytest.raises(ConfigError, match="'node.runing_slots'"):
        load_config(path)
