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

Prints a table and writes JSON (default bench-results/rollout.json; rollout-credentials.json when comparing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from polar import credentials as creds
from polar.codec import read_trajectory_batch
from polar.config import EnvoyConfig, GatewayConfig, InferenceConfig, NodeConfig, RolloutConfig
from polar.envoy import render_config
from polar.envoy import running as running_envoy
from polar.rollout.server import MAX_MESSAGE_BYTES
from polar.service import join_host_port, listening_socket
from polar.stack import inference_spec, node_spec, rollout_spec, running
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
GROUP_SIZE = 8
HOST = "127.0.0.1"
# Short, so the node's pools as the server last heard them (ListNodes) are never stale for long.
HEARTBEAT_INTERVAL_S = 0.2
CREDENTIAL_BUDGET_PCT = 2.0  # what the credential check may cost in sessions/s

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
    errors: list[str]


def main() -> int:
    args = _parse_args()
    sizes = (64,) if args.quick else tuple(args.sessions)
    hold = args.hold if args.hold is not None else (2.0 if args.quick else 4.0)
    compare = args.credentials == "compare"
    # Compared: every point on both setups, in rounds that alternate which goes first.
    setups = (False, True) if compare else (args.credentials == "on",)
    rounds = 3 if compare else 1
    prewarm_modes = (True,) if compare and args.quick else (False, True)
    load_before = os.getloadavg()[0]
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-rollout-") as scratch_name, contextlib.ExitStack() as stack:
        scratch = Path(scratch_name)
        template = _template(scratch / "template")
        issued = creds.ensure(scratch / "credentials")
        shared = {
            checked: stack.enter_context(_shared_services(scratch, max(sizes), issued if checked else None))
            for checked in setups
        }
        for size in sizes:
            for prewarm in prewarm_modes:
                for round_index in range(rounds):
                    for checked in setups if round_index % 2 == 0 else setups[::-1]:
                        point = _measure(
                            scratch, size, prewarm, hold, template, *shared[checked],
                            issued if checked else None, f"{round_index}",
                        )  # fmt: skip
                        points.append(point)
                        _print_point(point)
    report = {
        "benchmark": "rollout",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_1min_before": load_before},
        "hold_seconds": hold,
        "group_size": GROUP_SIZE,
        "credentials": args.credentials,
        "points": [asdict(point) for point in points],
    }
    _print_table(points, hold, load_before)
    if compare:
        report["comparison"] = _comparison(points)
        _print_comparison(report["comparison"], rounds)
    out = args.out or ROOT / "bench-results" / ("rollout-credentials.json" if compare else "rollout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0 if all(point.completed == point.sessions for point in points) else 1


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
    print(f"\ncredential check cost: median of {rounds} alternating rounds (budget: a ratio of at least "
          f"{1 - CREDENTIAL_BUDGET_PCT / 100:.2f})")  # fmt: skip
    print(
        f"  {'sessions':>8} {'prewarm':>8} {'sess/s open':>11} {'checked':>8} {'ratio':>6}   "
        f"{'node CPU ms/sess open':>21} {'checked':>8} {'change':>7}   "
        f"{'rollout CPU open':>16} {'checked':>8} {'change':>7}"
    )
    for row in rows:
        open_, checked = row["open"], row["checked"]
        print(
            f"  {row['sessions']:>8} {'yes' if row['prewarm'] else 'no':>8} {open_['sessions_per_s']:>11.1f} "
            f"{checked['sessions_per_s']:>8.1f} {row['throughput_ratio']:>6.3f}   "
            f"{open_['node_cpu_ms_per_session']:>21.1f} {checked['node_cpu_ms_per_session']:>8.1f} "
            f"{row['node_cpu_cost_pct']:>+6.1f}%   {open_['rollout_cpu_ms_per_session']:>16.1f} "
            f"{checked['rollout_cpu_ms_per_session']:>8.1f} {row['rollout_cpu_cost_pct']:>+6.1f}%"
        )



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
) -> Point:
    """One point: a fresh rollout server and node (with `issued` credentials, or open) under C sessions."""
    name = f"{sessions}-{'prewarm' if prewarm else 'cold'}-{'checked' if issued else 'open'}-{round_name}"
    rollout_config = RolloutConfig(
        port=0, store=str(scratch / f"rollout-{name}.db"), heartbeat_interval_s=HEARTBEAT_INTERVAL_S
    )
    # The rollout server and the node start with the credentials (or without); the harnesses never see them.
    rollout_service = running(rollout_spec(rollout_config), STARTUP_TIMEOUT_S, STOP_TIMEOUT_S)
    with creds.handed_to_children(issued), rollout_service as rollout:
        node_config = NodeConfig(
            rollout_address=rollout.dial_address,
            init_workers=16,
            ready_slots=sessions,
            running_slots=sessions,
            postrun_workers=8,
            prewarm=prewarm,
            work_root=str(_fresh(scratch / f"work-{name}")),
            template_roots=str(template.parent),  # the node copies workspaces only from its template roots
        )
        gateway = GatewayConfig(port=gateway_http.getsockname()[1], grpc_port=0, inference_address=inference_address)
        spec = node_spec(node_config, gateway, InferenceConfig(), base_url=base_url)
        with running(spec, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, http_socket=gateway_http) as node:
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            with creds.channel(rollout.dial_address, creds.OPERATOR, issued, options) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                # The node prewarms the default (empty) workspace until it sees a task's spec; both
                # modes run the warm-up session, so the node is equally warm otherwise.
                cursor = _warm_up(stub, template)
                _wait_for_node(stub, ready=sessions if prewarm else 0)
                node_before, children_before = _cpu_seconds(node.process.pid)
                rollout_before = sum(_cpu_seconds(rollout.process.pid))
                tasks = [_task(hold, template, index) for index in range(sessions // GROUP_SIZE)]
                submitted = time.monotonic()
                stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=tasks), timeout=60)
                trajectories, _ = _collect(stub, len(tasks), timeout_s=120 + 4 * hold, cursor=cursor)
                seconds = time.monotonic() - submitted
                node_after, children_after = _cpu_seconds(node.process.pid)
                cpu = (
                    node_after - node_before,
                    children_after - children_before,
                    sum(_cpu_seconds(rollout.process.pid)) - rollout_before,
                )
    return _point(sessions, prewarm, issued is not None, seconds, hold, trajectories, cpu)


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


def _runtime(template: Path) -> rollout_pb2.RuntimeSpec:
    return rollout_pb2.RuntimeSpec(
        kind="local",
        template=str(template),
        prepare=[
            "git init -q . && git add -A && git -c user.name=bench -c user.email=bench@localhost commit -qm template",
            f"{sys.executable} -m venv --without-pip .venv",
        ],
    )


def _warm_up(stub: rollout_pb2_grpc.RolloutServiceStub, template: Path) -> str:
    """One session of the bench's runtime spec, so the node keeps that spec warm; waits for it and
    returns the results cursor after it."""
    task = _task(0.0, template, 0, group_size=1, task_id="warm-up")
    stub.SubmitTasks(rollout_pb2.SubmitTasksRequest(tasks=[task]), timeout=60)
    return _collect(stub, 1, timeout_s=120)[1]


def _task(
    hold: float, template: Path, index: int, *, group_size: int = GROUP_SIZE, task_id: str = ""
) -> rollout_pb2.Task:
    return rollout_pb2.Task(
        task_id=task_id or f"bench-{index:04d}",
        instruction="Say done.",
        group_size=group_size,
        runtime=_runtime(template),
        harness=rollout_pb2.HarnessSpec(
            # Inline: a harness sandboxed by the node's harness_isolation sees no file of the bench's
            # scratch folder (a temporary folder, hidden with the others).
            preset="command", command=[sys.executable, "-S", "-c", HARNESS], env={"BENCH_HOLD_SECONDS": str(hold)}
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
    credentials: bool,
    seconds: float,
    hold: float,
    trajectories: Sequence[common_pb2.Trajectory],
    cpu: tuple[float, float, float],  # node, its children, rollout server: seconds
) -> Point:
    timings = [t.stage_timings for t in trajectories]
    to_running = [1000 * (s.queued_seconds + s.init_seconds + s.ready_seconds) for s in timings]
    spans = [
        (s.queued_seconds + s.init_seconds + s.ready_seconds, s.queued_seconds + s.init_seconds + s.ready_seconds + s.running_seconds)
        for s in timings
    ]
    completed = sum(t.outcome == common_pb2.SESSION_OUTCOME_COMPLETED for t in trajectories)
    errors = sorted({t.error for t in trajectories if t.error})
    return Point(
        sessions=sessions,
        prewarm=prewarm,
        credentials=credentials,
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


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a process, and of its children it waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    tick = os.sysconf("SC_CLK_TCK")
    return (utime + stime) / tick, (cutime + cstime) / tick


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _print_point(point: Point) -> None:
    mode = ("prewarmed" if point.prewarm else "cold") + (", credentials" if point.credentials else ", open")
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
        f"{'sessions':>8} {'prewarm':>8} {'creds':>5} {'sess/s':>7} {'added':>6} "
        f"{'→RUN p50':>9} {'p90':>7} {'max':>7} "
        f"{'queued':>7} {'init':>6} {'ready':>6} {'peak RUN':>8} {'done':>5} {'node cpu':>9} {'children':>9} {'rollout':>8}"
    )
    print(header)
    print("-" * len(header))
    for p in points:
        print(
            f"{p.sessions:>8} {'yes' if p.prewarm else 'no':>8} {'on' if p.credentials else 'off':>5} "
            f"{p.sessions_per_s:>7.1f} {p.added_seconds:>5.2f}s "
            f"{p.submit_to_running_p50_ms:>7.1f}ms {p.submit_to_running_p90_ms:>5.0f}ms {p.submit_to_running_max_ms:>5.0f}ms "
            f"{p.queued_p50_ms:>5.1f}ms {p.init_p50_ms:>4.1f}ms {p.ready_p50_ms:>4.1f}ms {p.peak_running:>8} "
            f"{p.completed:>5} {p.node_cpu_ms_per_session:>7.1f}ms {p.children_cpu_ms_per_session:>7.1f}ms "
            f"{p.rollout_cpu_ms_per_session:>6.1f}ms"
        )
        for error in p.errors:
            print(f"{'':>8} error: {error}")
    print(
        "\nadded: submit → last release, minus the hold. →RUN: submit → the node starts the harness's stage\n"
        "(queued + init + ready). CPU per session: the node process, its children (harnesses, prepare steps),\n"
        "the rollout server."
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 sessions only, a short hold (under a minute)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[64, 256], help="concurrent sessions per point")
    parser.add_argument("--hold", type=float, help="seconds each harness holds its session (default 2 quick, 4 full)")
    parser.add_argument(
        "--credentials", choices=("on", "off", "compare"), default="on",
        help="run the services with the stack's credentials (on, as `polar up`), without them (off), or measure "
        "what the check costs: each point with and without, in alternating rounds (compare)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path,
        help="JSON output file (default: bench-results/rollout.json; rollout-credentials.json when comparing)",
    )  # fmt: skip
    args = parser.parse_args()
    if any(size % GROUP_SIZE or size <= 0 for size in args.sessions):
        parser.error(f"--sessions must be positive multiples of {GROUP_SIZE}")
    return args


if __name__ == "__main__":
    sys.exit(main())
