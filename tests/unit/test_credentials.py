"""polar/credentials.py and the caller check of polar/grpc_server.py: the tokens are private files
reused across starts; a server with credentials refuses a call without a token or with a foreign one
(UNAUTHENTICATED, saying what to send) and a role the rpc is not for (PERMISSION_DENIED), serves
the roles it is for, and leaves health checking open; every rpc of a servicer names its callers;
a gateway's sessions and their keys are the operator's alone."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from polar import credentials
from polar.config import RolloutConfig
from polar.grpc_server import callers
from polar.rollout.server import RolloutServicer, start_rollout_server
from polar.v1 import gateway_pb2, gateway_pb2_grpc, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.anyio


def test_ensure_writes_private_tokens_and_reuses_them(tmp_path: Path) -> None:
    folder = tmp_path / "state" / "credentials"
    first = credentials.ensure(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for role in credentials.SHARED_ROLES:
        assert stat.S_IMODE((folder / role).stat().st_mode) == 0o600
    assert len(set(first.tokens.values())) == 3
    assert credentials.ensure(folder).tokens == first.tokens  # a restarted stack keeps them
    (folder / "node").write_text("not a token\n")
    with pytest.raises(credentials.CredentialsError, match="does not hold a credential"):
        credentials.load(folder)


def test_a_token_maps_to_its_role_and_nothing_else_does(tmp_path: Path) -> None:
    issued = credentials.ensure(tmp_path)
    for role in credentials.SHARED_ROLES:
        [(_, value)] = issued.metadata(role)
        assert issued.role_of(value) == role
    assert issued.role_of(None) is None
    assert issued.role_of("Bearer " + "0" * 64) is None
    assert issued.role_of(issued.tokens["node"]) is None  # without "Bearer "


def test_commands_find_the_state_folders_credentials(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(credentials.ENV_VAR, raising=False)
    monkeypatch.setenv(credentials.STATE_ENV_VAR, str(tmp_path))
    assert credentials.for_commands() is None  # no stack wrote any
    issued = credentials.ensure()
    assert issued.folder == tmp_path / "credentials"
    assert credentials.for_commands() == issued
    assert credentials.without({credentials.ENV_VAR: "x", "PATH": "/bin"}) == {"PATH": "/bin"}


def test_every_rpc_must_name_its_callers() -> None:
    with pytest.raises(TypeError, match="no callers declared for Heartbeat"):
        callers({name: ("operator",) for name in RolloutServicer.roles if name != "Heartbeat"})(
            type("S", (rollout_pb2_grpc.RolloutServiceServicer,), {})
        )
    with pytest.raises(TypeError, match="unknown roles harness"):
        callers({name: ("harness",) for name in RolloutServicer.roles})(
            type("S", (rollout_pb2_grpc.RolloutServiceServicer,), {})
        )


@pytest.fixture
async def secured(tmp_path: Path, monkeypatch):
    issued = credentials.ensure(tmp_path / "credentials")
    monkeypatch.setenv(credentials.ENV_VAR, str(issued.folder))
    running = await start_rollout_server(RolloutConfig(host="127.0.0.1", port=0, store=str(tmp_path / "r.db")))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            yield issued, channel
    finally:
        await running.stop(0)


TASK = rollout_pb2.Task(
    task_id="t", instruction="hi", group_size=1, harness=rollout_pb2.HarnessSpec(preset="command", command=["true"])
)


async def test_a_call_without_a_credential_is_unauthenticated_and_says_what_to_send(secured) -> None:
    issued, channel = secured
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    for metadata in ((), (("authorization", "Bearer " + "ab" * 32),)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[TASK]), timeout=10, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <token>" in refused.value.details()
        assert str(issued.folder) in refused.value.details()
    # A streaming rpc is refused the same way.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.WatchResults(rollout_pb2.WatchResultsRequest(until_caught_up=True), timeout=10):
            pass
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Nothing was submitted.
    status = await stub.GetTaskStatus(
        rollout_pb2.GetTaskStatusRequest(), timeout=10, metadata=issued.metadata("operator")
    )
    assert list(status.tasks) == []


async def test_a_role_may_call_only_its_rpcs(secured) -> None:
    issued, channel = secured
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.SubmitTasks(
            rollout_pb2.SubmitTasksRequest(tasks=[TASK]), timeout=10, metadata=issued.metadata("node")
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "SubmitTasks is for operator, trainer, not the node" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Heartbeat(
            rollout_pb2.HeartbeatRequest(node_id="x"), timeout=10, metadata=issued.metadata("operator")
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    submitted = await stub.SubmitTasks(
        rollout_pb2.SubmitTasksRequest(tasks=[TASK]), timeout=10, metadata=issued.metadata("trainer")
    )
    assert list(submitted.task_ids) == ["t"]
    registered = await stub.RegisterNode(
        rollout_pb2.RegisterNodeRequest(runtimes=["local"]), timeout=10, metadata=issued.metadata("node")
    )
    assert registered.node_id


async def test_health_checking_stays_open(secured) -> None:
    _, channel = secured
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_a_blocking_channel_carries_its_roles_token(tmp_path: Path, monkeypatch) -> None:
    import asyncio
    import threading

    issued = credentials.ensure(tmp_path / "credentials")
    monkeypatch.setenv(credentials.ENV_VAR, str(issued.folder))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def serve() -> None:
        holder["running"] = await start_rollout_server(
            RolloutConfig(host="127.0.0.1", port=0, store=str(tmp_path / "r.db"))
        )
        holder["stop"] = asyncio.Event()
        started.set()
        await holder["stop"].wait()
        await holder["running"].stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        assert started.wait(30)
        with credentials.channel(holder["running"].address, "operator", issued) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            assert list(stub.ListNodes(rollout_pb2.ListNodesRequest(), timeout=10).nodes) == []
            assert [
                r for r in stub.WatchResults(rollout_pb2.WatchResultsRequest(until_caught_up=True), timeout=10)
            ] == []
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
        loop.close()


async def test_no_command_a_node_runs_in_a_runtime_gets_the_credentials(tmp_path: Path, monkeypatch) -> None:
    from polar.app.node.runtimes import LocalProvider
    from polar.rollout.harness import HarnessContext, prepare_launch

    monkeypatch.setenv(credentials.ENV_VAR, str(tmp_path / "credentials"))
    runtime = await LocalProvider(tmp_path / "work").create(rollout_pb2.RuntimeSpec(kind="local"), name="s")
    try:
        # Prepare steps and evaluators: the node's environment, less the credentials.
        assert credentials.ENV_VAR not in runtime.command_env({"X": "1"})
        # The harness: its allow-list (the same for every preset: session_environment).
        context = HarnessContext("hi", "http://127.0.0.1:1", "key", "m", runtime.home, runtime.workspace, "t.0", "t")
        launch = prepare_launch(rollout_pb2.HarnessSpec(preset="command", command=["true"]), context)
        assert not [name for name in launch.env if "CREDENTIAL" in name]
    finally:
        await runtime.close()


async def test_a_gateway_s_sessions_and_keys_are_the_operator_s_alone(tmp_path: Path, monkeypatch) -> None:
    from gateway.grpc_service import GatewayServicer, start_grpc
    from gateway.sessions import SessionStore

    issued = credentials.ensure(tmp_path / "credentials")
    monkeypatch.setenv(credentials.ENV_VAR, str(issued.folder))
    store = SessionStore()
    session = store.open(session_id="s")
    server, port = await start_grpc(GatewayServicer(store), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            calls = {
                "OpenSession": lambda metadata: stub.OpenSession(gateway_pb2.OpenSessionRequest(), metadata=metadata),
                "GetSession": lambda metadata: stub.GetSession(
                    gateway_pb2.GetSessionRequest(key="s"), metadata=metadata
                ),
                "CloseSession": lambda metadata: stub.CloseSession(
                    gateway_pb2.CloseSessionRequest(key="s"), metadata=metadata
                ),
                "Drain": lambda metadata: stub.Drain(gateway_pb2.DrainRequest(), metadata=metadata),
            }

            async def watch(metadata) -> list:
                request = gateway_pb2.WatchSessionRequest(key="s", until_caught_up=True)
                return [message async for message in stub.WatchSession(request, metadata=metadata)]

            calls["WatchSession"] = watch
            for caller, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (issued.metadata(credentials.NODE), grpc.StatusCode.PERMISSION_DENIED),
                (issued.metadata(credentials.TRAINER), grpc.StatusCode.PERMISSION_DENIED),
            ):
                for name, call in calls.items():
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(caller)
                    assert refused.value.code() == code, name
                    assert session.key not in refused.value.details()
            assert not session.closed and not store.draining and store.open_sessions() == 1

            status = await stub.GetNodeStatus(
                gateway_pb2.GetNodeStatusRequest(), metadata=issued.metadata(credentials.TRAINER)
            )
            assert status.status.open_sessions == 1 and session.key not in str(status)
            operator = issued.metadata(credentials.OPERATOR)
            assert (await calls["GetSession"](operator)).session.key == session.key
            assert (await calls["CloseSession"](operator)).session.closed
    finally:
        await server.stop(0)
