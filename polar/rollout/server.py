"""The gRPC RolloutService (protos/polar/v1/rollout.proto) over the rollout store (store.py).

A thin servicer: tasks are checked by `tasks`, state lives in the store, and typed errors become
status codes here only. Dispatch happens inside the nodes' long-polled heartbeats. The status codes,
the credential rules and dispatch: docs/design/rollout-server.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from polar import codec
from polar import credentials as creds
from polar.config import RolloutConfig, XdsConfig
from polar.credentials import INFERENCE, NODE, OPERATOR, TRAINER
from polar.grpc_server import (
    InvalidArgument,
    Unavailable,
    bind,
    caller,
    callers,
    new_server,
    serve_until_stopped,
    set_serving,
    status_codes,
)
from polar.metrics import MetricsEndpoint, rollout_metrics, start_metrics
from polar.rollout.store import (
    HELD_STATES,
    POSTRUN,
    InvalidCursor,
    NotAssigned,
    ReleasedGroup,
    Requeued,
    RolloutStore,
    StoreError,
    TaskExists,
    UnknownSession,
    UnknownTask,
    WrongNodeSecret,
)
from polar.rollout.tasks import normalize_task, validate_task
from polar.service_base import Ready, ServiceError, join_host_port
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from polar.xds.membership import Membership, split_address
from polar.xds.rpcs import UpstreamRpcs, WrongCredential, credential_fields
from polar.xds.server import ADS_SERVICE, AggregatedDiscovery

log = logging.getLogger("polar.rollout.server")

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
NODE_SECRET_BYTES = 32
# Serialized trajectories per WatchResults message before compression; a group is never split, so
# one larger group still goes out alone.
BATCH_BYTES = 64 * 1024 * 1024
DEFAULT_GROUPS_PER_BATCH = 16
# Problems named in one INVALID_ARGUMENT before the rest are only counted.
MAX_LISTED_PROBLEMS = 20
# How long `serve_rollout` lets running calls finish after a stop signal before cancelling them.
STOP_GRACE_SECONDS = 5.0


class _Wakeup:
    """Wakes every waiter at once; a waiter that comes after a wake-up waits for the next one."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        """The event the next wake-up sets: take it before checking for work, then wait on it."""
        return self._event


# Who may call what (polar.credentials): nodes only run sessions; the trainer and the operator run tasks.
@callers(
    {
        "SubmitTasks": (TRAINER, OPERATOR),
        "WatchResults": (TRAINER, OPERATOR),
        "GetTaskStatus": (TRAINER, OPERATOR),
        "GetSessionStatus": (TRAINER, OPERATOR),
        "Cancel": (TRAINER, OPERATOR),
        "ListNodes": (TRAINER, OPERATOR),
        "RegisterNode": (NODE,),
        "Heartbeat": (NODE,),
        "ReportSession": (NODE,),
        "JoinUpstream": (NODE, INFERENCE),
        "UpstreamHeartbeat": (NODE, INFERENCE),
        "ListUpstreams": (TRAINER, OPERATOR),
    }
)
@status_codes(
    {
        InvalidCursor: grpc.StatusCode.INVALID_ARGUMENT,
        TaskExists: grpc.StatusCode.ALREADY_EXISTS,
        UnknownTask: grpc.StatusCode.NOT_FOUND,
        UnknownSession: grpc.StatusCode.NOT_FOUND,
        NotAssigned: grpc.StatusCode.FAILED_PRECONDITION,
        WrongNodeSecret: grpc.StatusCode.PERMISSION_DENIED,
        WrongCredential: grpc.StatusCode.PERMISSION_DENIED,
    }
)
class RolloutServicer(UpstreamRpcs, rollout_pb2_grpc.RolloutServiceServicer):
    """See RolloutService in rollout.proto for each rpc's contract."""

    def __init__(
        self,
        store: RolloutStore,
        *,
        heartbeat_interval_s: float,
        node_timeout_s: float,
        max_attempts: int,
        max_request_bytes: int = codec.MAX_ROLLOUT_MESSAGE_BYTES,
        membership: Membership | None = None,
        credentials: creds.Credentials | None = None,
    ) -> None:
        """`credentials`: those the server checks callers with (None: it serves everyone), for the
        names of issued credentials and the hashes its inference servers are told."""
        if not heartbeat_interval_s > 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        if not node_timeout_s > heartbeat_interval_s:
            raise ValueError(
                f"node_timeout_s ({node_timeout_s}) must exceed heartbeat_interval_s ({heartbeat_interval_s}):"
                " a node waiting in its heartbeat would otherwise look dead"
            )
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._store = store
        self._interval = heartbeat_interval_s
        self._node_timeout = node_timeout_s
        self._max_attempts = max_attempts
        self._max_request_bytes = max_request_bytes
        self._releases = _Wakeup()  # groups released: result streams look again
        # Node id -> the event its waiting heartbeat wakes on: set when there may be work for it
        # (sessions pending, cancels) or when a newer heartbeat of the node replaces it.
        self._polls: dict[str, asyncio.Event] = {}
        self._new_cancels: dict[str, set[str]] = {}  # node id -> cancels not yet in a response
        # Monotonic time each node was last heard from. Nodes of an existing store start counting
        # now: a restarted server gives every node a full timeout to come back.
        started = time.monotonic()
        self._heard: dict[str, float] = {node.node_id: started for node in store.nodes()}
        self._stopping = False
        self._reaper: asyncio.Task | None = None
        # Envoy's upstreams and the control plane that tells Envoy about them (polar.xds).
        self.membership = membership or Membership(heartbeat_interval_s, node_timeout_s)
        self.membership.discovery.credentials = credentials
        self._credentials = credentials
        # Node id -> whose credential registered it (its issued name, "" for the stack's own token;
        # none kept by a server that checks no credentials).
        self._node_callers: dict[str, creds.Caller] = {}

    @property
    def store(self) -> RolloutStore:
        return self._store

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_dead_nodes(), name="rollout dead-node check")
        self.membership.start()

    async def stop(self) -> None:
        """End waiting heartbeats (empty responses) and result streams (UNAVAILABLE) now."""
        self._stopping = True
        self._wake_polls()
        self._releases.wake()
        await self.membership.stop()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    # Unary.
    async def SubmitTasks(
        self, request: rollout_pb2.SubmitTasksRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.SubmitTasksResponse:
        tasks = [normalize_task(task) for task in request.tasks]
        problems = []
        first_index: dict[str, int] = {}
        for index, task in enumerate(tasks):
            problems += [f"tasks[{index}].{problem}" for problem in validate_task(task)]
            if task.task_id in first_index:
                problems.append(f"tasks[{index}].task_id: {task.task_id!r} repeats tasks[{first_index[task.task_id]}]")
            first_index.setdefault(task.task_id, index)
        if problems:
            raise InvalidArgument(_listed(problems))
        self._store.add_tasks(tasks, time.time())
        self._wake_polls()
        return rollout_pb2.SubmitTasksResponse(task_ids=[task.task_id for task in tasks])

    # Server-streaming.
    async def WatchResults(
        self, request: rollout_pb2.WatchResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.WatchResultsResponse]:
        if request.max_groups_per_batch < 0:
            raise InvalidArgument(f"max_groups_per_batch: must be >= 0, got {request.max_groups_per_batch}")
        cursor = self._store.parse_cursor(request.cursor)
        max_groups = request.max_groups_per_batch or DEFAULT_GROUPS_PER_BATCH
        # An export ends with what was released when it asked, however long sending that takes.
        end = self._store.last_release() if request.until_caught_up else None
        while True:
            if self._stopping:
                raise Unavailable("the rollout server is stopping; resume from the last cursor")
            released = self._releases.current()
            groups = self._store.released_groups(cursor, max_groups=max_groups, max_bytes=BATCH_BYTES, up_to=end)
            if groups:
                yield await asyncio.to_thread(_results_message, groups)
                cursor = groups[-1].seq
            elif request.until_caught_up:
                return
            else:
                await released.wait()

    # Unary.
    async def GetTaskStatus(
        self, request: rollout_pb2.GetTaskStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetTaskStatusResponse:
        statuses = self._store.task_statuses(list(request.task_ids))
        return rollout_pb2.GetTaskStatusResponse(tasks=statuses)

    # Unary.
    async def ListNodes(
        self, request: rollout_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ListNodesResponse:
        now = time.monotonic()
        return rollout_pb2.ListNodesResponse(
            nodes=[
                rollout_pb2.NodeInfo(
                    node_id=node.node_id,
                    gateway_address=node.gateway_address,
                    base_url=node.base_url,
                    runtimes=node.runtimes,
                    pools=[
                        rollout_pb2.PoolStatus(name=name, capacity=capacity, depth=depth)
                        for name, (capacity, depth) in node.pools.items()
                    ],
                    session_count=self._store.held_count(node.node_id),
                    seconds_since_heartbeat=0.0
                    if node.node_id in self._polls
                    else now - self._heard.get(node.node_id, now),
                    **credential_fields(self._node_callers.get(node.node_id)),
                )
                for node in self._store.nodes()
            ]
        )

    # Unary.
    async def GetSessionStatus(
        self, request: rollout_pb2.GetSessionStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetSessionStatusResponse:
        status = self._store.session_status(request.session_id, time.time())
        return rollout_pb2.GetSessionStatusResponse(status=status)

    # Unary.
    async def Cancel(
        self, request: rollout_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.CancelResponse:
        record = self._store.cancel(list(request.task_ids), list(request.session_ids), time.time())
        for node_id, session_ids in record.held.items():
            self._new_cancels.setdefault(node_id, set()).update(session_ids)
            if (poll := self._polls.get(node_id)) is not None:
                poll.set()
        if record.released_groups:
            self._releases.wake()
        return rollout_pb2.CancelResponse(cancelled=record.cancelled)

    # Unary.
    async def RegisterNode(
        self, request: rollout_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RegisterNodeResponse:
        problems = _pool_problems(request.pools)
        if not request.runtimes:
            problems.append("runtimes: a node must offer at least one runtime kind")
        if problems:
            raise InvalidArgument(_listed(problems))
        name = self._caller_name(context)
        if name:
            for earlier, registered in list(self._node_callers.items()):
                if registered.name == name:
                    self._forget_node(
                        earlier, f"node {earlier} registered again", f"credential {name} registered a new node"
                    )
        node_id = f"node-{uuid.uuid4().hex[:12]}"
        secret = secrets.token_hex(NODE_SECRET_BYTES)
        self._store.add_node(node_id, request, time.time(), secret=secret)
        self._heard[node_id] = time.monotonic()
        if (who := caller(self._credentials, context)) is not None:
            self._node_callers[node_id] = who
        log.info(
            "node %s registered (gateway %s, runtimes %s)",
            node_id,
            request.gateway_address,
            ", ".join(request.runtimes),
        )
        return rollout_pb2.RegisterNodeResponse(
            node_id=node_id,
            heartbeat_interval_seconds=self._interval,
            node_secret=secret,
            max_request_bytes=self._max_request_bytes,
        )

    # Unary, long-polled.
    async def Heartbeat(
        self, request: rollout_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.HeartbeatResponse:
        node_id = request.node_id
        listed = [progress.session_id for progress in request.sessions]
        if not self._store.has_secret(node_id):
            # Declared dead, never registered, or registered before nodes had secrets (a schema 2
            # store): whatever it holds was given to others, or will be once it is declared dead.
            return rollout_pb2.HeartbeatResponse(reregister=True, cancel=listed)
        self._store.check_node_secret(node_id, request.node_secret)
        self._check_node_credential(node_id, context)
        if request.leaving:
            self._forget_node(node_id, f"node {node_id} stopped", "its node stopped")
            log.info("node %s stopped", node_id)
            return rollout_pb2.HeartbeatResponse()
        problems = _pool_problems(request.pools) + _progress_problems(request.sessions)
        if problems:
            raise InvalidArgument(_listed(problems))
        poll = asyncio.Event()
        if (older := self._polls.get(node_id)) is not None:
            older.set()  # it sees it was replaced and ends, assigning nothing
        self._polls[node_id] = poll
        self._heard[node_id] = time.monotonic()
        try:
            beat = self._store.record_heartbeat(
                node_id, request.pools, request.sessions, time.time(), self._max_attempts
            )
            self._taken_back(node_id, "lost by its node", beat.lost)
            in_postrun = [progress.session_id for progress in request.sessions if progress.state == POSTRUN]
            deadline = time.monotonic() + self._interval
            while True:
                poll.clear()  # before looking: a wake-up from now on is not missed
                if self._polls.get(node_id) is not poll or self._stopping:
                    return rollout_pb2.HeartbeatResponse(cancel=beat.foreign, max_request_bytes=self._max_request_bytes)
                start = self._store.dispatch(node_id, time.time())
                new_cancels = self._new_cancels.pop(node_id, None)
                remaining = deadline - time.monotonic()
                if start or new_cancels or remaining <= 0:
                    cancel = self._store.cancels_for(node_id, exclude=in_postrun) + list(beat.foreign)
                    return rollout_pb2.HeartbeatResponse(
                        start=start, cancel=cancel, max_request_bytes=self._max_request_bytes
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(poll.wait(), remaining)
        finally:
            if self._polls.get(node_id) is poll:
                del self._polls[node_id]
                self._heard[node_id] = time.monotonic()

    # Unary.
    async def ReportSession(
        self, request: rollout_pb2.ReportSessionRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReportSessionResponse:
        if self._store.node(request.node_id) is not None:
            self._store.check_node_secret(request.node_id, request.node_secret)
            self._check_node_credential(request.node_id, context)
        # An unknown node holds no session (a dead node's were taken back): its report is refused
        # below, or acknowledged as a repeat when the session is done.
        trajectory = request.trajectory
        problems = []
        if not request.HasField("trajectory"):
            problems.append("trajectory: required")
        elif trajectory.outcome == common_pb2.SESSION_OUTCOME_UNSPECIFIED:
            problems.append("trajectory.outcome: required (how the session ended)")
        for field in ("reward", "weight"):
            if not math.isfinite(value := getattr(trajectory, field)):
                problems.append(f"trajectory.{field}: must be a finite number, got {value}")
        if trajectory.session_id not in ("", request.session_id):
            problems.append(f"trajectory.session_id: {trajectory.session_id!r} is not the reported session")
        if problems:
            raise InvalidArgument(_listed(problems))
        target = self._store.report_target(request.node_id, request.session_id)
        if target is None:
            return rollout_pb2.ReportSessionResponse()  # DONE already: a repeated report
        if trajectory.attempt not in (0, target.attempt):
            raise NotAssigned(
                f"session {request.session_id!r} is on attempt {target.attempt}, not {trajectory.attempt}"
            )
        trajectory.trajectory_id = trajectory.session_id = request.session_id
        trajectory.task_id = trajectory.group_id = target.task.task_id
        trajectory.attempt = target.attempt
        trajectory.stage_timings.queued_seconds = target.queued_seconds
        trajectory.metadata.update(target.task.metadata)
        compressed = await asyncio.to_thread(_compressed, trajectory)
        released = self._store.record_report(
            request.node_id, request.session_id, target.attempt, trajectory, compressed, time.time()
        )
        if released:
            self._releases.wake()
        return rollout_pb2.ReportSessionResponse()

    # --- credentials issued by name ----------------------------------------------------------------

    def _check_node_credential(self, node_id: str, context: grpc.aio.ServicerContext) -> None:
        who = caller(self._credentials, context)
        if who is None:
            return  # a server that checks no credentials
        registered = self._node_callers.setdefault(node_id, who)  # a restarted server learns it here
        if who.name != registered.name:
            raise WrongCredential(f"node {node_id} registered with another credential")

    def _remove_revoked(self) -> None:
        """Forget the nodes and upstreams of credentials no longer issued."""
        if self._credentials is None:
            return
        issued = self.remove_revoked_upstreams()
        for node_id, registered in list(self._node_callers.items()):
            if (name := registered.name) and name not in issued:
                log.warning("node %s: its credential %s was revoked; forgotten", node_id, name)
                self._forget_node(
                    node_id, f"the credential of node {node_id} was revoked", "its credential was revoked"
                )

    def _wake_polls(self) -> None:
        for poll in self._polls.values():
            poll.set()

    # --- dead nodes --------------------------------------------------------------------------------

    async def _reap_dead_nodes(self) -> None:
        while True:
            await asyncio.sleep(min(self._node_timeout / 4, 1.0))
            try:
                self._remove_silent_nodes()
                self._remove_revoked()
            except Exception:
                # The check must outlive a failed round (a full disk, say): the next one retries.
                log.exception("checking for dead nodes failed")

    def _remove_silent_nodes(self) -> None:
        now = time.monotonic()
        for node in self._store.nodes():
            heard = self._heard.setdefault(node.node_id, now)
            if node.node_id in self._polls or now - heard <= self._node_timeout:
                continue
            log.warning("node %s sent no heartbeat for %.1f s: declared dead", node.node_id, now - heard)
            self._forget_node(node.node_id, f"node {node.node_id} stopped responding", "its node died")

    def _forget_node(self, node_id: str, reason: str, why: str) -> None:
        """The node is gone: its sessions are dispatched again (or finished), and it is forgotten."""
        requeued = self._store.remove_node(node_id, reason, time.time(), self._max_attempts)
        self._heard.pop(node_id, None)
        self._node_callers.pop(node_id, None)
        self._new_cancels.pop(node_id, None)
        if (poll := self._polls.pop(node_id, None)) is not None:
            poll.set()  # a heartbeat still waiting ends, assigning nothing
        self._taken_back(node_id, why, requeued)

    def _taken_back(self, node_id: str, why: str, requeued: Requeued) -> None:
        if requeued.pending:
            log.warning("sessions %s (%s, node %s): dispatched again", ", ".join(requeued.pending), why, node_id)
            self._wake_polls()
        if requeued.finished:
            log.warning(
                "sessions %s (%s, node %s): finished without a result", ", ".join(requeued.finished), why, node_id
            )
        if requeued.released_groups:
            self._releases.wake()


def _tls_detail(config: RolloutConfig, running: RunningRollout) -> str:
    if not running.tls_port:
        return ""
    return f" (TLS for other machines on {join_host_port(split_address(config.tls_address)[0], running.tls_port)})"


def _listed(problems: list[str]) -> str:
    shown = problems[:MAX_LISTED_PROBLEMS]
    if len(problems) > len(shown):
        shown.append(f"… and {len(problems) - len(shown)} more problems")
    return "; ".join(shown)


def _pool_problems(pools: Sequence[rollout_pb2.PoolStatus]) -> list[str]:
    return [
        f"pools[{index}].capacity: must be >= 0, got {pool.capacity}"
        for index, pool in enumerate(pools)
        if pool.capacity < 0
    ]


def _progress_problems(sessions: Sequence[rollout_pb2.SessionProgress]) -> list[str]:
    problems = []
    seen = set()
    for index, progress in enumerate(sessions):
        if progress.state not in HELD_STATES:
            problems.append(
                f"sessions[{index}].state: {_state_label(progress.state)} is not a node's stage"
                " (INIT, READY, RUNNING or POSTRUN)"
            )
        if progress.session_id in seen:
            problems.append(f"sessions[{index}].session_id: {progress.session_id!r} is listed twice")
        seen.add(progress.session_id)
        timings = progress.stage_timings
        for field in ("init_seconds", "ready_seconds", "running_seconds", "postrun_seconds"):
            seconds = getattr(timings, field)
            if not math.isfinite(seconds) or seconds < 0:
                problems.append(f"sessions[{index}].stage_timings.{field}: must be finite and >= 0, got {seconds}")
    return problems


def _state_label(state: int) -> str:
    return rollout_pb2.SessionState.Name(state) if state in rollout_pb2.SessionState.values() else str(state)


def _compressed(trajectory: common_pb2.Trajectory) -> bytes:
    return codec.compress(trajectory.SerializeToString())


def _results_message(groups: list[ReleasedGroup]) -> rollout_pb2.WatchResultsResponse:
    """One WatchResults message: the groups' stored trajectories framed as one batch, compressed."""
    serialized = [
        codec.decompress(blob, max_bytes=codec.MAX_ROLLOUT_MESSAGE_BYTES)
        for group in groups
        for blob in group.trajectories
    ]
    batch = codec.trajectory_batch(serialized)
    return rollout_pb2.WatchResultsResponse(
        cursor=str(groups[-1].seq),
        zstd_trajectories=codec.compress(batch),
        group_count=len(groups),
        trajectory_count=len(serialized),
        uncompressed_bytes=len(batch),
    )


@dataclass
class RunningRollout:
    """A started rollout server; `stop()` ends it and closes its store."""

    server: grpc.aio.Server
    servicer: RolloutServicer
    store: RolloutStore
    host: str
    port: int
    tls_port: int = 0  # the TLS listener's port ([rollout] tls_address); 0 = none
    metrics: MetricsEndpoint | None = None  # Prometheus /metrics ([rollout] metrics_address)

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)

    async def stop(self, grace: float = 1.0) -> None:
        if self.metrics is not None:
            await self.metrics.stop()
        await self.servicer.stop()
        await self.server.stop(grace)
        self.store.close()


async def start_rollout_server(config: RolloutConfig) -> RunningRollout:
    """Open (or create) the store and serve the RolloutService on config's host and port (0 picks a
    free one)."""
    store = RolloutStore(config.store)
    try:
        checked = creds.of_process()
        if checked is not None:
            checked.issued.watch(creds.issued_path(checked.folder, config.issued_credentials))
        servicer = RolloutServicer(
            store,
            heartbeat_interval_s=config.heartbeat_interval_s,
            node_timeout_s=config.node_timeout_s,
            max_attempts=config.max_attempts,
            max_request_bytes=config.max_request_bytes,
            credentials=checked,
        )
        server, health_servicer = new_server(
            SERVICE_NAME,
            RolloutServicer.roles,
            max_message_bytes=codec.MAX_ROLLOUT_MESSAGE_BYTES,
            max_receive_bytes=config.max_request_bytes,
            credentials=checked,
            more_services={ADS_SERVICE: AggregatedDiscovery.roles},
        )
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
        # Envoy's control plane on the same port: Envoys point their ADS stream here.
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer.membership.discovery, server)
        port = bind(server, join_host_port(config.host, config.port), "the rollout server")
        tls_port = bind_tls(server, config) if config.tls_cert or config.tls_key or config.tls_address else 0
        await set_serving(health_servicer, SERVICE_NAME)
        await server.start()
        servicer.start()
        metrics = (
            await start_metrics(config.metrics_address, rollout_metrics(servicer)) if config.metrics_address else None
        )
    except BaseException:
        store.close()
        raise
    return RunningRollout(server, servicer, store, config.host, port, tls_port, metrics)


def bind_tls(server: grpc.aio.Server, config: RolloutConfig | XdsConfig) -> int:
    """The TLS listener for other machines (grpc's own TLS) that config's tls_address, tls_cert and
    tls_key describe; its port. ServiceError naming what is missing or unreadable, OSError when the
    address cannot be bound."""
    missing = [name for name in ("tls_address", "tls_cert", "tls_key") if not getattr(config, name)]
    if missing:
        raise ServiceError(f"TLS needs tls_address, tls_cert and tls_key; {', '.join(missing)} not set")
    pem = {}
    for name in ("tls_cert", "tls_key"):
        try:
            pem[name] = Path(getattr(config, name)).read_bytes()
        except OSError as exc:
            raise ServiceError(f"{name}: cannot read {getattr(config, name)}: {exc.strerror}") from None
    try:
        credentials = grpc.ssl_server_credentials([(pem["tls_key"], pem["tls_cert"])])
        port = server.add_secure_port(config.tls_address, credentials)
    except RuntimeError as exc:
        raise ServiceError(f"tls_cert and tls_key are not a PEM certificate and its key: {exc}") from None
    if port == 0:
        raise OSError(
            f"cannot bind the TLS listener to {config.tls_address}: the port is taken or the address is not this machine's"
        )
    return port


async def serve_rollout(config: RolloutConfig, ready: Ready) -> None:
    """`polar serve rollout`: serve until cancelled or SIGINT/SIGTERM, then stop gracefully."""
    try:
        running = await start_rollout_server(config)
    except StoreError as exc:
        raise ServiceError(str(exc)) from None
    await serve_until_stopped(
        running,
        lambda: running.stop(STOP_GRACE_SECONDS),
        lambda r: ready(
            r.port,
            f"rollout: RolloutService on {join_host_port(config.host, r.port)}{_tls_detail(config, r)}; store {config.store}"
            + (f"; metrics {r.metrics.url}" if r.metrics else ""),
        ),
    )
