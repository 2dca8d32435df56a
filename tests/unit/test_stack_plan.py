"""`polar up`'s plan: which services start, with which arguments (no process is started)."""

from __future__ import annotations

import re

from polar.config import EnvoyConfig, GatewayConfig, StackConfig
from polar.stack import plan


def _option(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_gateway_reports_envoys_harness_listener_as_its_base_url():
    inference, envoy, gateway = plan(StackConfig(envoy=EnvoyConfig(harness_port=0), gateway=GatewayConfig(port=0)))
    assert [s.name for s in (inference, envoy, gateway)] == ["inference", "envoy", "gateway"]
    harness = re.search(r"harness base URL (\S+) ", envoy.detail).group(1)
    assert _option(gateway.argv, "--base-url") == harness
    assert _option(envoy.argv, "--harness-port") == harness.rpartition(":")[2] != "0"
    # Envoy forwards harness requests to the port the gateway is told to listen on.
    assert _option(envoy.argv, "--gateway").rpartition(":")[2] == _option(gateway.argv, "--port") != "0"


def test_a_configured_harness_port_is_the_base_url():
    *_, gateway = plan(StackConfig(envoy=EnvoyConfig(host="0.0.0.0", harness_port=8123)))
    assert _option(gateway.argv, "--base-url") == "http://127.0.0.1:8123"
