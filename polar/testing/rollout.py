"""A real rollout server and gateway node over a scripted inference server, on free loopback ports, for tests.

    async with running_rollout({"outputs": [{"text": "Done."}]}) as rollout:
        [task_id] = await rollout.submit(task(...))
        [group] = await rollout.groups(1)

Everything is real but the model: the rollout server on its SQLite store, the inference server with
the scripted engine, Envoy in front of the gateway (harnesses get its harness listener as base URL),
the node with its pools, runtimes and harness processes. `node=False` starts no node, so a test can
start its own (`start_node`), or several.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from polar.app.node.node import RunningNode, start_node
from polar.codec import MAX_ROLLOUT_MESSAGE_BYTES, read_trajectory_batch
from polar.config import EnvoyConfig, GatewayConfig, NodeConfig, RolloutConfig
from polar.envoy import running_async
from polar.inference.engines.scripted import ScriptedEngine
from polar.inference.server import start_server
from polar.rollout.server import RunningRollout, start_rollout_server
from polar.service_base import join_host_port, listening_socket
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

HOST = "127.0.0.1"
TEST_ENVOY = EnvoyConfig(harness_port=0, inference_port=0, admin_port=0, workers=1, access_log="/dev/null")
# Small pools: tests run a handful of sessions on a shared 2-core machine.
TEST_NODE = NodeConfig(init_workers=2, ready_slots=2, running_slots=4, postrun_workers=2)


@dataclass
class RolloutHandle:
    """The running services, and a client of the rollout server."""

    rollout: RunningRollout
    stub: rollout_pb2_grpc.RolloutServiceStub
    inference_address: str  # what nodes send generations to (Envoy's inference listener)
    base_url: str  # Envoy's harness listener
    http_port: int  # the gateway port Envoy forwards harness requests to
    http_socket: socket.socket  # bound to http_port and listening, for the first node to serve
    store_path: Path
    engine: ScriptedEngine
    nodes: list[RunningNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.rollout.address

    async def start_node(self, config: NodeConfig = TEST_NODE, gateway: Mapping[str, Any] | None = None) -> RunningNode:
        """One more node on this stack; the first gets Envoy's harness listener, later ones their own
        gateway's address (Envoy forwards to one gateway). `gateway`: GatewayConfig fields over the
        test's."""
        first = not self.nodes
        gateway_config = GatewayConfig(
            port=0, grpc_port=0, inference_address=self.inference_address, base_url=self.base_url if first else ""
        )
        node = await start_node(
            dataclasses.replace(config, rollout_address=self.address),
            dataclasses.replace(gateway_config, **(gateway or {})),
            http_socket=self.http_socket if first else None,
        )
        self.nodes.append(node)
        return node

    async def submit(self, *tasks: rollout_pb2.Task) -> list[str]:
        response = await self.stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=tasks), timeout=10)
        return list(response.task_ids)

    async def groups(
        self, count: int, *, cursor: str = "", timeout_s: float = 60.0
    ) -> list[list[common_pb2.Trajectory]]:
        """The next `count` released GRPO groups after `cursor`, from the results stream."""
        groups: list[list[common_pb2.Trajectory]] = []
        async with asyncio.timeout(timeout_s):
            call = self.stub.WatchResults(rollout_pb2.WatchResultsRequest(cursor=cursor), wait_for_ready=True)
            try:
                async for batch in call:
                    trajectories = read_trajectory_batch(batch.zstd_trajectories)
                    for trajectory in trajectories:
                        if not groups or groups[-1][0].group_id != trajectory.group_id:
                            groups.append([])
                        groups[-1].append(trajectory)
                    if len(groups) >= count:
                        return groups
            finally:
                call.cancel()
        return groups

    async def session_status(self, session_id: str) -> rollout_pb2.SessionStatus:
        response = await self.stub.GetSessionStatus(
            rollout_pb2.GetSessionStatusRequest(session_id=session_id), timeout=10
        )
        return response.status

    async def wait_for_state(
        self, session_id: str, state: int, *, timeout_s: float = 30.0
    ) -> rollout_pb2.SessionStatus:
        async with asyncio.timeout(timeout_s):
            while (status := await self.session_status(session_id)).state != state:
                await asyncio.sleep(0.02)
        return status


def command_task(
    argv: list[str],
    *,
    instruction: str = "",
    group_size: int = 1,
    evaluator: str = "",
    timeout_s: float = 60.0,
    **fields: Any,
) -> rollout_pb2.Task:
    """A task whose harness is `argv` (preset "command") and whose evaluator is the shell command
    `evaluator` ("" = none)."""
    return rollout_pb2.Task(
        instruction=instruction or "the task",
        group_size=group_size,
        harness=rollout_pb2.HarnessSpec(preset="command", command=argv),
        evaluator=rollout_pb2.EvaluatorSpec(kind="command", command=evaluator) if evaluator else None,
        timeout_seconds=timeout_s,
        **fields,
    )


@contextlib.asynccontextmanager
async def running_rollout(
    script: Mapping[str, Any] | None = None,
    *,
    node: NodeConfig | None = TEST_NODE,
    store_path: Path | None = None,
    heartbeat_interval_s: float = 0.5,
    node_timeout_s: float = 5.0,
    max_attempts: int = 3,
    max_request_bytes: int = MAX_ROLLOUT_MESSAGE_BYTES,
    gateway: Mapping[str, Any] | None = None,
) -> AsyncIterator[RolloutHandle]:
    """Start the rollout server (on `store_path`, else a fresh file), a scripted inference server,
    Envoy and, unless `node` is None, one node (its gateway with the GatewayConfig fields in
    `gateway` over the test's); stop them in reverse order."""
    engine = ScriptedEngine.from_script(script if script is not None else {"outputs": []})
    async with contextlib.AsyncExitStack() as stack:
        if store_path is None:
            store_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polar-rollout-"))) / "rollout.db"
        stack.push_async_callback(engine.stop)
        inference_server, port = await start_server(engine, f"{HOST}:0")
        stack.push_async_callback(inference_server.stop, 1.0)
        http_socket = stack.enter_context(listening_socket(HOST))
        proxy = await stack.enter_async_context(
            running_async(TEST_ENVOY, [join_host_port(HOST, port)], join_host_port(HOST, http_socket.getsockname()[1]))
        )
        rollout = await start_rollout_server(
            RolloutConfig(
                host=HOST,
                port=0,
                store=str(store_path),
                heartbeat_interval_s=heartbeat_interval_s,
                node_timeout_s=node_timeout_s,
                max_attempts=max_attempts,
                max_request_bytes=max_request_bytes,
            )
        )
        stack.push_async_callback(rollout.stop)
        channel = grpc.aio.insecure_channel(
            rollout.address, options=[("grpc.max_receive_message_length", MAX_ROLLOUT_MESSAGE_BYTES)]
        )
        stack.push_async_callback(channel.close)
        handle = RolloutHandle(
            rollout=rollout,
            stub=rollout_pb2_grpc.RolloutServiceStub(channel),
            inference_address=join_host_port(HOST, proxy.inference_port),
            base_url="http://" + join_host_port(HOST, proxy.harness_port),
            http_port=http_socket.getsockname()[1],
            http_socket=http_socket,
            store_path=store_path,
            engine=engine,
        )

        async def stop_nodes() -> None:
            for running in reversed(handle.nodes):
                await running.stop()

        stack.push_async_callback(stop_nodes)
        if node is not None:
            await handle.start_node(node, gateway)
        yield handle
