"""`polar up`: start every service of the stack as a child process, supervise them, stop them all.

Each service is a `ServiceSpec` from its row in polar.service_table (`plan` lists them in start
order); children run in process groups of their own, report readiness through a pipe, and die with the
supervisor. Readiness, ports, stopping and credentials: docs/design/stack.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from polar import credentials
from polar.child_processes import dying_with_parent
from polar.config import STACK_ROLES, GatewayConfig, InferenceConfig, NodeConfig, RolloutConfig, StackConfig
from polar.envoy import envoy_spec
from polar.service_base import ServiceError, ServiceSpec, connectable, join_host_port, listening_socket
from polar.service_table import GATEWAY, INFERENCE, NODE, ROLLOUT

HEALTH_POLL_SECONDS = 0.1
# How often the supervisor looks for an exited child. It does not block in waitid: a stop signal that
# another thread of this process took (gRPC's, the channels') only marks it for the main thread, which
# a blocking waitid would keep asleep until some child exited; a short sleep lets it run the handler.
CHILD_POLL_SECONDS = 0.2
# Whether `supervise` runs (its stop handlers are in place), for request_stop: a SIGTERM sent
# after the stack restored the handlers it found would end the process instead.
_stop_lock = threading.Lock()
_supervising = False


class StackError(ServiceError):
    """A service failed to start or died; the message names it."""


class _StopRequested(Exception):
    """SIGINT or SIGTERM reached the supervisor."""


@dataclass
class Service:
    """A started child."""

    spec: ServiceSpec
    process: subprocess.Popen
    port: int = 0
    reported: dict[str, str] = field(default_factory=dict)  # the `key=value` words of its ready line

    @property
    def endpoint(self) -> str:
        return join_host_port(self.spec.host, self.port)

    @property
    def detail(self) -> str:
        detail = self.spec.detail
        for key, value in self.reported.items():
            detail = detail.replace("{" + key + "}", value)
        return detail

    @property
    def dial_address(self) -> str:
        """Where a local client reaches it (a wildcard listen address is not dialable)."""
        return join_host_port(connectable(self.spec.host), self.port)


def plan(config: StackConfig, role: str = "all", rollout: str = "") -> list[ServiceSpec]:
    """The services `polar up` starts, in start order (each may depend on those before it).

    `role` is this machine's share of a stack spread over several, each joining the rollout server
    at `rollout` (HOST:PORT, required unless role is "all"): "inference", an inference server that
    joins its control plane; "node", an Envoy on that control plane and a gateway node behind it.

    The rollout server comes first: it is also Envoy's control plane (polar.xds), which the
    inference server joins once it serves and the node joins with its gateway's HTTP listener, so
    Envoy learns both over ADS, and would learn any server started later. Envoy stands in front of
    the node's gateway (harnesses use its harness listener, whose URL Envoy reports) and between that
    gateway and the inference servers (its inference listener, unless [gateway] inference_address
    names another address).

    The gateway's HTTP port is fixed in `config` (`run_stack` binds it first and hands the node the
    socket), so the endpoint table names it before the node starts."""
    gw = config.gateway
    if gw.port == 0:
        raise ValueError("the gateway's HTTP port must be fixed before planning (run_stack binds it)")
    inference = gateway_inference_address(dataclasses.replace(gw, inference_address=""), config.inference)
    gateway_http = join_host_port(connectable(gw.host), gw.port)
    gw = dataclasses.replace(gw, inference_address=gw.inference_address or "{envoy}")
    if role not in STACK_ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(STACK_ROLES)}")
    if role != "all" and not rollout:
        raise ValueError(f"a machine of role {role!r} joins a rollout server elsewhere: give its HOST:PORT (--rollout)")
    rollout = rollout or "{rollout}"
    control_plane = config.envoy.xds_address or rollout
    node = dataclasses.replace(
        config.node,
        rollout_address=config.node.rollout_address or rollout,
        envoy_node_id=config.envoy.node_id,
        xds_address=config.node.xds_address or config.envoy.xds_address,
    )
    inf = dataclasses.replace(config.inference, rollout_address=config.inference.rollout_address or control_plane)
    specs = {
        "rollout": rollout_spec(config.rollout),
        "inference": inference_spec(inf),
        "envoy": envoy_spec(dataclasses.replace(config.envoy, xds_address=control_plane), [inference], gateway_http),
        "node": dataclasses.replace(
            node_spec(node, gw, config.inference, base_url=gw.base_url or "{envoy.base_url}"), takes_http_socket=True
        ),
    }
    shares = {"all": list(specs), "inference": ["inference"], "node": ["envoy", "node"]}
    return [specs[name] for name in shares[role]]


def inference_spec(inf: InferenceConfig) -> ServiceSpec:
    """`polar serve inference` with the given settings."""
    if inf.engine == "scripted":
        detail = f"scripted engine, {inf.script}"
    elif inf.engine == "upstream":
        detail = f"upstream engine, {inf.upstream_api} at {inf.upstream_url}, tokenizer {inf.model}"
    else:
        detail = f"{inf.engine} engine, model {inf.model}"
    return INFERENCE.spec(inf, detail=detail)


def gateway_inference_address(gw: GatewayConfig, inf: InferenceConfig) -> str:
    """The gRPC address the gateway dials: its own setting, else the inference server directly."""
    if gw.inference_address:
        return gw.inference_address
    return "{inference}" if inf.port == 0 else join_host_port(connectable(inf.host), inf.port)


def gateway_spec(gw: GatewayConfig, inf: InferenceConfig, base_url: str = "") -> ServiceSpec:
    """`polar serve gateway` with the given settings; its readiness port is the GatewayService's.
    `base_url` (else the config's) is the URL harnesses use (Envoy's harness listener), which the
    gateway reports."""
    gw = dataclasses.replace(gw, inference_address=gateway_inference_address(gw, inf), base_url=base_url or gw.base_url)
    return GATEWAY.spec(gw, detail=_gateway_detail(gw, inf))


def _gateway_detail(gw: GatewayConfig, inf: InferenceConfig) -> str:
    http = f"http://{join_host_port(connectable(gw.host), gw.port)}" if gw.port else "a free port (in its log)"
    # A "{name}" address is another service of the stack, known once it is up: name the service.
    return f"HTTP {http}, inference via {gateway_inference_address(gw, inf).strip('{}')}"


def rollout_spec(rollout: RolloutConfig) -> ServiceSpec:
    """`polar serve rollout` with the given settings."""
    return ROLLOUT.spec(rollout, detail=f"tasks and results in {rollout.store}")


def node_spec(node: NodeConfig, gw: GatewayConfig, inf: InferenceConfig, base_url: str = "") -> ServiceSpec:
    """`polar serve node`: a gateway with the given settings plus the session pools, working for the
    rollout server at `node.rollout_address`. Its readiness port is its GatewayService's."""
    gw = dataclasses.replace(gw, inference_address=gateway_inference_address(gw, inf), base_url=base_url or gw.base_url)
    pools = f"init {node.init_workers}, ready {node.ready_slots}, running {node.running_slots}, postrun {node.postrun_workers}"
    detail = f"{_gateway_detail(gw, inf)}, reports to {node.rollout_address.strip('{}')}; pools {pools}"
    # The isolation the node found it can make, from its ready line.
    detail += "; local harnesses isolated: {isolation}"
    return NODE.spec(node, gw, detail=detail)


@contextlib.contextmanager
def running(
    spec: ServiceSpec, startup_timeout_s: float, stop_timeout_s: float, http_socket: socket.socket | None = None
) -> Iterator[Service]:
    """One service, started and healthy inside the block and stopped after it (for scripts and tests
    that need a server without the whole stack). `http_socket` (a `listening_socket`) is handed to a
    gateway or node as its HTTP listener; the caller still holds and closes its own copy."""
    service, ready_fd = _spawn(spec, http_socket=http_socket)
    try:
        _await_ready(service, ready_fd, startup_timeout_s)
        yield service
    finally:
        _stop(service, stop_timeout_s)


def run_stack(
    config: StackConfig,
    out: TextIO = sys.stdout,
    on_ready: Callable[[dict[str, str]], None] | None = None,
    jobs: Sequence[ServiceSpec] = (),
    role: str = "all",
    rollout: str = "",
) -> int:
    """Start every service, print the endpoint table, supervise until a stop signal or until a job
    finishes; return 0. `on_ready` gets each service's dial address once all serve (it must not
    block: supervision waits). `role` and `rollout`: this machine's share of the stack (`plan`). `jobs` start after the stack's own services, in order (`polar train`'s
    trainer); they may use their addresses ("{rollout}", ...).

    Raises StackError when a service fails to start or dies; every child is stopped either way.
    """
    gw = config.gateway
    try:
        gateway_http = listening_socket(gw.host, gw.port)
    except OSError as exc:
        raise StackError(
            f"the gateway's HTTP port {join_host_port(gw.host, gw.port)} cannot be bound: {exc.strerror}"
        ) from None
    folder = os.environ.get(credentials.ENV_VAR) or None
    try:
        # The rollout server's machine keeps the stack's own tokens; another joins with its own.
        issued = credentials.ensure(folder) if role == "all" else credentials.for_machine(role, folder)
    except credentials.CredentialsError as exc:
        gateway_http.close()
        raise StackError(str(exc)) from None
    except OSError as exc:
        gateway_http.close()
        raise StackError(f"cannot keep the stack's credentials in {credentials.default_folder()}: {exc}") from None
    with credentials.handed_to_children(issued), gateway_http:
        bound = dataclasses.replace(config, gateway=dataclasses.replace(gw, port=gateway_http.getsockname()[1]))
        specs = plan(bound, role, rollout)
        supervise(
            [*specs, *jobs],
            startup_timeout_s=config.startup_timeout_s,
            stop_timeout_s=config.stop_timeout_s,
            out=out,
            on_ready=on_ready,
            http_socket=gateway_http,
        )
    return 0


def supervise(
    specs: Sequence[ServiceSpec],
    *,
    startup_timeout_s: float,
    stop_timeout_s: float,
    out: TextIO = sys.stdout,
    on_ready: Callable[[dict[str, str]], None] | None = None,
    http_socket: socket.socket | None = None,
    command: str = "polar up",
) -> None:
    """Start `specs` in order (each once the one before serves), print the endpoint table (headed by
    `command`), supervise until a stop signal or until a job finishes, then stop every child.
    `http_socket` goes to the service that takes it (the node); the children call with the
    credentials in $POLAR_CREDENTIALS. Raises StackError when a service fails to start or dies."""
    children: list[Service] = []
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    global _supervising
    try:
        with _stop_lock:
            _supervising = True
        for spec in specs:
            handed = http_socket if spec.takes_http_socket else None
            child, ready_fd = _spawn(spec, {c.spec.name: c for c in children}, handed)
            children.append(child)
            if handed is not None:
                # Only the child serves it now: with the supervisor's copy closed, connections
                # are refused once that child is gone rather than queued for nobody.
                handed.close()
            _await_ready(child, ready_fd, startup_timeout_s)
        _print_table(children, out, command)
        if any(c.reported.get("isolation") == "none" for c in children):
            print(
                f"{command}: harnesses of the local runtime run as this user without isolation and can read the"
                f" stack's credentials in {os.environ.get(credentials.ENV_VAR)} (the node's harness_isolation is"
                " 'none', or this machine cannot make user namespaces); the docker runtime keeps them out of reach",
                file=sys.stderr,
                flush=True,
            )
        if on_ready is not None:
            on_ready({c.spec.name: c.dial_address for c in children})
        _supervise(children)
    except _StopRequested:
        pass
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave children behind.
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)
        with _stop_lock:
            _supervising = False
        _stop_all(children, stop_timeout_s)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested


def request_stop() -> None:
    """Ends `supervise` (`run_stack`'s too) from another thread (a job started by `on_ready` that is done),
    as SIGTERM from outside would; nothing once the stack is stopping or stopped.

    The signal goes to the main thread itself, which alone runs Python's signal handlers: it wakes from
    its sleep between looks for exited children at once (sent to the process, another thread may take
    it, and the stop waits for the main thread's next look)."""
    with _stop_lock:
        if _supervising:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)


def _spawn(
    spec: ServiceSpec, started: dict[str, Service] | None = None, http_socket: socket.socket | None = None
) -> tuple[Service, int]:
    """Start the child (`started`: each service already up by name, for "{name}" and "{name.key}"
    arguments; `http_socket`: its HTTP listener, passed as `--http-fd`); return it and the read end
    of its readiness pipe."""
    argv = [_resolve(arg, started or {}) for arg in spec.argv]
    read_fd, write_fd = os.pipe()
    pass_fds = [write_fd]
    if http_socket is not None:
        argv += ["--http-fd", str(http_socket.fileno())]
        pass_fds.append(http_socket.fileno())
    try:
        process = subprocess.Popen(
            dying_with_parent([*argv, "--ready-fd", str(write_fd)]),
            stdin=subprocess.DEVNULL,
            pass_fds=pass_fds,
            process_group=0,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        # Only the child holds the write end now, so its exit shows as end-of-file.
        os.close(write_fd)
    return Service(spec, process), read_fd


def _resolve(arg: str, started: dict[str, Service]) -> str:
    """An argument with "{name}" or "{name.key}" of a started service replaced (see ServiceSpec)."""
    if not (arg.startswith("{") and arg.endswith("}")):
        return arg
    name, _, key = arg[1:-1].partition(".")
    service = started.get(name)
    if service is None:
        return arg
    if not key:
        return service.dial_address
    if key not in service.reported:
        raise StackError(f"{name} did not report {key!r}, which a later service needs")
    return service.reported[key]


def _await_ready(child: Service, ready_fd: int, timeout_s: float) -> None:
    """Read the child's port from its readiness pipe, then wait until its health check says SERVING."""
    deadline = time.monotonic() + timeout_s
    with os.fdopen(ready_fd, "rb", buffering=0) as ready:
        line = _await_ready_line(child, ready, deadline, timeout_s)
    port, *words = line.split()
    child.port = int(port)
    child.reported = dict(word.split("=", 1) for word in words)
    _await_healthy(child, deadline, timeout_s)


def _await_ready_line(child: Service, ready, deadline: float, timeout_s: float) -> str:
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StackError(f"{child.spec.name} did not start within {timeout_s:g} s")
        if not select.select([ready], [], [], remaining)[0]:
            continue
        chunk = ready.read(64)
        if not chunk:
            # Every writer closed the pipe without a port: the child is gone or going.
            try:
                code = child.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                raise StackError(f"{child.spec.name} closed its readiness pipe without reporting a port") from None
            raise StackError(f"{child.spec.name} {_exit_text(code)} before it was ready")
        data += chunk
    return data.split(b"\n", 1)[0].decode()


def _await_healthy(child: Service, deadline: float, timeout_s: float) -> None:
    target = join_host_port(connectable(child.spec.host), child.port)
    request = health_pb2.HealthCheckRequest(service=child.spec.health_service)
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            code = child.process.poll()
            if code is not None:
                raise StackError(f"{child.spec.name} {_exit_text(code)} before it was healthy")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StackError(f"{child.spec.name} was not healthy on {target} within {timeout_s:g} s")
            try:
                response = stub.Check(request, timeout=min(remaining, 2.0))
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet, or the service is not registered yet
            time.sleep(HEALTH_POLL_SECONDS)


def _supervise(children: list[Service]) -> None:
    """Block until a job finishes (return), a child exits otherwise (raise StackError) or a stop
    signal arrives."""
    while True:
        # WNOWAIT leaves the exited child for Popen to reap, so its returncode stays right.
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if info is None:
            time.sleep(CHILD_POLL_SECONDS)
            continue
        child = next((c for c in children if c.process.pid == info.si_pid), None)
        if child is None:
            os.waitpid(info.si_pid, 0)  # not a service; reap it so waitid does not return it again
            continue
        code = child.process.wait()
        if child.spec.finishes and code == 0:
            return
        raise StackError(f"{child.spec.name} (pid {child.process.pid}) {_exit_text(code)}")


def _stop_all(children: list[Service], timeout_s: float) -> None:
    for child in reversed(children):
        _stop(child, child.spec.stop_timeout_s or timeout_s)


def _stop(child: Service, timeout_s: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after timeout_s, reap the child."""
    pgid = child.process.pid
    if child.process.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
        try:
            child.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Whatever is left in the group (the child itself after the timeout, or processes it started).
    _signal_group(pgid, signal.SIGKILL)
    child.process.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # the group is already empty


def _print_table(children: list[Service], out: TextIO, command: str) -> None:
    rows = [("service", "endpoint", "pid", "")] + [
        (c.spec.name, c.endpoint, str(c.process.pid), c.detail) for c in children
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    count = f"{len(children)} service{'s' if len(children) != 1 else ''}"
    print(f"{command}: {count} running; Ctrl-C stops {'them' if len(children) != 1 else 'it'}", file=out)
    for row in rows:
        print(("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3]).rstrip(), file=out)
    out.flush()


def _exit_text(code: int) -> str:
    # Popen reports death by a signal as the negative signal number.
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
