"""Rollout throughput: sessions/s and submit→RUNNING latency, with and without prewarming.

Every service runs in its own process, as `polar up` starts them:

    bench ──SubmitTasks/WatchResults──▶ rollout server (SQLite store)
                                          ▲ heartbeats, reports
    harness ──HTTP──▶ Envoy ──▶ node (gateway + pools) ──gRPC──▶ Envoy ──▶ inference (scripted engine)

The harness is trivial on purpose, so the bench measures the rollout machinery, not an agent: a
Python program (standard library, started with -S) that makes one Chat Completions call through Envoy
with its session key, holds the session for --hold seconds, and exits 0. The runtime is what a task
of a code repository needs, kept small: the workspace is copied from a template folder (a few source
files), then prepared by committing it to a fresh git repository and creating a Python virtual
environment (`python -m venv --without-pip`), which is the INIT work prewarming takes off the path.

A point is (concurrent sessions C, prewarming on or off). Each point gets a fresh rollout server
(its own store) and a fresh node with C RUNNING slots and C READY slots; with prewarming the bench
waits until the node reports a full READY buffer (ListNodes). Then C sessions are submitted in one
SubmitTasks call (tasks of 8 sessions each, one GRPO group per task), and the results stream is
followed until every group is released. Per point:

* sessions/s: C over the time from the submit to the last group's release, and "added": that time
  minus the hold, what the machinery itself took;
* submit→RUNNING per session: the server's queued time plus the node's INIT and READY time, from
  the stage timings each trajectory carries (the moment the node starts the harness's stage);
* peak RUNNING: the most sessions whose RUNNING stages overlap, from the same timings (all sessions
  were submitted at one instant, so each stage's start is known relative to it): 256 means the node
  held all 256 harnesses at once;
* CPU time per session of the node process itself, of what it waited for (harnesses, prepare steps,
  evaluators) and of the rollout server (from /proc), since everything shares the machine's cores.

    python scripts/bench_rollout.py --quick     # C = 64, under a minute on 2 CPU cores
    python scripts/bench_rollout.py             # C = 64 and 256

Credentials: by default every service runs with the stack's credentials, as `polar up` runs them (each
gRPC call carries its role's token, every server checks it; polar.credentials); `--credentials off`
runs them open. `--credentials compare` measures what the check costs: each point on a stack with
credentials and on one without, in rounds that alternate which goes first (so drift on a shared
machine falls on both; --quick: the prewarmed point only, 3 rounds), then the medians side by side
with their ratio, against the check's 2% budget.

Runtimes: by default sessions run in the local runtime inside the namespace sandbox the node's
harness_isolation makes (`auto`, as `polar up`). `--runtime docker` puts the docker runtime beside it
in one run: each point (32 sessions by default, prewarmed and not) on containers of the base image
(scripts/setup_docker.sh) and on the namespace runtime with `harness_isolation = "network"` (what a
container reaches: the harness URL alone), alternating, with the same template, prepare steps and
harness (the image's python3 in the container). Per docker point, the most `docker run`s in flight at
once (the node's docker client is wrapped to log each), against the node's docker_start_limit. Then a
runtime's own start and removal cost, one at a time, outside the node: create (an empty workspace, no
prepare), a first command (`true`), and removal, for a container and for a namespace sandbox.
The engine's own CPU (dockerd, containerd, the containers' processes) is not in the CPU columns.

    python scripts/bench_rollout.py --runtime docker --quick   # C = 8, a 1 s hold: about a minute
    python scripts/bench_rollout.py --runtime docker           # C = 32

Prints a table and writes JSON (default bench-results/rollout.json; rollout-credentials.json when
comparing credentials; rollout-docker.json with --runtime docker).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from polar import credentials as creds
from polar.app.node.isolation import resolve as resolve_isolation
from polar.app.node.runtimes import DockerProvider, LocalProvider, RuntimeProvider, engine_problem
from polar.app.stack import inference_spec, node_spec, rollout_spec, running
from polar.codec import MAX_ROLLOUT_MESSAGE_BYTES, read_trajectory_batch
from polar.config import EnvoyConfig, GatewayConfig, InferenceConfig, NodeConfig, RolloutConfig
from polar.envoy import render_config
from polar.envoy import running as running_envoy
from polar.service_base import join_host_port, listening_socket
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

import benchmark_common

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
GROUP_SIZE = 8
HOST = "127.0.0.1"
# Short, so the node's pools as the server last heard them (ListNodes) are never stale for long.
HEARTBEAT_INTERVAL_S = 0.2
CREDENTIAL_BUDGET_PCT = 2.0  # what the credential check may cost in sessions/s
BASE_IMAGE = "polar-base:bookworm"  # scripts/setup_docker.sh builds it
DOCKER_START_LIMIT = 4  # the node's default docker_start_limit
# A harness URL for the start-cost samples: its relay is made, never dialled.
UNUSED_HARNESS_URL = "http://127.0.0.1:9/v1"

HARNESS = """\
import http.client, json, os, sys, time, urllib.parse
url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
body = {"model": os.environ["POLAR_MODEL"], "max_tokens": 16,
        "messages": [{"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}]}
connection.request("POST", url.path + "/chat/completions", json.dumps(body),
                   {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
reply = connection.getresponse()
reply.read()
if reply.status != 200:
    sys.exit(f"the gateway answered {reply.status}")
time.sleep(float(os.environ["BENCH_HOLD_SECONDS"]))
"""


@dataclass
class Point:
    sessions: int
    prewarm: bool
    runtime: str  # "namespace" (the local runtime, sandboxed) or "docker"
    isolation: str  # the node's harness_isolation
    credentials: bool  # the services checked every call's credential
    seconds: float  # submit → last group released
    added_seconds: float  # seconds minus the hold: what the machinery took
    sessions_per_s: float
    submit_to_running_p50_ms: float
    submit_to_running_p90_ms: float
    submit_to_running_max_ms: float
    queued_p50_ms: float
    init_p50_ms: float
    ready_p50_ms: float
    peak_running: int
    completed: int
    node_cpu_ms_per_session: float  # the node process alone (gateway, pools, heartbeats)
    children_cpu_ms_per_session: float  # the harnesses and prepare steps it ran
    rollout_cpu_ms_per_session: float
    docker_runs: int  # `docker run`s the node made during the point (docker only)
    most_starts_at_once: int  # the most of them in flight at one time
    errors: list[str]


@dataclass
class RuntimeCost:
    """One runtime's own cost, measured alone: create, a first command, removal (medians)."""

    runtime: str
    samples: int
    create_p50_ms: float
    create_max_ms: float
    first_command_p50_ms: float
    removal_p50_ms: float
    removal_max_ms: float


def main() -> int:
    args = _parse_args()
    docker = args.runtime == "docker"
    if docker and (problem := _docker_problem()):
        print(f"bench_rollout: --runtime docker: {problem}", file=sys.stderr)
        return 2
    if args.sessions:
        sizes = tuple(args.sessions)
    else:
        sizes = ((8,) if args.quick else (32,)) if docker else (64,) if args.quick else (64, 256)
    hold = args.hold if args.hold is not None else (1.0 if docker and args.quick else 2.0 if args.quick else 4.0)
    compare = args.credentials == "compare"
    # Compared: every point on both setups, in rounds that alternate which goes first.
    setups = (False, True) if compare else (args.credentials == "on",)
    rounds = 3 if compare else 1
    prewarm_modes = (True,) if compare and args.quick else (False, True)
    runtimes = ("docker", "namespace") if docker else ("namespace",)
    load_before = os.getloadavg()[0]
    points: list[Point] = []
    costs: list[RuntimeCost] = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-rollout-") as scratch_name, contextlib.ExitStack() as stack:
        scratch = Path(scratch_name)
        template = _template(scratch / "template")
        issued = creds.ensure(scratch / "credentials")
        runs_log = _logging_docker(scratch) if docker else None
        shared = {
            checked: stack.enter_context(_shared_services(scratch, max(sizes), issued if checked else None))
            for checked in setups
        }
        for size in sizes:
            for prewarm in prewarm_modes:
                for round_index in range(rounds):
                    for checked in setups if round_index % 2 == 0 else setups[::-1]:
                        for runtime in runtimes if (round_index + prewarm) % 2 == 0 else runtimes[::-1]:
                            point = _measure(
                                scratch,
                                size,
                                prewarm,
                                hold,
                                template,
                                *shared[checked],
                                issued if checked else None,
                                f"{round_index}",
                                runtime=runtime,
                                isolation="network" if docker else "auto",
                                runs_log=runs_log if runtime == "docker" else None,
                            )
                            points.append(point)
                            _print_point(point)
        if docker:
            samples = 3 if args.quick else 20
            costs = [_runtime_cost(scratch, runtime, samples) for runtime in runtimes]
    report = {
        "benchmark": "rollout",
        "machine": benchmark_common.machine("grpcio"),
        "load_1min_before": load_before,
        "hold_seconds": hold,
        "group_size": GROUP_SIZE,
        "credentials": args.credentials,
        "runtime": args.runtime,
        "points": [asdict(point) for point in points],
    }
    _print_table(points, hold, load_before)
    if docker:
        report["docker_start_limit"] = DOCKER_START_LIMIT
        report["runtime_costs"] = [asdict(cost) for cost in costs]
        _print_costs(costs)
    if compare:
        report["comparison"] = _comparison(points)
        _print_comparison(report["comparison"], rounds)
    default_out = "rollout-credentials.json" if compare else "rollout-docker.json" if docker else "rollout.json"
    benchmark_common.write_json(report, args.out, default_out)
    completed = all(point.completed == point.sessions for point in points)
    capped = all(point.most_starts_at_once <= DOCKER_START_LIMIT for point in points)
    return 0 if completed and capped else 1


def _docker_problem() -> str | None:
    """Why the docker runtime cannot run here, or None."""
    problem = engine_problem()
    if problem is None and subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode:
        problem = f"no image {BASE_IMAGE} on this machine: build it with scripts/setup_docker.sh"
    return problem


def _logging_docker(scratch: Path) -> Path:
    """A folder holding a docker client that, where BENCH_DOCKER_LOG names a file, appends "start T"
    and "end T" around each `docker run` to it, and otherwise is the real client."""
    folder = scratch / "docker-client"
    folder.mkdir()
    real = shutil.which("docker")
    client = folder / "docker"
    client.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = run ] && [ -n "$BENCH_DOCKER_LOG" ]; then\n'
        '  echo "start $(date +%s.%N)" >> "$BENCH_DOCKER_LOG"\n'
        f'  {real} "$@"; code=$?\n'
        '  echo "end $(date +%s.%N)" >> "$BENCH_DOCKER_LOG"\n'
        "  exit $code\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    client.chmod(0o755)
    return folder


def _starts(log: Path) -> tuple[int, int]:
    """The `docker run`s a log holds, and the most in flight at one time (an end sorts before a
    start at the same instant)."""
    if not log.exists():
        return 0, 0
    stamps = sorted(
        (float(stamp), kind == "start") for kind, stamp in (line.split() for line in log.read_text().splitlines())
    )
    now = peak = 0
    for _, starting in stamps:
        now += 1 if starting else -1
        peak = max(peak, now)
    return sum(starting for _, starting in stamps), peak


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """os.environ with `variables` set (children started meanwhile inherit them), then as it was."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _runtime_cost(scratch: Path, runtime: str, samples: int) -> RuntimeCost:
    """A runtime's create, first command and removal, `samples` times one after the other."""
    work_root = _fresh(scratch / f"cost-{runtime}")
    if runtime == "docker":
        provider: RuntimeProvider = DockerProvider(work_root, harness_url=UNUSED_HARNESS_URL, start_limit=1)
        spec = rollout_pb2.RuntimeSpec(kind="docker", image=BASE_IMAGE)
    else:
        isolation = resolve_isolation("network", UNUSED_HARNESS_URL, work_root)
        provider = LocalProvider(work_root, isolation=isolation)
        spec = rollout_pb2.RuntimeSpec(kind="local")

    async def sample(index: int) -> tuple[float, float, float]:
        started = time.perf_counter()
        made = await provider.create(spec, name=f"cost-{index}")
        created = time.perf_counter()
        try:
            result = await made.run(["true"], env=made.command_env({}), timeout_s=60)
            if result.exit_code != 0:
                raise RuntimeError(f"`true` in a {runtime} runtime exited {result.exit_code}: {result.output[-300:]}")
            ran = time.perf_counter()
        finally:
            await made.close()
        removed = time.perf_counter()
        return created - started, ran - created, removed - ran

    async def all_samples() -> list[tuple[float, float, float]]:
        return [await sample(index) for index in range(samples)]

    measured = asyncio.run(all_samples())
    create, first, removal = ([1000 * s[i] for s in measured] for i in range(3))
    return RuntimeCost(
        runtime=runtime,
        samples=samples,
        create_p50_ms=statistics.median(create),
        create_max_ms=max(create),
        first_command_p50_ms=statistics.median(first),
        removal_p50_ms=statistics.median(removal),
        removal_max_ms=max(removal),
    )


def _print_costs(costs: Sequence[RuntimeCost]) -> None:
    print("\nA runtime's own cost, one at a time (an empty workspace, no prepare step): median (max)")
    header = ("runtime", "samples", "create", "first command", "removal", "create+command+removal")
    rows = [
        (
            cost.runtime,
            str(cost.samples),
            f"{cost.create_p50_ms:.0f}ms ({cost.create_max_ms:.0f})",
            f"{cost.first_command_p50_ms:.0f}ms",
            f"{cost.removal_p50_ms:.0f}ms ({cost.removal_max_ms:.0f})",
            f"{cost.create_p50_ms + cost.first_command_p50_ms + cost.removal_p50_ms:.0f}ms",
        )
        for cost in costs
    ]
    benchmark_common.print_table(header, rows)


def _comparison(points: Sequence[Point]) -> list[dict]:
    """Per (sessions, prewarm): the medians over the rounds without and with credentials, and their ratio."""
    rows = []
    figures = ("sessions_per_s", "added_seconds", "node_cpu_ms_per_session", "rollout_cpu_ms_per_session")
    for sessions, prewarm in dict.fromkeys((p.sessions, p.prewarm) for p in points):
        row: dict = {"sessions": sessions, "prewarm": prewarm}
        for checked, side in ((False, "open"), (True, "checked")):
            mine = [p for p in points if (p.sessions, p.prewarm, p.credentials) == (sessions, prewarm, checked)]
            row[side] = {figure: statistics.median(getattr(p, figure) for p in mine) for figure in figures}
            row[side]["sessions_per_s_rounds"] = [p.sessions_per_s for p in mine]
        open_, checked = row["open"], row["checked"]
        row["throughput_ratio"] = checked["sessions_per_s"] / open_["sessions_per_s"]
        row["node_cpu_cost_pct"] = 100 * (checked["node_cpu_ms_per_session"] / open_["node_cpu_ms_per_session"] - 1)
        row["rollout_cpu_cost_pct"] = 100 * (
            checked["rollout_cpu_ms_per_session"] / open_["rollout_cpu_ms_per_session"] - 1
        )
        rows.append(row)
    return rows


def _print_comparison(rows: Sequence[dict], rounds: int) -> None:
    print(
        f"\ncredential check cost: median of {rounds} alternating rounds (budget: a ratio of at least "
        f"{1 - CREDENTIAL_BUDGET_PCT / 100:.2f})"
    )
    header = (
        "sessions",
        "prewarm",
        "sess/s open",
        "checked",
        "ratio",
        "node CPU ms/sess open",
        "checked",
        "change",
        "rollout CPU open",
        "checked",
        "change",
    )
    table = []
    for row in rows:
        open_, checked = row["open"], row["checked"]
        table.append(
            (
                str(row["sessions"]),
                "yes" if row["prewarm"] else "no",
                f"{open_['sessions_per_s']:.1f}",
                f"{checked['sessions_per_s']:.1f}",
                f"{row['throughput_ratio']:.3f}",
                f"{open_['node_cpu_ms_per_session']:.1f}",
                f"{checked['node_cpu_ms_per_session']:.1f}",
                f"{row['node_cpu_cost_pct']:+.1f}%",
                f"{open_['rollout_cpu_ms_per_session']:.1f}",
                f"{checked['rollout_cpu_ms_per_session']:.1f}",
                f"{row['rollout_cpu_cost_pct']:+.1f}%",
            )
        )
    benchmark_common.print_table(header, table, left=0, indent="  ")


@contextlib.contextmanager
def _shared_services(
    scratch: Path, most_sessions: int, issued: creds.Credentials | None
) -> Iterator[tuple[str, str, socket.socket]]:
    """The inference server and Envoy, shared by every point of one setup (with `issued` credentials
    or open); yields (Envoy's inference listener, Envoy's harness base URL, the listening socket of the
    gateway HTTP port Envoy forwards to)."""
    script = scratch / "script.json"
    script.write_text(json.dumps({"name": "polar-scripted", "outputs": [{"text": "Done."}], "cycle": True}))
    inference_config = InferenceConfig(engine="scripted", port=0, script=str(script), max_batch_size=most_sessions * 2)
    with contextlib.ExitStack() as stack:
        with creds.handed_to_children(issued):
            spec = inference_spec(inference_config)
            inference = stack.enter_context(running(spec, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S))
        gateway_http = stack.enter_context(listening_socket(HOST))
        gateway_port = gateway_http.getsockname()[1]
        envoy_config = EnvoyConfig(harness_port=0, inference_port=0, admin_port=0, access_log="/dev/null")
        text = render_config(envoy_config, [inference.dial_address], join_host_port(HOST, gateway_port))
        envoy = stack.enter_context(running_envoy(text, workers=envoy_config.workers))
        yield (
            join_host_port(HOST, envoy.inference_port),
            "http://" + join_host_port(HOST, envoy.harness_port),
            gateway_http,
        )


def _measure(
    scratch: Path,
    sessions: int,
    prewarm: bool,
    hold: float,
    template: Path,
    inference_address: str,
    base_url: str,
    gateway_http: socket.socket,
    issued: creds.Credentials | None,
    round_name: str,
    *,
    runtime: str,
    isolation: str,
    runs_log: Path | None,
) -> Point:
    """One point: a fresh rollout server and node (with `issued` credentials, or open) under C sessions
    in `runtime`; `runs_log`: the folder of the logging docker client (docker only)."""
    mode = f"{'prewarm' if prewarm else 'cold'}-{'checked' if issued else 'open'}"
    name = f"{sessions}-{runtime}-{mode}-{round_name}"
    log = scratch / f"docker-runs-{name}.log"
    client = {"PATH": f"{runs_log}{os.pathsep}{os.environ['PATH']}", "BENCH_DOCKER_LOG": str(log)} if runs_log else {}
    rollout_config = RolloutConfig(
        port=0, store=str(scratch / f"rollout-{name}.db"), heartbeat_interval_s=HEARTBEAT_INTERVAL_S
    )
    # The rollout server and the node start with the credentials (or without); the harnesses never see them.
    rollout_service = running(rollout_spec(rollout_config), STARTUP_TIMEOUT_S, STOP_TIMEOUT_S)
    with creds.handed_to_children(issued), rollout_service as rollout, _environment(**client):
        node_config = NodeConfig(
            rollout_address=rollout.dial_address,
            init_workers=16,
            ready_slots=sessions,
            running_slots=sessions,
            postrun_workers=8,
            prewarm=prewarm,
            harness_isolation=isolation,
            docker_start_limit=DOCKER_START_LIMIT,
            work_root=str(_fresh(scratch / f"work-{name}")),
            template_roots=str(template.parent),  # the node copies workspaces only from its template roots
        )
        gateway = GatewayConfig(port=gateway_http.getsockname()[1], grpc_port=0, inference_address=inference_address)
        spec = node_spec(node_config, gateway, InferenceConfig(), base_url=base_url)
        with running(spec, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, http_socket=gateway_http) as node:
            options = [("grpc.max_receive_message_length", MAX_ROLLOUT_MESSAGE_BYTES)]
            with creds.channel(rollout.dial_address, creds.OPERATOR, issued, options) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                # The node prewarms the default (empty) workspace until it sees a task's spec; both
                # modes run the warm-up session, so the node is equally warm otherwise.
                cursor = _warm_up(stub, template, runtime)
                _wait_for_node(stub, ready=sessions if prewarm else 0)
                cpu_before = _stack_cpu_seconds(node.process.pid, rollout.process.pid)
                log.unlink(missing_ok=True)  # the point's own starts, not the warm-up's or the prewarming's
                tasks = [_task(hold, template, index, runtime) for index in range(sessions // GROUP_SIZE)]
                submitted = time.monotonic()
                stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=tasks), timeout=60)
                trajectories, _ = _collect(stub, len(tasks), timeout_s=120 + 4 * hold, cursor=cursor)
                seconds = time.monotonic() - submitted
                cpu_after = _stack_cpu_seconds(node.process.pid, rollout.process.pid)
    cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1], cpu_after[2] - cpu_before[2])
    setup = (runtime, isolation, issued is not None)
    return _point(sessions, prewarm, setup, seconds, hold, trajectories, cpu, _starts(log))


def _template(folder: Path) -> Path:
    """A small source tree, the workspace every session starts from."""
    (folder / "src").mkdir(parents=True)
    (folder / "README.md").write_text("# calculator\n")
    (folder / "src" / "calculator.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "tests").mkdir()
    (folder / "tests" / "test_calculator.py").write_text(
        "from src.calculator import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    return folder


def _python(runtime: str) -> str:
    """The Python that commands run: the image's in a container, this one on the node."""
    return "python3" if runtime == "docker" else sys.executable


def _runtime(template: Path, runtime: str) -> rollout_pb2.RuntimeSpec:
    commit = "git init -q . && git add -A && git -c user.name=bench -c user.email=bench@localhost commit -qm template"
    return rollout_pb2.RuntimeSpec(
        kind="docker" if runtime == "docker" else "local",
        image=BASE_IMAGE if runtime == "docker" else "",
        template=str(template),
        prepare=[commit, f"{_python(runtime)} -m venv --without-pip .venv"],
    )


def _warm_up(stub: rollout_pb2_grpc.RolloutServiceStub, template: Path, runtime: str) -> str:
    """One session of the bench's runtime spec, so the node keeps that spec warm; waits for it and
    returns the results cursor after it."""
    task = _task(0.0, template, 0, runtime, group_size=1, task_id="warm-up")
    stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task]), timeout=60)
    return _collect(stub, 1, timeout_s=120)[1]


def _task(
    hold: float, template: Path, index: int, runtime: str, *, group_size: int = GROUP_SIZE, task_id: str = ""
) -> rollout_pb2.Task:
    return rollout_pb2.Task(
        task_id=task_id or f"bench-{index:04d}",
        instruction="Say done.",
        group_size=group_size,
        runtime=_runtime(template, runtime),
        harness=rollout_pb2.HarnessSpec(
            # Inline: a harness sandboxed by the node's harness_isolation sees no file of the bench's
            # scratch folder (a temporary folder, hidden with the others).
            preset="command",
            command=[_python(runtime), "-S", "-c", HARNESS],
            env={"BENCH_HOLD_SECONDS": str(hold)},
        ),
        timeout_seconds=60 + 4 * hold,
    )


def _wait_for_node(stub: rollout_pb2_grpc.RolloutServiceStub, ready: int, timeout_s: float = 120.0) -> None:
    """Until one node is registered and (with prewarming) reports `ready` prewarmed runtimes.

    Pools are as of the node's latest heartbeat, which may predate the warm-up's end (when the
    default workspace's prewarmed runtimes gave way to the bench's spec): a few intervals pass first."""
    time.sleep(3 * HEARTBEAT_INTERVAL_S)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = stub.ListNodes(rollout_pb2.ListNodesRequest(), timeout=10).nodes
        if nodes and all(pool.depth >= ready for pool in nodes[0].pools if pool.name == "ready"):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the node did not report {ready} prewarmed runtimes within {timeout_s:g} s")


def _collect(
    stub: rollout_pb2_grpc.RolloutServiceStub, groups: int, timeout_s: float, cursor: str = ""
) -> tuple[list[common_pb2.Trajectory], str]:
    """The next `groups` released groups after `cursor`, and the cursor after them."""
    trajectories: list[common_pb2.Trajectory] = []
    released = 0
    for batch in stub.WatchResults(rollout_pb2.WatchResultsRequest(cursor=cursor), timeout=timeout_s):
        trajectories += read_trajectory_batch(batch.zstd_trajectories)
        released += batch.group_count
        cursor = batch.cursor
        if released >= groups:
            break
    return trajectories, cursor


def _point(
    sessions: int,
    prewarm: bool,
    setup: tuple[str, str, bool],  # runtime, the node's harness_isolation, credentials checked
    seconds: float,
    hold: float,
    trajectories: Sequence[common_pb2.Trajectory],
    cpu: tuple[float, float, float],  # node, its children, rollout server: seconds
    starts: tuple[int, int],  # `docker run`s, the most at once
) -> Point:
    timings = [t.stage_timings for t in trajectories]
    to_running = [1000 * (s.queued_seconds + s.init_seconds + s.ready_seconds) for s in timings]
    spans = [
        (
            s.queued_seconds + s.init_seconds + s.ready_seconds,
            s.queued_seconds + s.init_seconds + s.ready_seconds + s.running_seconds,
        )
        for s in timings
    ]
    completed = sum(t.outcome == common_pb2.SESSION_OUTCOME_COMPLETED for t in trajectories)
    errors = sorted({t.error for t in trajectories if t.error})
    return Point(
        sessions=sessions,
        prewarm=prewarm,
        runtime=setup[0],
        isolation=setup[1],
        credentials=setup[2],
        seconds=seconds,
        added_seconds=seconds - hold,
        sessions_per_s=sessions / seconds,
        submit_to_running_p50_ms=_quantile(to_running, 0.5),
        submit_to_running_p90_ms=_quantile(to_running, 0.9),
        submit_to_running_max_ms=max(to_running, default=0.0),
        queued_p50_ms=_quantile([1000 * s.queued_seconds for s in timings], 0.5),
        init_p50_ms=_quantile([1000 * s.init_seconds for s in timings], 0.5),
        ready_p50_ms=_quantile([1000 * s.ready_seconds for s in timings], 0.5),
        peak_running=_peak_overlap(spans),
        completed=completed,
        node_cpu_ms_per_session=1000 * cpu[0] / sessions,
        children_cpu_ms_per_session=1000 * cpu[1] / sessions,
        rollout_cpu_ms_per_session=1000 * cpu[2] / sessions,
        docker_runs=starts[0],
        most_starts_at_once=starts[1],
        errors=errors[:5],
    )


def _peak_overlap(spans: Sequence[tuple[float, float]]) -> int:
    """The most intervals [start, end) that contain one instant."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = current = 0
    for _, change in events:
        current += change
        peak = max(peak, current)
    return peak


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _stack_cpu_seconds(node: int, rollout: int) -> tuple[float, float, float]:
    """CPU seconds so far of the node process, of its children it waited for (harnesses, prepare
    steps), and of the rollout server (its children's included)."""
    rollout_seconds = benchmark_common.cpu_seconds(rollout) + benchmark_common.cpu_seconds(rollout, children=True)
    return benchmark_common.cpu_seconds(node), benchmark_common.cpu_seconds(node, children=True), rollout_seconds


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _print_point(point: Point) -> None:
    mode = f"{point.runtime}, " + ("prewarmed" if point.prewarm else "cold")
    mode += ", credentials" if point.credentials else ", open"
    print(
        f"  {point.sessions} sessions, {mode}: {point.completed}/{point.sessions} completed in {point.seconds:.2f} s",
        flush=True,
    )


def _print_table(points: Sequence[Point], hold: float, load_before: float) -> None:
    print(
        f"\nRollout: one node, scripted engine, a harness that makes one call and holds {hold:g} s "
        f"({os.cpu_count()} CPUs, load {load_before:.2f} before)"
    )
    header = (
        "sessions",
        "runtime",
        "prewarm",
        "creds",
        "sess/s",
        "added",
        "→RUN p50",
        "p90",
        "max",
        "queued",
        "init",
        "ready",
        "peak RUN",
        "done",
        "node cpu",
        "children",
        "rollout",
        "starts",
    )
    rows = [
        (
            str(p.sessions),
            p.runtime,
            "yes" if p.prewarm else "no",
            "on" if p.credentials else "off",
            f"{p.sessions_per_s:.1f}",
            f"{p.added_seconds:.2f}s",
            f"{p.submit_to_running_p50_ms:.1f}ms",
            f"{p.submit_to_running_p90_ms:.0f}ms",
            f"{p.submit_to_running_max_ms:.0f}ms",
            f"{p.queued_p50_ms:.1f}ms",
            f"{p.init_p50_ms:.1f}ms",
            f"{p.ready_p50_ms:.1f}ms",
            str(p.peak_running),
            str(p.completed),
            f"{p.node_cpu_ms_per_session:.1f}ms",
            f"{p.children_cpu_ms_per_session:.1f}ms",
            f"{p.rollout_cpu_ms_per_session:.1f}ms",
            f"{p.docker_runs} ({p.most_starts_at_once} at once)" if p.runtime == "docker" else "-",
        )
        for p in points
    ]
    benchmark_common.print_table(header, rows, left=0)
    for p in points:
        for error in p.errors:
            print(f"{p.sessions} sessions, {p.runtime}, prewarm {'on' if p.prewarm else 'off'}: error: {error}")
    print(
        "\nadded: submit → last release, minus the hold. →RUN: submit → the node starts the harness's stage\n"
        "(queued + init + ready). CPU per session: the node process, its children (harnesses, prepare steps),\n"
        "the rollout server. starts: `docker run`s the node made in the point (the most in flight at once;\n"
        f"its docker_start_limit is {DOCKER_START_LIMIT})."
    )


def _parse_args() -> argparse.Namespace:
    outs = "rollout.json; rollout-credentials.json with --credentials compare"
    parser = benchmark_common.parser(__doc__, "64 sessions only, a short hold (under a minute)", outs)
    parser.add_argument(
        "--sessions",
        type=int,
        nargs="+",
        help="concurrent sessions per point (default 64 and 256, --quick 64; with --runtime docker 32, --quick 8)",
    )
    parser.add_argument("--hold", type=float, help="seconds each harness holds its session (default 2 quick, 4 full)")
    parser.add_argument(
        "--credentials",
        choices=("on", "off", "compare"),
        default="on",
        help="run the services with the stack's credentials (on, as `polar up`), without them (off), or measure "
        "what the check costs: each point with and without, in alternating rounds (compare)",
    )
    parser.add_argument(
        "--runtime",
        choices=("namespace", "docker"),
        default="namespace",
        help="namespace: the local runtime in the node's sandbox; docker: containers of the base image side by "
        "side with the namespace runtime, and each one's start and removal cost",
    )
    args = parser.parse_args()
    if args.runtime == "docker" and args.credentials == "compare":
        parser.error("--credentials compare measures the namespace runtime only: leave out --runtime docker")
    if any(size % GROUP_SIZE or size <= 0 for size in args.sessions or ()):
        parser.error(f"--sessions must be positive multiples of {GROUP_SIZE}")
    return args


if __name__ == "__main__":
    sys.exit(main())
