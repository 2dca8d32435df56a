"""Prometheus /metrics of each service, scraped while a task runs through them: the rollout server
(sessions by state, its control plane's upstreams and the Envoy's acknowledged version), an
inference server started as `polar serve inference` (calls, tokens, policy version), a node (its
gateway's calls, tokens and CPU per call, its pools), and the real Envoy between them, started as
`polar serve envoy` on the control plane (Envoy's own statistics beside its service's). Every wait
is bounded."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polar import envoy
from polar.app.node.node import start_node
from polar.config import GatewayConfig, NodeConfig, RolloutConfig
from polar.metrics import EnvoyStats, start_metrics
from polar.rollout.server import start_rollout_server
from polar.v1 import rollout_pb2, rollout_pb2_grpc
from tests.helpers.polar_command import spawned
from tests.helpers.waiting import until

pytestmark = pytest.mark.anyio

WAIT_S = 30.0
ENVOY_ID = "envoy-metrics"
INFERENCE_CLUSTER = (("envoy_cluster_name", "inference"),)  # the label of Envoy's statistics of that cluster
# One chat call through the gateway, with the standard library only.
CALL = """
import json, os, urllib.request
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
)
urllib.request.urlopen(request, timeout=30).read()
"""
TASK = rollout_pb2.Task(
    task_id="scraped",
    instruction="say hi",
    group_size=2,
    harness=rollout_pb2.HarnessSpec(preset="command", command=[sys.executable, "-c", CALL]),
    runtime=rollout_pb2.RuntimeSpec(kind="local"),
)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample at `url`: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_every_service_serves_its_metrics_while_a_task_runs(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"cycle": True, "outputs": [{"text": "hello there"}]}))
    rollout = await start_rollout_server(
        RolloutConfig(
            host="127.0.0.1",
            port=0,
            store=str(tmp_path / "r.db"),
            heartbeat_interval_s=0.2,
            node_timeout_s=2.0,
            metrics_address="127.0.0.1:0",
        )
    )
    try:
        with spawned() as start:
            _, lines = start(
                "serve",
                "inference",
                "--engine",
                "scripted",
                "--script",
                str(script),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--rollout",
                rollout.address,
                "--metrics-address",
                "127.0.0.1:0",
            )
            _, envoy_lines = start(
                "serve",
                "envoy",
                "--xds",
                rollout.address,
                "--node-id",
                ENVOY_ID,
                "--host",
                "127.0.0.1",
                "--harness-port",
                "0",
                "--inference-port",
                "0",
                "--workers",
                "1",
                "--metrics-address",
                "127.0.0.1:0",
            )
            inference_url = (await asyncio.to_thread(lines.wait_for, r"metrics (http://\S+/metrics)", 60)).group(1)
            ready = await asyncio.to_thread(
                envoy_lines.wait_for,
                r"harness (http://\S+) .* inference \S+:(\d+) .*; metrics (http://\S+/metrics)",
                60,
            )
            base_url, inference_port, envoy_url = ready.group(1), ready.group(2), ready.group(3)

            async def envoy_sends_to_inference() -> bool:
                scraped = await asyncio.to_thread(scrape, envoy_url)
                return scraped.get(("envoy_cluster_membership_healthy", INFERENCE_CLUSTER)) == 1

            # Envoy and the inference server start side by side: the node starts once Envoy has it.
            await until("Envoy's inference cluster has the server", envoy_sends_to_inference, WAIT_S)
            node = await start_node(
                NodeConfig(
                    rollout_address=rollout.address,
                    envoy_node_id=ENVOY_ID,
                    init_workers=1,
                    ready_slots=1,
                    running_slots=2,
                    postrun_workers=1,
                    prewarm=False,
                    harness_isolation="none",
                    work_root=str(tmp_path / "work"),
                ),
                GatewayConfig(
                    host="127.0.0.1",
                    port=0,
                    grpc_port=0,
                    inference_address=f"127.0.0.1:{inference_port}",
                    base_url=base_url,
                    metrics_address="127.0.0.1:0",
                ),
            )
            try:
                assert node.gateway.metrics is not None
                async with grpc.aio.insecure_channel(rollout.address) as channel:
                    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[TASK]), timeout=10)

                    async def released() -> bool:
                        [status] = (
                            await stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=["scraped"]))
                        ).tasks
                        return status.released

                    await until("the task's group is released", released, WAIT_S)

                    # The node reports a session before it closes the session's runtime and lets it go.
                    async def node_let_go() -> bool:
                        scraped = await asyncio.to_thread(scrape, node.gateway.metrics.url)
                        return scraped.get(("polar_node_sessions", ())) == 0

                    await until("the node has let its sessions go", node_let_go, WAIT_S)
                await check_metrics(rollout.metrics.url, inference_url, node.gateway.metrics.url, envoy_url)
            finally:
                await node.stop()
    finally:
        await rollout.stop(grace=0.5)


async def check_metrics(rollout_url: str, inference_url: str, node_url: str, envoy_url: str) -> None:
    rollout = await asyncio.to_thread(scrape, rollout_url)
    assert rollout[("polar_rollout_sessions", (("state", "DONE"),))] == 2
    assert rollout[("polar_rollout_sessions", (("state", "PENDING"),))] == 0
    assert rollout[("polar_rollout_groups_released_total", ())] == 1
    assert rollout[("polar_rollout_nodes", ())] == 1
    assert rollout[("polar_xds_upstreams", (("cluster", "inference"), ("draining", "false")))] == 1
    assert rollout[("polar_xds_upstreams", (("cluster", "gateway_http"), ("draining", "false")))] == 1
    envoy_label = (("envoy", ENVOY_ID),)
    assert rollout[("polar_xds_envoy_connected", envoy_label)] == 1
    assert rollout[("polar_xds_envoy_up_to_date", envoy_label)] == 1
    assert (
        rollout[("polar_xds_envoy_acknowledged_version", envoy_label)]
        == rollout[("polar_xds_envoy_version", envoy_label)]
        > 0
    )
    assert rollout[("process_cpu_seconds_total", ())] > 0

    inference = await asyncio.to_thread(scrape, inference_url)
    assert inference[("polar_inference_calls_total", (("outcome", "completed"),))] == 2
    assert inference[("polar_inference_calls_total", (("outcome", "failed"),))] == 0
    assert inference[("polar_inference_completion_tokens_total", ())] > 0
    assert inference[("polar_inference_prompt_tokens_total", ())] > 0
    assert inference[("polar_inference_in_flight", ())] == 0
    assert inference[("polar_inference_policy_version", ())] == 0

    node = await asyncio.to_thread(scrape, node_url)
    assert node[("polar_gateway_calls_total", (("outcome", "completed"),))] == 2
    assert (
        node[("polar_gateway_completion_tokens_total", ())]
        == inference[("polar_inference_completion_tokens_total", ())]
    )
    assert node[("polar_gateway_prompt_tokens_total", ())] == inference[("polar_inference_prompt_tokens_total", ())]
    assert node[("polar_gateway_cpu_seconds_per_call", ())] > 0
    assert node[("polar_gateway_sessions_open", ())] == 0
    assert node[("polar_node_pool_capacity", (("pool", "running"),))] == 2
    assert node[("polar_node_pool_depth", (("pool", "running"),))] == 0
    assert node[("polar_node_sessions", ())] == 0

    # Envoy's service: Envoy's own statistics, read from its admin at this scrape, and its process's.
    proxy = await asyncio.to_thread(scrape, envoy_url)
    assert proxy[("polar_envoy_stats_available", ())] == 1
    assert proxy[("envoy_cluster_upstream_rq_total", INFERENCE_CLUSTER)] >= 2  # the two sessions' Generate calls
    assert proxy[("envoy_cluster_membership_healthy", INFERENCE_CLUSTER)] == 1
    assert proxy[("process_cpu_seconds_total", ())] > 0


async def test_a_metrics_address_that_cannot_serve_is_a_clear_error():
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        await start_metrics("nowhere")
    endpoint = await start_metrics("127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=f"cannot serve /metrics on 127.0.0.1:{endpoint.port}"):
            await start_metrics(f"127.0.0.1:{endpoint.port}")
    finally:
        await endpoint.stop()


async def test_envoys_metrics_come_back_without_its_statistics_when_its_admin_does_not_answer(tmp_path):
    stats = EnvoyStats(lambda: envoy.admin_get(f"unix:{tmp_path / 'gone.sock'}", "/stats/prometheus"))
    endpoint = await start_metrics("127.0.0.1:0", stats.collect, appended=stats.text)
    try:
        scraped = await asyncio.to_thread(scrape, endpoint.url)
    finally:
        await endpoint.stop()
    assert scraped[("polar_envoy_stats_available", ())] == 0
    assert scraped[("process_cpu_seconds_total", ())] > 0
    assert not [name for name, _ in scraped if name.startswith("envoy_")]
