"""The RolloutService over a real grpc.aio server on a free loopback port and a real store file. The
test plays the gateway nodes itself (DriverNode calls the RPCs a node calls), which is the edge; the
server, its store and its timers are the real ones, run with short intervals."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from polar import codec
from polar.codec import MAX_ROLLOUT_MESSAGE_BYTES
from polar.config import RolloutConfig
from polar.rollout.server import RunningRollout, serve_rollout, start_rollout_server
from polar.rollout.store import StoreError
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.anyio

INIT, READY, RUNNING, POSTRUN, PENDING, DONE = (
    rollout_pb2.SESSION_STATE_INIT,
    rollout_pb2.SESSION_STATE_READY,
    rollout_pb2.SESSION_STATE_RUNNING,
    rollout_pb2.SESSION_STATE_POSTRUN,
    rollout_pb2.SESSION_STATE_PENDING,
    rollout_pb2.SESSION_STATE_DONE,
)
COMPLETED, CANCELLED, FAILED = (
    common_pb2.SESSION_OUTCOME_COMPLETED,
    common_pb2.SESSION_OUTCOME_CANCELLED,
    common_pb2.SESSION_OUTCOME_FAILED,
)


# Quick heartbeats; a node timeout long enough that no test's node dies of a slow (loaded) machine.
# Tests of dead nodes set a short one.
def _config(store, **options) -> RolloutConfig:
    """A rollout server on a free port of 127.0.0.1, its store at `store`."""
    return RolloutConfig(host="127.0.0.1", port=0, store=str(store), **options)


FAST = {"heartbeat_interval_s": 0.2, "node_timeout_s": 5.0, "max_attempts": 2}
SHORT_NODE_TIMEOUT_S = 0.8


Stub = rollout_pb2_grpc.RolloutServiceStub


@pytest.fixture
async def start(tmp_path) -> Callable[..., Awaitable[tuple[RunningRollout, Stub]]]:
    """Starts a rollout server (on tmp_path/rollout.db unless told) and a client for it."""
    servers: list[RunningRollout] = []
    channels: list[grpc.aio.Channel] = []

    async def start_server(store=None, **options) -> tuple[RunningRollout, Stub]:
        server = await start_rollout_server(_config(store or tmp_path / "rollout.db", **{**FAST, **options}))
        servers.append(server)
        channel = grpc.aio.insecure_channel(
            server.address, options=[("grpc.max_receive_message_length", MAX_ROLLOUT_MESSAGE_BYTES)]
        )
        channels.append(channel)
        return server, Stub(channel)

    yield start_server
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)


def task(task_id: str = "", group_size: int = 1, **fields) -> rollout_pb2.Task:
    fields.setdefault("harness", rollout_pb2.HarnessSpec(preset="codex"))
    return rollout_pb2.Task(task_id=task_id, instruction="Fix the failing test.", group_size=group_size, **fields)


class DriverNode:
    """The test in a gateway node's place: registers, heartbeats with the sessions it holds, reports."""

    def __init__(self, stub: Stub, *, running: int = 2, ready: int = 0, runtimes=("local",)) -> None:
        self.stub = stub
        self.pools = [
            rollout_pb2.PoolStatus(name="init", capacity=4),
            rollout_pb2.PoolStatus(name="ready", capacity=ready),
            rollout_pb2.PoolStatus(name="running", capacity=running),
        ]
        self.runtimes = list(runtimes)
        self.node_id = ""
        self.secret = ""
        self.max_request_bytes = 0
        self.held: dict[str, rollout_pb2.SessionProgress] = {}
        self.assignments: dict[str, rollout_pb2.SessionAssignment] = {}

    async def register(self) -> DriverNode:
        response = await self.stub.RegisterNode(
            rollout_pb2.RegisterNodeRequest(
                gateway_address="127.0.0.1:1", base_url="http://127.0.0.1:2", pools=self.pools, runtimes=self.runtimes
            )
        )
        self.node_id, self.secret = response.node_id, response.node_secret
        self.max_request_bytes = response.max_request_bytes
        return self

    async def beat(self) -> rollout_pb2.HeartbeatResponse:
        response = await self.stub.Heartbeat(
            rollout_pb2.HeartbeatRequest(
                node_id=self.node_id, node_secret=self.secret, pools=self.pools, sessions=list(self.held.values())
            )
        )
        for assignment in response.start:
            self.held[assignment.session_id] = rollout_pb2.SessionProgress(session_id=assignment.session_id, state=INIT)
            self.assignments[assignment.session_id] = assignment
        return response

    def advance(self, session_id: str, state: int, calls: int = 0, **timings: float) -> None:
        self.held[session_id] = rollout_pb2.SessionProgress(
            session_id=session_id, state=state, call_count=calls, stage_timings=common_pb2.StageTimings(**timings)
        )

    async def report(self, session_id: str, /, outcome: int = COMPLETED, reward: float = 1.0, **fields) -> None:
        await self.stub.ReportSession(
            rollout_pb2.ReportSessionRequest(
                node_id=self.node_id,
                node_secret=self.secret,
                session_id=session_id,
                trajectory=common_pb2.Trajectory(outcome=outcome, reward=reward, **fields),
            )
        )
        self.held.pop(session_id, None)


async def session(stub: Stub, session_id: str) -> rollout_pb2.SessionStatus:
    return (await stub.GetSessionStatus(rollout_pb2.GetSessionStatusRequest(session_id=session_id))).status


async def task_status(stub: Stub, task_id: str) -> rollout_pb2.TaskStatus:
    return (await stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=[task_id]))).tasks[0]


async def results(stub: Stub, cursor: str = "", per_batch: int = 0) -> list[rollout_pb2.WatchResultsResponse]:
    request = rollout_pb2.WatchResultsRequest(cursor=cursor, max_groups_per_batch=per_batch, until_caught_up=True)
    return [message async for message in stub.WatchResults(request)]


def trajectories(messages: list[rollout_pb2.WatchResultsResponse]) -> list[common_pb2.Trajectory]:
    return [t for message in messages for t in codec.read_trajectory_batch(message.zstd_trajectories)]


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def rpc_error(call: Awaitable) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    return raised.value


# --- the server ---------------------------------------------------------------------------------------


async def test_health_and_reflection(start):
    server, _ = await start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "polar.v1.RolloutService"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in reflection.ServerReflectionInfo(iter([request])):
            names = {service.name for service in response.list_services_response.service}
            assert "polar.v1.RolloutService" in names


async def test_a_second_server_on_the_same_store_is_refused(start, tmp_path):
    await start()
    with pytest.raises(StoreError, match="in use by another rollout server"):
        await start_rollout_server(_config(tmp_path / "rollout.db"))


async def test_options_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ValueError, match="node_timeout_s .* must exceed heartbeat_interval_s"):
        await start_rollout_server(_config(tmp_path / "a.db", heartbeat_interval_s=2.0, node_timeout_s=1.0))
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        await start_rollout_server(_config(tmp_path / "a.db", max_attempts=0))
    # The store of a refused start is closed again: the next server opens it.
    server = await start_rollout_server(_config(tmp_path / "a.db"))
    await server.stop()


async def test_serve_rollout_runs_until_sigterm(tmp_path):
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(
        serve_rollout(_config(tmp_path / "r.db"), ready=lambda port, line: ready.set_result(port))
    )
    port = await asyncio.wait_for(ready, 10)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = await Stub(channel).GetTaskStatus(rollout_pb2.GetTaskStatusRequest())
        assert list(answer.tasks) == []
    os.kill(os.getpid(), signal.SIGTERM)  # serve_rollout's handler takes it, not the default one
    await asyncio.wait_for(serving, 10)
    await (await start_rollout_server(_config(tmp_path / "r.db"))).stop()  # the store was closed


# --- SubmitTasks --------------------------------------------------------------------------------------


async def test_submit_fills_defaults_and_makes_a_group_of_sessions(start):
    _, stub = await start()
    answer = await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t1", 3), task(group_size=1)]))
    assert answer.task_ids[0] == "t1" and len(answer.task_ids[1]) == 32
    status = await task_status(stub, "t1")
    assert status.group_size == 3 and dict(status.sessions_by_state) == {"PENDING": 3} and not status.released
    assert (await session(stub, "t1.2")).state == PENDING
    statuses = await stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest())
    assert [s.task_id for s in statuses.tasks] == list(answer.task_ids)


@pytest.mark.parametrize(
    "bad, message",
    [
        (task("b", group_size=0), "tasks[1].group_size: must be between 1 and 4096, got 0"),
        (
            task("b", harness=rollout_pb2.HarnessSpec(preset="x")),
            "tasks[1].harness.preset: unknown preset 'x' (known: ",
        ),
        (
            task("b", runtime=rollout_pb2.RuntimeSpec(kind="docker")),
            "tasks[1].runtime.image: required for runtime 'docker'",
        ),
        (task("b", evaluator=rollout_pb2.EvaluatorSpec(kind="python")), "tasks[1].evaluator.callable: '' is not"),
        (task("b", builder="x"), "tasks[1].builder: unknown builder 'x'"),
        (task("b", timeout_seconds=-1), "tasks[1].timeout_seconds: must be a finite number"),
        (task("b b"), "tasks[1].task_id: 'b b' is not"),
        (task("a"), "tasks[1].task_id: 'a' repeats tasks[0]"),
    ],
)
async def test_submit_refuses_every_task_when_one_is_invalid(start, bad, message):
    _, stub = await start()
    error = await rpc_error(stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("a"), bad])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(message), error.details()
    assert list((await stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest())).tasks) == []


async def test_submit_names_every_problem(start):
    _, stub = await start()
    bad = rollout_pb2.Task(task_id="x", group_size=-1, harness=rollout_pb2.HarnessSpec(preset="codex"))
    error = await rpc_error(stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("ok"), bad, bad])))
    assert error.details() == (
        "tasks[1].group_size: must be between 1 and 4096, got -1; tasks[1].instruction: required (empty); "
        "tasks[2].group_size: must be between 1 and 4096, got -1; tasks[2].instruction: required (empty); "
        "tasks[2].task_id: 'x' repeats tasks[1]"
    )


async def test_submit_of_an_existing_task_id_is_already_exists_and_submits_nothing(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("old")]))
    error = await rpc_error(stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("new"), task("old")])))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error.details() == "tasks[1].task_id: task 'old' already exists"
    assert [t.task_id for t in (await stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest())).tasks] == ["old"]


async def test_status_of_unknown_ids_is_not_found(start):
    _, stub = await start()
    error = await rpc_error(stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=["nope"])))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in error.details()
    error = await rpc_error(stub.GetSessionStatus(rollout_pb2.GetSessionStatusRequest(session_id="nope.0")))
    assert error.code() == grpc.StatusCode.NOT_FOUND


# --- dispatch -----------------------------------------------------------------------------------------


async def test_dispatch_by_priority_then_submission_into_free_slots(start):
    _, stub = await start(heartbeat_interval_s=0.3)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("low", 2), task("high", 2, priority=5)]))
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("low2", 1), task("high2", 1, priority=5)]))
    node = await DriverNode(stub, running=2, ready=1).register()

    first = await node.beat()
    assert [a.session_id for a in first.start] == ["high.0", "high.1", "high2.0"]
    assert all(a.attempt == 0 for a in first.start)
    assert first.start[0].task.task_id == "high" and first.start[0].task.builder == "prefix_merging"

    started = time.monotonic()
    full = await node.beat()  # every slot taken: nothing more, after the interval
    assert list(full.start) == [] and time.monotonic() - started >= 0.25

    await node.report("high.1")
    assert [a.session_id for a in (await node.beat()).start] == ["low.0"]
    await node.report("high.0")
    await node.report("low.0")
    assert [a.session_id for a in (await node.beat()).start] == ["low.1", "low2.0"]


async def test_unreported_sessions_fill_slots_until_reported(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", 3)]))
    node = await DriverNode(stub, running=1).register()
    assert [a.session_id for a in (await node.beat()).start] == ["t.0"]
    node.advance("t.0", POSTRUN)  # finished running, but not reported: still holds the slot
    assert list((await node.beat()).start) == []
    await node.report("t.0")
    assert [a.session_id for a in (await node.beat()).start] == ["t.1"]


async def test_sessions_go_only_to_nodes_offering_their_runtime(start):
    _, stub = await start()
    docker = rollout_pb2.RuntimeSpec(kind="docker", image="python:3.12")
    await stub.SubmitTasks(
        rollout_pb2.SubmitTasksRequest(tasks=[task("in-docker", 2, runtime=docker), task("local", 1)])
    )
    local_node = await DriverNode(stub, running=4, runtimes=["local"]).register()
    assert [a.session_id for a in (await local_node.beat()).start] == ["local.0"]
    assert list((await local_node.beat()).start) == []
    docker_node = await DriverNode(stub, running=4, runtimes=["docker", "local"]).register()
    assert [a.session_id for a in (await docker_node.beat()).start] == ["in-docker.0", "in-docker.1"]


async def test_a_waiting_heartbeat_returns_at_once_when_tasks_arrive(start):
    _, stub = await start(heartbeat_interval_s=3.0, node_timeout_s=10.0)
    node = await DriverNode(stub).register()
    waiting = asyncio.create_task(node.beat())
    await asyncio.sleep(0.3)
    assert not waiting.done()
    submitted = time.monotonic()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    response = await asyncio.wait_for(waiting, 2.0)
    assert [a.session_id for a in response.start] == ["t.0"]
    assert time.monotonic() - submitted < 1.0


async def test_a_heartbeat_without_work_waits_the_interval(start):
    _, stub = await start(heartbeat_interval_s=0.5, node_timeout_s=2.0)
    node = await DriverNode(stub).register()
    started = time.monotonic()
    response = await node.beat()
    assert response == rollout_pb2.HeartbeatResponse(max_request_bytes=MAX_ROLLOUT_MESSAGE_BYTES)  # no work
    assert 0.45 <= time.monotonic() - started < 2.0


async def test_a_newer_heartbeat_ends_the_waiting_one_which_assigns_nothing(start):
    _, stub = await start(heartbeat_interval_s=3.0, node_timeout_s=10.0)
    node = await DriverNode(stub).register()
    abandoned = asyncio.create_task(node.beat())
    await asyncio.sleep(0.2)
    newer = asyncio.create_task(node.beat())
    assert await asyncio.wait_for(abandoned, 1.0) == rollout_pb2.HeartbeatResponse(
        max_request_bytes=MAX_ROLLOUT_MESSAGE_BYTES
    )
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    assert [a.session_id for a in (await asyncio.wait_for(newer, 2.0)).start] == ["t.0"]


async def test_heartbeat_records_progress_for_status(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    await asyncio.sleep(0.1)  # some queueing time to measure
    node = await DriverNode(stub).register()
    await node.beat()
    node.advance("t.0", RUNNING, calls=3, init_seconds=1.5, ready_seconds=0.25, running_seconds=2.0)
    await node.beat()
    status = await session(stub, "t.0")
    assert (status.state, status.node_id, status.call_count, status.attempts) == (RUNNING, node.node_id, 3, 1)
    timings = status.stage_timings
    assert timings.queued_seconds >= 0.1
    assert (timings.init_seconds, timings.ready_seconds, timings.running_seconds) == (1.5, 0.25, 2.0)
    assert dict((await task_status(stub, "t")).sessions_by_state) == {"RUNNING": 1}


async def test_heartbeat_refuses_bad_progress_and_tells_unknown_nodes_to_register(start):
    _, stub = await start()
    node = await DriverNode(stub).register()
    node.held["x.0"] = rollout_pb2.SessionProgress(session_id="x.0", state=DONE)
    error = await rpc_error(node.beat())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sessions[0].state: SESSION_STATE_DONE is not a node's stage" in error.details()
    stranger = rollout_pb2.HeartbeatRequest(
        node_id="node-unknown", sessions=[rollout_pb2.SessionProgress(session_id="x.0")]
    )
    assert await stub.Heartbeat(stranger) == rollout_pb2.HeartbeatResponse(reregister=True, cancel=["x.0"])


async def test_a_heartbeat_or_report_under_another_node_s_id_is_refused_and_changes_nothing(start):
    _, stub = await start(max_attempts=1)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", 2)]))
    victim = await DriverNode(stub, running=2).register()
    impostor = await DriverNode(stub).register()
    assert victim.node_id != impostor.node_id and len(victim.secret) == 64 and victim.secret != impostor.secret
    await victim.beat()
    victim.advance("t.0", RUNNING, calls=1)
    await victim.beat()

    listed = await stub.ListNodes(rollout_pb2.ListNodesRequest())
    assert victim.secret.encode() not in listed.SerializeToString()
    for secret in (impostor.secret, "", victim.secret.upper()):
        # Listing nothing, the victim's sessions would be "lost": taken back and, on their last
        # attempt, failed. A report would finish one with a reward of the impostor's choosing.
        beat = stub.Heartbeat(rollout_pb2.HeartbeatRequest(node_id=victim.node_id, node_secret=secret))
        forged = stub.ReportSession(
            rollout_pb2.ReportSessionRequest(
                node_id=victim.node_id,
                node_secret=secret,
                session_id="t.0",
                trajectory=common_pb2.Trajectory(outcome=COMPLETED, reward=1e9),
            )
        )
        for call in (beat, forged):
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (
                f"node '{victim.node_id}': the node_secret sent is not the one RegisterNode issued" in error.details()
            )
            assert victim.secret not in error.details() and impostor.secret not in error.details()
    for session_id, state, calls in (("t.0", RUNNING, 1), ("t.1", INIT, 0)):
        status = await session(stub, session_id)
        assert (status.state, status.node_id, status.call_count, status.attempts) == (state, victim.node_id, calls, 1)
    [info] = [
        node for node in (await stub.ListNodes(rollout_pb2.ListNodesRequest())).nodes if node.node_id == victim.node_id
    ]
    assert info.session_count == 2
    # The victim itself carries on.
    assert not (await victim.beat()).reregister
    await victim.report("t.0", reward=0.5)
    assert (await session(stub, "t.0")).reward == 0.5


async def test_a_request_over_the_server_s_limit_is_refused_and_the_limit_is_told_at_registration(start):
    _, stub = await start(max_request_bytes=64 * 1024)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    node = await DriverNode(stub).register()
    assert node.max_request_bytes == 64 * 1024
    await node.beat()
    error = await rpc_error(node.report("t.0", harness_output="x" * (64 * 1024)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await session(stub, "t.0")).state == INIT
    await node.report("t.0", harness_output="x" * 1024)
    assert (await session(stub, "t.0")).state == DONE


async def test_register_needs_a_runtime(start):
    _, stub = await start()
    error = await rpc_error(stub.RegisterNode(rollout_pb2.RegisterNodeRequest()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "runtimes:" in error.details()


async def test_a_session_the_node_stops_listing_is_lost_and_dispatched_again(start):
    _, stub = await start(max_attempts=2)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    node = await DriverNode(stub).register()
    await node.beat()
    del node.held["t.0"]  # the node lost it (say, its session task crashed)
    again = await node.beat()
    assert [(a.session_id, a.attempt) for a in again.start] == [("t.0", 1)]
    assert (await session(stub, "t.0")).attempts == 2
    del node.held["t.0"]
    await node.beat()
    status = await session(stub, "t.0")
    assert (status.state, status.outcome) == (DONE, FAILED)
    assert status.error == f"node {node.node_id} lost the session (attempt 2 of 2)"
    [failed] = trajectories(await results(stub))
    assert (failed.session_id, failed.outcome, failed.attempt, failed.error) == ("t.0", FAILED, 2, status.error)


async def test_a_silent_node_is_dead_and_its_sessions_go_to_another(start):
    _, stub = await start(node_timeout_s=SHORT_NODE_TIMEOUT_S)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", 2)]))
    silent = await DriverNode(stub).register()
    assert len((await silent.beat()).start) == 2
    survivor = await DriverNode(stub).register()

    async def survivor_took_both() -> bool:
        await survivor.beat()
        return set(survivor.held) == {"t.0", "t.1"}

    await eventually(survivor_took_both)
    assert {a.attempt for a in survivor.assignments.values()} == {1}
    assert (await session(stub, "t.0")).node_id == survivor.node_id
    # The dead node is told to register again and to drop what it held.
    late = await silent.beat()
    assert late.reregister and sorted(late.cancel) == ["t.0", "t.1"]
    error = await rpc_error(silent.report("t.0"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    await survivor.report("t.0")
    await survivor.report("t.1")
    assert [t.attempt for t in trajectories(await results(stub))] == [2, 2]


async def test_a_dead_node_on_the_last_attempt_fails_its_sessions_and_completes_the_group(start):
    _, stub = await start(max_attempts=1, node_timeout_s=SHORT_NODE_TIMEOUT_S)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", 2)]))
    node = await DriverNode(stub, running=1).register()
    await node.beat()
    await node.report("t.0", reward=0.5)
    await node.beat()

    async def failed() -> bool:
        return (await session(stub, "t.1")).state == DONE

    await eventually(failed)
    status = await session(stub, "t.1")
    assert status.outcome == FAILED
    assert status.error == f"node {node.node_id} stopped responding (attempt 1 of 1)"
    group = trajectories(await results(stub))
    assert [(t.session_id, t.outcome) for t in group] == [("t.0", COMPLETED), ("t.1", FAILED)]
    assert group[1].error == status.error and group[1].group_id == "t"


def call(call_id: str, token: int) -> common_pb2.CallRecord:
    return common_pb2.CallRecord(call_id=call_id, prompt_token_ids=[1, 2], sampled_token_ids=[token])


async def test_calls_a_dead_node_delivered_in_heartbeats_reach_the_next_attempt_s_result(start):
    _, stub = await start(node_timeout_s=SHORT_NODE_TIMEOUT_S)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    doomed = await DriverNode(stub).register()
    await doomed.beat()
    doomed.held["t.0"] = rollout_pb2.SessionProgress(
        session_id="t.0", state=RUNNING, call_count=2, new_calls=[call("c0001", 7), call("c0002", 8)]
    )
    await doomed.beat()
    # A retried heartbeat repeats a call: it is kept once.
    del doomed.held["t.0"].new_calls[0]
    await doomed.beat()
    survivor = await DriverNode(stub).register()

    async def survivor_took_it() -> bool:
        await survivor.beat()
        return "t.0" in survivor.held

    await eventually(survivor_took_it)
    survivor.advance("t.0", RUNNING, calls=1)
    survivor.held["t.0"].new_calls.append(call("c0001", 9))
    await survivor.beat()
    await survivor.report("t.0", calls=[call("c0001", 9)])
    [result] = trajectories(await results(stub))
    assert result.attempt == 2
    assert [(c.call_id, list(c.sampled_token_ids)) for c in result.calls] == [("c0001", [9])]
    assert [(c.call_id, list(c.sampled_token_ids)) for c in result.abandoned_calls] == [("c0001", [7]), ("c0002", [8])]


async def test_a_session_failed_with_its_dead_node_keeps_the_calls_it_delivered(start):
    _, stub = await start(max_attempts=1, node_timeout_s=SHORT_NODE_TIMEOUT_S)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    node = await DriverNode(stub).register()
    await node.beat()
    node.held["t.0"] = rollout_pb2.SessionProgress(
        session_id="t.0", state=RUNNING, call_count=1, new_calls=[call("c0001", 7)]
    )
    await node.beat()

    async def failed() -> bool:
        return (await session(stub, "t.0")).state == DONE

    await eventually(failed)
    [result] = trajectories(await results(stub))
    assert result.outcome == FAILED
    assert [c.call_id for c in result.abandoned_calls] == ["c0001"]


# --- Cancel -------------------------------------------------------------------------------------------


async def test_cancel_finishes_pending_sessions_at_once_and_stops_held_ones_through_the_heartbeat(start):
    _, stub = await start(heartbeat_interval_s=3.0, node_timeout_s=10.0)
    await stub.SubmitTasks(
        rollout_pb2.SubmitTasksRequest(tasks=[task("t", 3, metadata={"split": "train"}), task("other")])
    )
    node = await DriverNode(stub, running=1).register()
    assert [a.session_id for a in (await node.beat()).start] == ["t.0"]
    node.advance("t.0", RUNNING)
    waiting = asyncio.create_task(node.beat())
    await asyncio.sleep(0.2)

    answer = await stub.Cancel(rollout_pb2.CancelRequest(task_ids=["t"]))
    assert answer.cancelled == 3
    for session_id in ("t.1", "t.2"):
        status = await session(stub, session_id)
        assert (status.state, status.outcome, status.attempts) == (DONE, CANCELLED, 0)
    response = await asyncio.wait_for(waiting, 1.0)  # woken: the held session must stop
    assert list(response.cancel) == ["t.0"] and list(response.start) == []
    assert (await stub.Cancel(rollout_pb2.CancelRequest(task_ids=["t"]))).cancelled == 0

    assert not (await task_status(stub, "t")).released
    await node.report("t.0", outcome=CANCELLED, reward=0.0)
    assert (await task_status(stub, "t")).released
    group = trajectories(await results(stub))
    assert [(t.session_id, t.outcome) for t in group] == [("t.0", CANCELLED), ("t.1", CANCELLED), ("t.2", CANCELLED)]
    assert group[1].traces == [] and group[1].metadata == {"split": "train"} and group[1].group_id == "t"
    assert (await session(stub, "other.0")).state == PENDING


async def test_a_cancel_is_repeated_until_the_node_reaches_postrun(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    node = await DriverNode(stub).register()
    await node.beat()
    await stub.Cancel(rollout_pb2.CancelRequest(session_ids=["t.0"]))
    assert list((await node.beat()).cancel) == ["t.0"]
    assert list((await node.beat()).cancel) == ["t.0"]  # the first response might have been lost
    node.advance("t.0", POSTRUN)
    assert list((await node.beat()).cancel) == []


async def test_cancel_of_a_held_session_whose_node_dies_finishes_it_cancelled(start):
    _, stub = await start(node_timeout_s=SHORT_NODE_TIMEOUT_S)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    node = await DriverNode(stub).register()
    await node.beat()
    await stub.Cancel(rollout_pb2.CancelRequest(session_ids=["t.0"]))

    async def finished() -> bool:
        return (await session(stub, "t.0")).state == DONE

    await eventually(finished)
    assert (await session(stub, "t.0")).outcome == CANCELLED


async def test_cancel_of_unknown_ids_is_not_found_and_cancels_nothing(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t")]))
    error = await rpc_error(stub.Cancel(rollout_pb2.CancelRequest(task_ids=["t"], session_ids=["t.7"])))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'t.7'" in error.details()
    assert (await session(stub, "t.0")).state == PENDING


# --- ReportSession ------------------------------------------------------------------------------------


async def test_reports_complete_the_group_and_the_server_fills_what_it_knows(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", 2, metadata={"k": "v"})]))
    node = await DriverNode(stub).register()
    await node.beat()
    timings = common_pb2.StageTimings(init_seconds=1, running_seconds=3, postrun_seconds=0.5)
    calls = [common_pb2.CallRecord(call_id="c0001"), common_pb2.CallRecord(call_id="c0002")]
    await node.report("t.1", reward=0.25, stage_timings=timings, calls=calls, harness_exit_code=0)
    status = await task_status(stub, "t")
    assert dict(status.sessions_by_state) == {"DONE": 1, "INIT": 1} and not status.released
    assert await results(stub) == []

    await node.report("t.0", reward=0.75)
    status = await task_status(stub, "t")
    assert status.released and status.mean_reward == 0.5
    done = await session(stub, "t.1")
    assert (done.state, done.outcome, done.reward, done.call_count) == (DONE, COMPLETED, 0.25, 2)
    assert done.stage_timings.running_seconds == 3
    group = trajectories(await results(stub))
    assert [t.session_id for t in group] == ["t.0", "t.1"]
    one = group[1]
    assert (one.trajectory_id, one.task_id, one.group_id, one.attempt) == ("t.1", "t", "t", 1)
    assert one.metadata == {"k": "v"} and len(one.calls) == 2 and one.reward == 0.25
    assert one.stage_timings.running_seconds == 3 and one.stage_timings.queued_seconds > 0


async def test_reports_are_idempotent_and_only_the_holder_may_report(start):
    _, stub = await start()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", 3)]))
    node = await DriverNode(stub, running=2).register()
    other = await DriverNode(stub).register()
    await node.beat()  # t.0 and t.1; t.2 stays pending
    await node.report("t.0", reward=1.0)
    await node.report("t.0", reward=0.0)  # repeated (the first ack was lost): acknowledged, ignored
    assert (await session(stub, "t.0")).reward == 1.0

    refused = [
        (other.report("t.1"), grpc.StatusCode.FAILED_PRECONDITION, f"not held by node '{other.node_id}'"),
        (node.report("t.2"), grpc.StatusCode.FAILED_PRECONDITION, "waits to be dispatched"),
        (node.report("t.9"), grpc.StatusCode.NOT_FOUND, "no session 't.9'"),
        (
            node.report("t.1", outcome=common_pb2.SESSION_OUTCOME_UNSPECIFIED),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outcome",
        ),
        (node.report("t.1", session_id="t.0"), grpc.StatusCode.INVALID_ARGUMENT, "trajectory.session_id"),
        (node.report("t.1", attempt=3), grpc.StatusCode.FAILED_PRECONDITION, "is on attempt 1, not 3"),
        (
            node.report("t.1", reward=float("nan")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "trajectory.reward: must be a finite number, got nan",
        ),
        (
            node.report("t.1", reward=float("inf")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "trajectory.reward: must be a finite number, got inf",
        ),
        (
            node.report("t.1", weight=float("-inf")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "trajectory.weight: must be a finite number",
        ),
    ]
    for call, code, detail in refused:
        error = await rpc_error(call)
        assert error.code() == code and detail in error.details(), error.details()
    assert (await session(stub, "t.1")).state == INIT


# --- WatchResults -------------------------------------------------------------------------------------


async def finish_tasks(stub: Stub, task_ids: list[str]) -> None:
    """Submit one-session tasks and report each, in order, through a driver node."""
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task(task_id) for task_id in task_ids]))
    node = await DriverNode(stub, running=len(task_ids)).register()
    await node.beat()
    for task_id in task_ids:
        await node.report(f"{task_id}.0", reward=float(len(task_id)))


async def test_results_come_in_batches_and_resume_after_a_cursor(start):
    _, stub = await start()
    await finish_tasks(stub, ["a", "bb", "ccc", "dddd", "eeeee"])
    messages = await results(stub, per_batch=2)
    assert [(m.group_count, m.trajectory_count) for m in messages] == [(2, 2), (2, 2), (1, 1)]
    assert [m.cursor for m in messages] == ["2", "4", "5"]
    assert [t.task_id for t in trajectories(messages)] == ["a", "bb", "ccc", "dddd", "eeeee"]
    first = messages[0]
    assert first.uncompressed_bytes == len(codec.decompress(first.zstd_trajectories, max_bytes=1 << 20))

    resumed = await results(stub, cursor="2")
    assert [m.group_count for m in resumed] == [3]
    assert [t.task_id for t in trajectories(resumed)] == ["ccc", "dddd", "eeeee"]
    assert await results(stub, cursor="5") == []


@pytest.mark.parametrize(
    "cursor, detail", [("abc", "not a results cursor"), ("-1", "not a results cursor"), ("9", "past the last")]
)
async def test_a_bad_cursor_is_invalid_argument(start, cursor, detail):
    _, stub = await start()
    await finish_tasks(stub, ["a"])
    error = await rpc_error(results(stub, cursor=cursor))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in error.details()
    error = await rpc_error(results(stub, per_batch=-1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_open_result_stream_sends_groups_as_they_are_released(start):
    _, stub = await start()
    await finish_tasks(stub, ["a"])
    stream = stub.WatchResults(rollout_pb2.WatchResultsRequest())
    first = await asyncio.wait_for(stream.read(), 2.0)
    assert first.cursor == "1"
    pending_read = asyncio.create_task(stream.read())
    await asyncio.sleep(0.3)
    assert not pending_read.done()
    await finish_tasks(stub, ["b"])
    second = await asyncio.wait_for(pending_read, 2.0)
    assert second.cursor == "2" and [t.task_id for t in codec.read_trajectory_batch(second.zstd_trajectories)] == ["b"]
    stream.cancel()


async def test_stopping_the_server_ends_open_streams_as_unavailable(start):
    server, stub = await start()
    stream = stub.WatchResults(rollout_pb2.WatchResultsRequest())
    reading = asyncio.create_task(stream.read())
    await asyncio.sleep(0.2)
    await server.stop()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await asyncio.wait_for(reading, 3.0)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


# --- restart ------------------------------------------------------------------------------------------


async def test_a_restarted_server_keeps_results_and_nodes(start, tmp_path):
    first, stub = await start(node_timeout_s=1.5)
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("done", 1), task("t", 4)]))
    keeps_going = await DriverNode(stub, running=3).register()
    goes_silent = await DriverNode(stub, running=2).register()
    assert [a.session_id for a in (await keeps_going.beat()).start] == ["done.0", "t.0", "t.1"]
    assert [a.session_id for a in (await goes_silent.beat()).start] == ["t.2", "t.3"]
    await keeps_going.report("done.0", reward=0.5)
    await keeps_going.report("t.0", reward=1.0)
    await first.stop()

    _, stub = await start(node_timeout_s=1.5)
    keeps_going.stub = stub
    assert [t.session_id for t in trajectories(await results(stub))] == ["done.0"]
    assert (await session(stub, "t.0")).reward == 1.0
    response = await keeps_going.beat()
    assert not response.reregister and list(response.start) == []
    assert (await session(stub, "t.1")).node_id == keeps_going.node_id
    await keeps_going.report("t.1")

    async def silent_sessions_moved() -> bool:
        await keeps_going.beat()
        return {"t.2", "t.3"} <= set(keeps_going.held)

    await eventually(silent_sessions_moved, timeout_s=8.0)
    assert [keeps_going.assignments[s].attempt for s in ("t.2", "t.3")] == [1, 1]
    await keeps_going.report("t.2")
    await keeps_going.report("t.3")
    group = trajectories(await results(stub, cursor="1"))
    assert [(t.session_id, t.attempt) for t in group] == [("t.0", 1), ("t.1", 1), ("t.2", 2), ("t.3", 2)]
    assert [m.cursor for m in await results(stub)] == ["2"]


async def test_list_nodes_shows_pools_and_held_sessions(start) -> None:
    _, stub = await start()
    assert list((await stub.ListNodes(rollout_pb2.ListNodesRequest())).nodes) == []
    node = await DriverNode(stub, running=2, ready=1).register()
    await stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task("t", group_size=2)]))
    await node.beat()
    node.pools[2].depth = 2
    await node.beat()
    [info] = (await stub.ListNodes(rollout_pb2.ListNodesRequest())).nodes
    assert info.node_id == node.node_id
    assert info.gateway_address == "127.0.0.1:1" and info.base_url == "http://127.0.0.1:2"
    assert list(info.runtimes) == ["local"]
    assert {pool.name: (pool.capacity, pool.depth) for pool in info.pools} == {
        "init": (4, 0),
        "ready": (1, 0),
        "running": (2, 2),
    }
    assert info.session_count == 2
    assert 0 <= info.seconds_since_heartbeat < 5
