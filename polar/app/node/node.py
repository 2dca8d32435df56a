"""A gateway node (`polar serve node`): the gateway, four worker pools, and the link to the rollout server.

One process, one event loop: the gateway (HTTP dialects + GatewayService, gateway/server.py) and the
pools share its `SessionStore`, so opening a session and reading what it recorded cost no hop.

The node registers with the rollout server and then long-polls `Heartbeat`: each request reports the
pools and every session the node holds (stage, calls, stage timings); each response may assign
sessions or cancel some. Heartbeats are strictly sequential, so a session assigned in one response is
listed in the next request, which is how the server tells a lost session from a new one. Every
heartbeat and report carries the node id and the secret RegisterNode issued with it (other nodes
share the node credential, not the secret); registering again replaces both. Each request stays
within the largest the server accepts (told at registration): calls that do not fit a heartbeat wait
for the next one, and a report that does not fit becomes a failed session's, without its calls and
traces, its error naming both sizes, so its group is still released.

A session's life here (pools.py): INIT prepares its runtime, unless the READY buffer holds a
prewarmed one of the same spec; READY waits for a harness slot; RUNNING opens its gateway session,
runs the harness with every base URL pointing at the gateway and the session key as every API key,
and closes the session once the harness is gone (calls in flight still finish and are recorded);
POSTRUN evaluates the workspace, rebuilds the records with the task's builder, verifies the traces,
and reports the trajectory until the server acknowledges it. Every session passes POSTRUN, whatever
happened before (cancelled, timed out, crashed, runtime failed), so its partial calls are kept and
its outcome says why it ended. Only after the report is acknowledged does the node forget it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from gateway.server import RunningGateway, describe, start_gateway
from gateway.sessions import Session
from polar import credentials
from polar.app.node.evaluators import evaluate
from polar.app.node.isolation import NO_ISOLATION, Isolation
from polar.app.node.isolation import resolve as isolation_for
from polar.app.node.pools import Pool, ReadyBuffer, StageClock
from polar.app.node.process import ProcessResult, ProcessStartError
from polar.app.node.runtimes import (
    Limits,
    LocalProvider,
    Runtime,
    RuntimeFailure,
    RuntimeProvider,
    available_providers,
    spec_key,
)
from polar.codec import length_delimited
from polar.config import GatewayConfig, NodeConfig
from polar.grpc_server import serve_until_stopped, stub_taking_bytes
from polar.metrics import gateway_metrics, node_metrics, start_metrics
from polar.rollout.harness import HarnessContext, HarnessError, prepare_launch
from polar.rollout.templates import parse_sources
from polar.sampling_policy import SamplingPolicy
from polar.service_base import Ready, advertised
from polar.trajectory import build, session_trajectory, verify, views_from_protos
from polar.trajectory.records import TrajectoryError
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from polar.xds.member import UpstreamMember
from polar.xds.snapshot import GATEWAY_CLUSTER

log = logging.getLogger("polar.app.node.node")

# How long the gateway may take to record a call still in flight after its harness is gone.
CALLS_SETTLE_TIMEOUT_S = 30.0
# Backoff between attempts to reach the rollout server (heartbeats, reports), in seconds.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
# How long a stopping node waits for the rollout server to take its sessions back.
LEAVING_TIMEOUT_S = 2.0
# Status codes of a report the server will never accept: retrying cannot help.
REPORT_REFUSED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
# Bytes a heartbeat keeps free of calls below the server's limit: each call's field tag and length,
# and its session's length prefix growing, cost a few bytes the calls' own sizes do not count.
HEARTBEAT_CALL_OVERHEAD = 16
_SESSIONS = rollout_pb2.HeartbeatRequest.SESSIONS_FIELD_NUMBER
_NEW_CALLS = rollout_pb2.SessionProgress.NEW_CALLS_FIELD_NUMBER

DEFAULT_PREWARM = rollout_pb2.RuntimeSpec(kind="local")


@dataclass
class SessionRun:
    """One session assigned to this node, from assignment until its report is acknowledged."""

    assignment: rollout_pb2.SessionAssignment
    clock: StageClock = field(default_factory=StageClock)
    state: int = rollout_pb2.SESSION_STATE_INIT  # until it has a runtime; its clock starts with a stage
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    gateway_session: Session | None = None
    task: asyncio.Task | None = None
    # Calls (in completion order) that an acknowledged heartbeat carried to the server.
    calls_delivered: int = 0

    @property
    def session_id(self) -> str:
        return self.assignment.session_id

    def enter(self, state: int, stage: str, since: float | None = None) -> None:
        self.state = state
        self.clock.enter(stage, since)

    def progress(self, with_calls: bool = True) -> tuple[rollout_pb2.SessionProgress, list[bytes]]:
        """Where the session stands, and (unless `with_calls` is off) the calls completed since the
        last delivered heartbeat, serialized whole (bodies the gateway spilled to disk read back,
        prompt ids put in)."""
        session = self.gateway_session
        records = session.records if session is not None else []
        progress = rollout_pb2.SessionProgress(
            session_id=self.session_id, state=self.state, call_count=len(records), stage_timings=self.clock.timings()
        )
        if session is None or not with_calls:
            return progress, []
        return progress, [session.serialized(record) for record in records[self.calls_delivered :]]


@dataclass
class HarnessRun:
    """What RUNNING produced: how the session ended so far, and the harness's own result."""

    outcome: int = common_pb2.SESSION_OUTCOME_COMPLETED
    error: str = ""
    result: ProcessResult | None = None


class Node:
    """The pools and the rollout link of one node; the gateway is started by `start_node`."""

    def __init__(
        self,
        config: NodeConfig,
        gateway: RunningGateway,
        providers: dict[str, RuntimeProvider],
        rollout_address: str,
        gateway_address: str = "",
    ) -> None:
        self.config = config
        self.gateway = gateway
        # Where other machines reach its GatewayService (told at registration); "" = the gateway's own.
        self.gateway_address = gateway_address
        self.providers = providers
        self.rollout_address = rollout_address
        self.init = Pool("init", config.init_workers)
        self.running = Pool("running", config.running_slots)
        self.postrun = Pool("postrun", config.postrun_workers)
        prewarm = [(spec_key(DEFAULT_PREWARM), DEFAULT_PREWARM)] if config.prewarm and "local" in providers else []
        self.ready: ReadyBuffer[Runtime] = ReadyBuffer(config.ready_slots, prewarm)
        self.node_id = ""
        self._node_secret = ""  # proves node_id; issued with it, never logged
        self.max_request_bytes = 0  # the server's receive limit; 0 until registered (or not told)
        self.heartbeat_interval_s = 1.0
        self.runs: dict[str, SessionRun] = {}
        self._channel = credentials.aio_channel(rollout_address, config.rollout_tls_ca)
        self._stub = stub_taking_bytes(rollout_pb2_grpc.RolloutServiceStub, self._channel)
        self._credential = credentials.metadata(credentials.NODE, credentials.of_process())
        self._prewarm_wakeup = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._closing: set[asyncio.Task] = set()  # runtimes being closed: stop waits for them
        self._loops: list[asyncio.Task] = []
        self._warm_names = 0

    @property
    def isolation(self) -> Isolation:
        """How the local runtime sandboxes its commands (polar.app.node.isolation)."""
        local = self.providers.get("local")
        return local.isolation if isinstance(local, LocalProvider) else NO_ISOLATION

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._heartbeat_loop(), name="heartbeats")]
        if self.config.prewarm:
            self._loops.append(asyncio.create_task(self._prewarm_loop(), name="prewarm"))
        self._prewarm_wakeup.set()

    async def wait_registered(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.node_id:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rollout server answered on {self.rollout_address} within {timeout_s:g} s")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Stop at once: harnesses are killed and nothing more is reported. The rollout server is
        told the node is leaving and dispatches its sessions again now, as it would after a crash
        once the node's timeout ran out; should it not answer, that is what happens."""
        tasks = self._loops + [run.task for run in self.runs.values() if run.task is not None] + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(runtime.close() for runtime in self.ready.drain()), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(provider.settle() for provider in self.providers.values()), return_exceptions=True)
        if self.node_id:
            leaving = rollout_pb2.HeartbeatRequest(node_id=self.node_id, node_secret=self._node_secret, leaving=True)
            try:
                await self._stub.Heartbeat(leaving, timeout=LEAVING_TIMEOUT_S, metadata=self._credential)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "rollout server %s: not told that this node stopped: %s", self.rollout_address, exc.details()
                )
        await self._channel.close()

    # --- what heartbeats report --------------------------------------------------------------------

    def pool_status(self) -> list[rollout_pb2.PoolStatus]:
        ready_waiting = sum(run.state == rollout_pb2.SESSION_STATE_READY for run in self.runs.values())
        return [
            rollout_pb2.PoolStatus(
                name="init", capacity=self.init.capacity, depth=self.init.active + self.init.waiting
            ),
            rollout_pb2.PoolStatus(name="ready", capacity=self.ready.capacity, depth=self.ready.size + ready_waiting),
            rollout_pb2.PoolStatus(name="running", capacity=self.running.capacity, depth=self.running.active),
            rollout_pb2.PoolStatus(
                name="postrun", capacity=self.postrun.capacity, depth=self.postrun.active + self.postrun.waiting
            ),
        ]

    def _heartbeat_request(self, with_calls: bool = True) -> tuple[bytes, dict[str, int]]:
        """The request, serialized (the calls go in as the gateway serialized them), and per session
        the calls it delivers once acknowledged (how many of its records, in completion order, the
        server then has or will never get by heartbeat); `with_calls` False: progress only, every new
        call left for a later heartbeat."""
        runs = list(self.runs.values())
        sessions = [run.progress(with_calls) for run in runs]
        head = rollout_pb2.HeartbeatRequest(
            node_id=self.node_id, node_secret=self._node_secret, pools=self.pool_status()
        )
        request = _heartbeat(head, sessions)
        delivers = {run.session_id: run.calls_delivered + len(calls) for run, (_, calls) in zip(runs, sessions)}
        if not self.max_request_bytes or len(request) <= self.max_request_bytes:
            return request, delivers
        # Too large for the server: calls in order while they fit; the rest wait for the next
        # heartbeat, but for a call too large for any, which is skipped (the report carries it).
        room = budget = self.max_request_bytes - len(_heartbeat(head, [(progress, []) for progress, _ in sessions]))
        chosen = []
        for run, (progress, calls) in zip(runs, sessions):
            passed, sent = 0, []
            for call in calls:
                size = len(call) + HEARTBEAT_CALL_OVERHEAD
                if size > room:  # would not fit even alone
                    passed += 1
                elif size <= budget:
                    sent.append(call)
                    budget -= size
                    passed += 1
                else:
                    break
            chosen.append((progress, sent))
            delivers[run.session_id] = run.calls_delivered + passed
        return _heartbeat(head, chosen), delivers

    # --- the rollout link --------------------------------------------------------------------------

    async def _register(self) -> None:
        response = await self._stub.RegisterNode(
            rollout_pb2.RegisterNodeRequest(
                gateway_address=self.gateway_address or self.gateway.grpc_address,
                base_url=self.gateway.base_url,
                pools=self.pool_status(),
                runtimes=sorted(self.providers),
            ),
            timeout=10.0,
            metadata=self._credential,
        )
        self.node_id, self._node_secret = response.node_id, response.node_secret
        self.max_request_bytes = response.max_request_bytes
        self.heartbeat_interval_s = response.heartbeat_interval_seconds or self.heartbeat_interval_s
        log.info("registered with the rollout server at %s as node %s", self.rollout_address, self.node_id)

    async def _heartbeat_loop(self) -> None:
        delay = RETRY_FIRST_S
        with_calls = True
        while True:
            try:
                if not self.node_id:
                    await self._register()
                request, delivers = self._heartbeat_request(with_calls)
                response = await self._stub.Heartbeat(
                    request, timeout=2 * self.heartbeat_interval_s + 5.0, metadata=self._credential
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("rollout server %s: %s; retrying", self.rollout_address, exc.details() or exc.code().name)
                # Too large for a limit the node did not know (the server restarted with a lower
                # one): progress alone goes through, and its response tells the limit.
                with_calls = exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            delay = RETRY_FIRST_S
            with_calls = True
            self.max_request_bytes = response.max_request_bytes or self.max_request_bytes
            for session_id, calls in delivers.items():
                if (run := self.runs.get(session_id)) is not None and run.gateway_session is not None:
                    run.calls_delivered = calls
            if response.reregister:
                # The server declared this node dead and gave its sessions to others: stop them.
                log.warning("the rollout server no longer knows node %s; registering again", self.node_id)
                self.node_id = self._node_secret = ""
                for run in self.runs.values():
                    run.cancel.set()
                continue
            for assignment in response.start:
                self._accept(assignment)
            for session_id in response.cancel:
                if (run := self.runs.get(session_id)) is not None:
                    run.cancel.set()

    def _accept(self, assignment: rollout_pb2.SessionAssignment) -> None:
        if assignment.session_id in self.runs:
            return  # already held: the server repeated itself
        run = SessionRun(assignment)
        self.runs[run.session_id] = run
        run.task = asyncio.create_task(self._run_session(run), name=f"session {run.session_id}")

    async def _report(self, run: SessionRun, trajectory: common_pb2.Trajectory) -> None:
        """Report until the server acknowledges or refuses for good; a report too large for the
        server is replaced, once, by a failed one that says so."""
        delay = RETRY_FIRST_S
        cut = False
        while True:
            # Built anew each time: the node may have registered again under a new id meanwhile.
            request = rollout_pb2.ReportSessionRequest(
                node_id=self.node_id, node_secret=self._node_secret, session_id=run.session_id, trajectory=trajectory
            )
            size = request.ByteSize()
            if not cut and self.max_request_bytes and size > self.max_request_bytes:
                why = f"its report is {size} bytes, over the rollout server's limit of {self.max_request_bytes} bytes"
                log.warning("session %s: %s; reporting it as failed", run.session_id, why)
                trajectory, cut = _too_large(trajectory, why), True
                continue
            try:
                await self._stub.ReportSession(request, timeout=30.0, metadata=self._credential)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not cut:
                    # Over a limit the server did not tell (or that changed): as permanent as one it did.
                    why = f"the rollout server refused its report of {size} bytes: {exc.details()}"
                    log.warning("session %s: %s; reporting it as failed", run.session_id, why)
                    trajectory, cut = _too_large(trajectory, why), True
                    continue
                if exc.code() in REPORT_REFUSED or exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    log.warning("the rollout server refused session %s: %s", run.session_id, exc.details())
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)

    # --- one session -------------------------------------------------------------------------------

    async def _run_session(self, run: SessionRun) -> None:
        runtime: Runtime | None = None
        harness = HarnessRun()
        try:
            try:
                runtime = await self._acquire_runtime(run)
            except RuntimeFailure as exc:
                harness = HarnessRun(common_pb2.SESSION_OUTCOME_FAILED, f"runtime: {exc}")
            if runtime is not None:
                harness = await self._run_harness(run, runtime)
            elif not harness.error:
                harness = HarnessRun(common_pb2.SESSION_OUTCOME_CANCELLED, "cancelled before its runtime was prepared")
            run.enter(rollout_pb2.SESSION_STATE_POSTRUN, "postrun")
            async with self.postrun.slot():
                trajectory = await self._postrun(run, runtime, harness)
            run.clock.stop()
            trajectory.stage_timings.CopyFrom(run.clock.timings())
            await self._report(run, trajectory)
        finally:
            if runtime is not None:
                await self._close(runtime)
            if run.gateway_session is not None:
                # Already gone if a report took longer than the gateway keeps closed sessions.
                with contextlib.suppress(LookupError):
                    self.gateway.store.close(run.session_id)
                    self.gateway.store.forget(run.session_id)
            self.runs.pop(run.session_id, None)
            self._prewarm_wakeup.set()

    async def _acquire_runtime(self, run: SessionRun) -> Runtime | None:
        """The session's runtime (prewarmed, or prepared now); None if it was cancelled first."""
        spec = run.assignment.task.runtime
        provider = self.providers.get(spec.kind)
        if provider is None:
            raise RuntimeFailure(f"this node has no {spec.kind!r} runtime (it has {', '.join(sorted(self.providers))})")
        key = spec_key(spec)
        if self.config.prewarm:
            for unwanted in self.ready.want(key, spec):
                self._spawn(self._close(unwanted))
        prewarmed = self.ready.take(key)
        if prewarmed is not None:
            self._prewarm_wakeup.set()
            return prewarmed[0]
        if (evicted := self.ready.evict_for(key)) is not None:
            self._spawn(self._close(evicted))
        run.enter(rollout_pb2.SESSION_STATE_INIT, "init")
        async with self.init.slot():
            if run.cancel.is_set():
                return None
            runtime = await provider.create(spec, name=run.session_id)
        self._prewarm_wakeup.set()
        return runtime

    async def _run_harness(self, run: SessionRun, runtime: Runtime) -> HarnessRun:
        task = run.assignment.task
        run.enter(rollout_pb2.SESSION_STATE_READY, "ready")
        async with self.running.slot():
            if run.cancel.is_set():
                return HarnessRun(common_pb2.SESSION_OUTCOME_CANCELLED, "cancelled before the harness started")
            run.enter(rollout_pb2.SESSION_STATE_RUNNING, "running")
            store = self.gateway.store
            with contextlib.suppress(LookupError):
                # A session of the same id left from an earlier attempt on this node.
                store.close(run.session_id)
                store.forget(run.session_id)
            session = store.open(
                session_id=run.session_id,
                task_id=task.task_id,
                metadata=dict(task.metadata),
                sampling=SamplingPolicy.from_proto(task.sampling),
                adapter=task.adapter,
            )
            run.gateway_session = session
            try:
                launch = prepare_launch(
                    task.harness,
                    HarnessContext(
                        instruction=task.instruction,
                        base_url=runtime.harness_base_url(self.gateway.base_url),
                        key=session.key,
                        model=self.gateway.gateway.model.name,
                        home=runtime.home,
                        workspace=runtime.workspace,
                        session_id=run.session_id,
                        task_id=task.task_id,
                        context_length=self.gateway.gateway.model.context_length,
                    ),
                    search_path=self.config.harness_path,
                    in_container=runtime.kind == "docker",
                )
                result = await runtime.run(
                    launch.argv,
                    env=launch.env,
                    timeout_s=task.timeout_seconds,
                    output_limit=self.config.harness_output_limit,
                    cancel=run.cancel,
                )
            except (HarnessError, ProcessStartError) as exc:
                return HarnessRun(common_pb2.SESSION_OUTCOME_FAILED, f"harness: {exc}")
            finally:
                store.close(session.session_id)
            await self._calls_settled(session)
        return HarnessRun(*_harness_outcome(result, task, session.in_order()), result)

    async def _calls_settled(self, session: Session) -> None:
        """Wait until calls still in flight when the harness ended are recorded (they abort when
        its connections close)."""

        async def drain() -> None:
            async for _ in session.watch():
                pass

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drain(), CALLS_SETTLE_TIMEOUT_S)

    async def _postrun(self, run: SessionRun, runtime: Runtime | None, harness: HarnessRun) -> common_pb2.Trajectory:
        task = run.assignment.task
        outcome, errors = harness.outcome, [harness.error] if harness.error else []
        reward, evaluator_output, evaluator_metadata = 0.0, "", {}
        harness_ran = harness.result is not None
        records = run.gateway_session.ordered_records() if run.gateway_session is not None else []
        if runtime is not None and harness_ran and outcome != common_pb2.SESSION_OUTCOME_CANCELLED:
            evaluation = await evaluate(
                task.evaluator,
                runtime=runtime,
                task=task,
                session_id=run.session_id,
                output_limit=self.config.harness_output_limit,
                provider=self.providers.get(task.runtime.kind),
                calls=records,
            )
            reward, evaluator_output, evaluator_metadata = evaluation.reward, evaluation.output, evaluation.metadata
            if evaluation.error:
                errors.append(f"evaluator: {evaluation.error}")
                if outcome == common_pb2.SESSION_OUTCOME_COMPLETED:
                    outcome = common_pb2.SESSION_OUTCOME_FAILED
        builder = task.builder or "prefix_merging"
        try:
            calls = views_from_protos(records)
            built = build(builder, calls)
            report = verify(calls, built.traces)
            if not report.ok:
                raise TrajectoryError(report.render())
            trajectory = session_trajectory(records, built, run.session_id)
        except TrajectoryError as exc:
            # The calls are kept whole; only the traces are missing, and the outcome says why.
            errors.append(f"{builder} rebuild: {exc}")
            outcome = common_pb2.SESSION_OUTCOME_FAILED
            trajectory = common_pb2.Trajectory(
                trajectory_id=run.session_id, session_id=run.session_id, builder=builder, calls=records
            )
        versions = [record.policy_version for record in records]
        trajectory.task_id = task.task_id
        trajectory.group_id = task.task_id
        trajectory.reward = reward
        trajectory.weight = 1.0
        trajectory.outcome = outcome
        trajectory.error = "; ".join(errors)
        trajectory.min_policy_version = min(versions, default=0)
        trajectory.max_policy_version = max(versions, default=0)
        trajectory.metadata.update(task.metadata)
        trajectory.metadata.update(evaluator_metadata)
        trajectory.attempt = run.assignment.attempt + 1
        if harness.result is not None:
            trajectory.harness_exit_code = harness.result.exit_code
            trajectory.harness_output = harness.result.output
        trajectory.evaluator_output = evaluator_output
        return trajectory

    # --- prewarming --------------------------------------------------------------------------------

    async def _prewarm_loop(self) -> None:
        """Keep the READY buffer full, using INIT workers only while no session waits for one."""
        while True:
            await self._prewarm_wakeup.wait()
            self._prewarm_wakeup.clear()
            while self.init.waiting == 0 and self.init.free > 0 and (wanted := self.ready.next_to_prepare()):
                key, spec = wanted
                provider = self.providers.get(spec.kind)
                if provider is None:
                    self.ready.forget(key)
                    continue
                # Free and nobody waiting: this takes the slot without suspending, so a session that
                # arrives next still finds the other slots free.
                await self.init.acquire()
                self.ready.preparing += 1
                self._spawn(self._prewarm_one(provider, key, spec))

    async def _prewarm_one(self, provider: RuntimeProvider, key: str, spec: rollout_pb2.RuntimeSpec) -> None:
        """Prepare one runtime into the READY buffer; the caller took an INIT slot for it."""
        self._warm_names += 1
        try:
            runtime = await provider.create(spec, name=f"prewarm-{self._warm_names}")
        except RuntimeFailure as exc:
            # Not retried: the spec stays cold and its sessions prepare it in INIT (and fail there).
            log.warning("prewarming a %s runtime failed: %s", spec.kind, exc)
            self.ready.forget(key)
            return
        finally:
            self.init.release()
            self.ready.preparing -= 1
            self._prewarm_wakeup.set()
        self.ready.put(key, spec, runtime)

    async def _close(self, runtime: Runtime) -> None:
        """Close a runtime; a node stopping meanwhile still waits for it (a container outlives the
        node's process otherwise)."""
        task = asyncio.create_task(runtime.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _heartbeat(
    head: rollout_pb2.HeartbeatRequest, sessions: list[tuple[rollout_pb2.SessionProgress, list[bytes]]]
) -> bytes:
    """A HeartbeatRequest, serialized: `head`, then each session's progress with its calls (records
    serialized) as its new_calls; a message's fields concatenate."""
    parts = [head.SerializeToString()]
    for progress, calls in sessions:
        body = progress.SerializeToString() + b"".join(length_delimited(_NEW_CALLS, call) for call in calls)
        parts.append(length_delimited(_SESSIONS, body))
    return b"".join(parts)


def _too_large(trajectory: common_pb2.Trajectory, why: str) -> common_pb2.Trajectory:
    """The trajectory as a failed session's, without what made its report too large (its calls,
    traces and abandoned calls); the reward, outputs, timings and labels are kept, and the error
    says why."""
    failed = common_pb2.Trajectory()
    failed.CopyFrom(trajectory)
    failed.ClearField("calls")
    failed.ClearField("traces")
    failed.ClearField("abandoned_calls")
    failed.outcome = common_pb2.SESSION_OUTCOME_FAILED
    failed.error = "; ".join(filter(None, [trajectory.error, f"not reported whole: {why}"]))
    return failed


def _harness_outcome(
    result: ProcessResult, task: rollout_pb2.Task, calls: list[common_pb2.CallRecord]
) -> tuple[int, str]:
    """How RUNNING ended, from the harness's result and its calls (in arrival order): (SessionOutcome,
    error text)."""
    if result.cancelled:
        return common_pb2.SESSION_OUTCOME_CANCELLED, "cancelled while the harness ran"
    if calls and calls[0].prompt_too_long:
        # Nothing the harness does after it can fit: a compaction needs a call over the same prompt.
        # The session fails with the reason, never as a harness crash, and is not dispatched again.
        reason = f"the harness's first call does not fit the model's context: {calls[0].error}"
        return common_pb2.SESSION_OUTCOME_FAILED, reason
    if result.timed_out:
        return (
            common_pb2.SESSION_OUTCOME_TIMED_OUT,
            f"the harness ran past its timeout of {task.timeout_seconds:g} s and was killed",
        )
    if result.exit_code != 0:
        return common_pb2.SESSION_OUTCOME_FAILED, f"the harness exited with code {result.exit_code}"
    if not calls:
        return common_pb2.SESSION_OUTCOME_FAILED, "the harness exited without calling the model"
    return common_pb2.SESSION_OUTCOME_COMPLETED, ""


@dataclass
class RunningNode:
    """A started node: its gateway and its pools; `stop()` ends both."""

    gateway: RunningGateway
    node: Node
    _work_root: Path | None  # a temporary folder of our own, removed at stop
    member: UpstreamMember | None = None  # the gateway's HTTP listener in Envoy's control plane
    _stopped: bool = False

    async def stop(self) -> None:
        """Stop the node, then its gateway; stopping again does nothing."""
        if self._stopped:
            return
        self._stopped = True
        await self.node.stop()
        if self.member is not None:
            await self.member.leave()
        await self.gateway.stop()
        if self._work_root is not None:
            shutil.rmtree(self._work_root, ignore_errors=True)


async def start_node(
    node: NodeConfig,
    gateway: GatewayConfig,
    *,
    http_socket: socket.socket | None = None,
    register_timeout_s: float = 60.0,
) -> RunningNode:
    """The gateway started, the node registered with the rollout server at `node.rollout_address`
    and heartbeating.

    Ports 0 in `gateway` pick free ones; its base_url is what harnesses use (Envoy's harness
    listener), "" meaning the gateway's own HTTP address. `http_socket` is served instead of binding
    the gateway's HTTP port (see gateway.server.start_gateway).
    """
    if not node.rollout_address:
        raise ValueError("a node needs the rollout server's address (NodeConfig.rollout_address)")
    own_root = None if node.work_root else Path(tempfile.mkdtemp(prefix="polar-node-"))
    work_root = Path(node.work_root) if node.work_root else own_root
    try:
        # The node serves /metrics itself: the gateway's and its pools' at one address.
        running_gateway = await start_gateway(replace(gateway, metrics_address=""), http_socket=http_socket)
    except BaseException:
        if own_root is not None:
            shutil.rmtree(own_root, ignore_errors=True)
        raise
    pools: Node | None = None
    member: UpstreamMember | None = None
    try:
        # The docker check may wait seconds for an engine, the namespace probe a second: off the event
        # loop, which serves the gateway.
        isolation = await asyncio.to_thread(isolation_for, node.harness_isolation, running_gateway.base_url, work_root)
        providers = await asyncio.to_thread(
            available_providers,
            work_root,
            parse_sources(node.template_roots, node.template_git),
            isolation,
            running_gateway.base_url,
            harness_path=node.harness_path,
            limits=Limits(node.docker_cpus, node.docker_memory_bytes, node.docker_max_processes),
            start_limit=node.docker_start_limit,
        )
        host = gateway.advertise_host or gateway.host
        pools = Node(
            node, running_gateway, providers, node.rollout_address, advertised(host, running_gateway.grpc_port)
        )
        pools.start()
        await pools.wait_registered(register_timeout_s)
        # The Envoy in front of this node (its node id) learns the gateway from the control plane.
        http = advertised(host, running_gateway.http_port)
        control_plane = node.xds_address or node.rollout_address
        member = UpstreamMember(
            control_plane, GATEWAY_CLUSTER, http, envoy=node.envoy_node_id, tls_ca=node.rollout_tls_ca
        )
        await member.start()
        if gateway.metrics_address:
            running_gateway.metrics = await start_metrics(
                gateway.metrics_address, gateway_metrics(running_gateway.store), node_metrics(pools)
            )
    except BaseException:
        if pools is not None:
            await pools.stop()
        if member is not None:
            await member.leave()
        await running_gateway.stop()
        if own_root is not None:
            shutil.rmtree(own_root, ignore_errors=True)
        raise
    return RunningNode(running_gateway, pools, own_root, member)


async def serve_node(
    node: NodeConfig, gateway: GatewayConfig, ready: Ready, http_socket: socket.socket | None = None
) -> None:
    """`polar serve node`: serve until cancelled or SIGINT/SIGTERM, then stop."""

    def on_ready(running: RunningNode) -> None:
        pools = ", ".join(f"{p.name} {p.capacity}" for p in running.node.pool_status())
        isolation = running.node.isolation.mode
        line = (
            f"node {running.node.node_id}: {describe(running.gateway)}; rollout {node.rollout_address}; pools {pools};"
            f" local harnesses isolated: {isolation}"
        )
        # `polar up` warns when harnesses can read the credentials (isolation "none").
        ready(running.gateway.grpc_port, line, isolation=isolation)

    running = await start_node(node, gateway, http_socket=http_socket)
    await serve_until_stopped(running, running.stop, on_ready)
