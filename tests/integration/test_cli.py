"""The `polar` command line as a user runs it: real subprocesses, real gRPC, real signals.

The scripted engine keeps every server here free of model loading. `polar up` runs the whole stack
(rollout server, inference, Envoy, a node) and a task submitted to it runs end to end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import polar
from polar import credentials
from polar.service_base import listening_socket
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.helpers.harness_programs import harness_command
from tests.helpers.polar_command import STARTUP_SECONDS, alive, assert_one_line_error, run, wait_dead
from tests.helpers.stack_config import write_stack_config

pytestmark = pytest.mark.slow

SCRIPT = {
    "tokenizer": None,
    "vocab_size": 100,
    "cycle": True,
    "outputs": [{"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -1.5]}],
}
# The stack's model: "Done." and <|im_end|> in the tiny model's tokenizer, which the gateway renders with.
DONE_IDS = [41462, 30, 2]
STACK_SCRIPT = {"cycle": True, "outputs": [{"token_ids": DONE_IDS, "logprobs": [-0.5, -1.0, -1.5]}]}
HARNESS = harness_command("faulty_harness")


@pytest.fixture
def script_file(tmp_path: Path) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return path


@pytest.fixture
def stack_config(tmp_path: Path) -> Path:
    script = tmp_path / "stack-script.json"
    script.write_text(json.dumps(STACK_SCRIPT))
    return write_stack_config(
        tmp_path / "stack.toml",
        rollout={"store": tmp_path / "rollout.db", "heartbeat_interval_s": 0.2},
        inference={"engine": "scripted", "script": script},
        envoy={"workers": 1},
        node={"init_workers": 1, "ready_slots": 1, "running_slots": 2, "postrun_workers": 1},
    )


def _generate(endpoint: str) -> list[inference_pb2.GenerateResponse]:
    # As the operator: a stack's inference server serves only its credentials (polar.credentials).
    with credentials.channel(endpoint, credentials.OPERATOR, credentials.for_commands()) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=10, temperature=0)
        )
        return list(stub.Generate(request, timeout=30))


def _health(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        request = health_pb2.HealthCheckRequest(service="polar.v1.InferenceService")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def _start_stack(spawn, config: Path) -> tuple[subprocess.Popen, dict[str, tuple[str, int]]]:
    """`polar up` on config; return it and each service's endpoint and pid from its table."""
    up, lines = spawn("up", "--config", str(config))
    lines.wait_for(r"^polar up: 4 services running")
    lines.wait_for(r"^\s+service\s+endpoint\s+pid")
    rows = {}
    for name in ("rollout", "inference", "envoy", "node"):
        row = lines.wait_for(rf"^\s+{name}\s+(\S+)\s+(\d+)\s")
        rows[name] = (row.group(1), int(row.group(2)))
    return up, rows


# ---------------------------------------------------------------------------------- serve inference


def test_serve_inference_scripted_answers_generate(spawn, script_file):
    server, lines = spawn("serve", "inference", "--engine", "scripted", "--script", str(script_file), "--port", "0")
    endpoint = lines.wait_for(r"inference: serving .* on (127\.0\.0\.1:\d+)$").group(1)

    responses = _generate(endpoint)

    tokens = [t for r in responses for t in r.token_ids]
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert tokens == [5, 6, 7]
    assert logprobs == [-0.5, -1.0, -1.5]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0
    assert "Traceback" not in server.stderr.read()


def test_unknown_model_is_a_one_line_error():
    assert_one_line_error(run("serve", "inference", "--model", "no-such-model"), "no-such-model")


def test_unreadable_script_is_a_one_line_error(tmp_path):
    script = tmp_path / "broken.json"
    script.write_text('{"outputs": [')
    assert_one_line_error(run("serve", "inference", "--engine", "scripted", "--script", str(script)), "broken.json")


def test_malformed_script_entry_is_a_one_line_error(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"tokenizer": None, "vocab_size": 10, "outputs": [{"token_ids": [99]}]}))
    assert_one_line_error(run("serve", "inference", "--engine", "scripted", "--script", str(script)), "outputs[0]")


def test_an_engine_whose_package_is_missing_is_a_one_line_error():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert_one_line_error(run("serve", "inference", "--engine", "vllm", "--port", "0"), "'vllm'", "setup_vllm.sh")


def test_usage_mistake_is_a_one_line_error():
    result = run("serve", "inference", "--port", "70000")
    assert_one_line_error(result, "--port")
    assert result.returncode == 2


def test_a_gateway_handed_a_closed_socket_is_a_one_line_error():
    result = run("serve", "gateway", "--inference", "127.0.0.1:1", "--http-fd", "987")
    assert_one_line_error(result, "--http-fd 987 is not an open socket")


def test_console_script_prints_the_version():
    polar_script = Path(sys.executable).parent / "polar"
    result = subprocess.run([str(polar_script), "version"], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout == f"polar {polar.__version__}\n"


# --------------------------------------------------------------------------------------------- up


def test_up_runs_a_submitted_task_and_stops_on_sigint_leaving_no_child(spawn, stack_config, tmp_path):
    up, rows = _start_stack(spawn, stack_config)
    inference, _ = rows["inference"]
    rollout, _ = rows["rollout"]

    assert _health(inference) == health_pb2.HealthCheckResponse.SERVING
    assert [t for r in _generate(inference) for t in r.token_ids] == DONE_IDS
    # A task through the whole stack: the node runs the harness, whose calls reach the model via Envoy.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"instruction": "Say done.", "groupSize": 2, "harness": {"preset": "command", "command": HARNESS}})
        + "\n"
    )
    submitted = run("submit", str(tasks), "--rollout", rollout)
    assert submitted.returncode == 0, submitted.stderr
    [task_id] = submitted.stdout.split()
    watched = run("status", "--watch", "--interval", "0.2", "--rollout", rollout, timeout=STARTUP_SECONDS)
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.splitlines()[-1].startswith("total: 1 task, 1 released; 2 sessions: 2 done")
    nodes = run("status", "--rollout", rollout).stdout.split("\n\n")[0].splitlines()
    assert nodes[0].split() == ["node", "sessions", "init", "ready", "running", "postrun", "heartbeat", "credential"]
    [node] = nodes[1:]
    assert node.split()[4] == "0/2"  # the running pool: no harness now, [node] running_slots = 2
    assert node.endswith("stack's own (node)")  # `polar up`'s node registers with the stack's own token
    exported = run("results", "--export", str(tmp_path / "out.jsonl"), "--rollout", rollout)
    assert exported.returncode == 0, exported.stderr
    trajectories = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [t["sessionId"] for t in trajectories] == [f"{task_id}.0", f"{task_id}.1"]
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", trajectory.get("error")
        assert len(trajectory["calls"]) == 1
        assert "Done." in trajectory["harnessOutput"]

    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=30) == 0
    # polar up reaps its children before it exits: every pid must already be gone, not just dying.
    assert [name for name, (_, pid) in rows.items() if alive(pid)] == []
    assert "Traceback" not in up.stderr.read()


def test_up_submit_runs_the_tasks_and_shows_their_progress(spawn, stack_config, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"instruction": "Say done.", "groupSize": 2, "harness": {"preset": "command", "command": HARNESS}})
        + "\n"
    )
    up, lines = spawn("up", "--config", str(stack_config), "--submit", str(tasks))
    lines.wait_for(r"^polar up: 4 services running")
    lines.wait_for(r"^polar up: submitted 1 task$")
    lines.wait_for(r"^total: 1 task, 1 released; 2 sessions: 2 done")
    rollout = lines.wait_for(r"^polar up: every group released; export them with .* --rollout (\S+)`").group(1)
    assert [line for line in lines.seen if line.startswith("polar up: 1 task, 0 released")]  # progress was shown
    exported = run("results", "--export", "-", "--rollout", rollout)
    assert [json.loads(line)["outcome"] for line in exported.stdout.splitlines() if line.startswith("{")] == [
        "SESSION_OUTCOME_COMPLETED",
        "SESSION_OUTCOME_COMPLETED",
    ]
    up.send_signal(signal.SIGINT)  # the stack served on after the tasks, until stopped
    assert up.wait(timeout=30) == 0
    # The node started each harness and evaluator without a fork() that runs gRPC's fork handlers
    # (they log "skipping fork() handlers" when they cannot run).
    assert "fork() handlers" not in up.stderr.read()


def test_up_submit_with_a_bad_task_file_starts_nothing(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"instruction": "x", "groupSize": 0, "harness": {"preset": "pi"}}\n')
    started = time.monotonic()
    assert_one_line_error(run("up", "--submit", str(tasks)), "nothing submitted", "tasks.jsonl:1")
    assert time.monotonic() - started < 30  # refused before any service started


def test_up_killed_with_sigkill_still_takes_its_children_down(spawn, stack_config):
    up, rows = _start_stack(spawn, stack_config)

    up.kill()
    up.wait(timeout=10)

    for name, (_, pid) in rows.items():
        assert wait_dead(pid), f"{name} (pid {pid}) outlived its SIGKILLed supervisor"


def test_up_fails_when_a_child_dies(spawn, stack_config):
    up, rows = _start_stack(spawn, stack_config)
    _, pid = rows["inference"]

    os.kill(pid, signal.SIGKILL)

    assert up.wait(timeout=30) == 1
    error = up.stderr.read().strip().splitlines()[-1]
    assert error == f"polar: error: inference (pid {pid}) was killed by SIGKILL"
    assert [name for name, (_, pid) in rows.items() if alive(pid)] == []


def test_up_fails_when_a_child_cannot_start(tmp_path, spawn):
    config = tmp_path / "stack.toml"
    config.write_text(
        f'[rollout]\nport = 0\nstore = "{tmp_path / "rollout.db"}"\n'
        '[inference]\nengine = "scripted"\nscript = "missing.json"\nport = 0\n'
    )

    up, _ = spawn("up", "--config", str(config))

    assert up.wait(timeout=STARTUP_SECONDS) == 1
    errors = up.stderr.read().strip().splitlines()
    assert "missing.json" in errors[0]  # the child's own one-line error
    assert errors[-1] == "polar: error: inference exited with code 1 before it was ready"


def test_up_with_its_gateway_port_taken_is_a_one_line_error_before_anything_starts(tmp_path):
    with listening_socket("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        config = tmp_path / "stack.toml"
        config.write_text(f"[gateway]\nport = {port}\n")
        started = time.monotonic()
        assert_one_line_error(
            run("up", "--config", str(config)), f"gateway's HTTP port 127.0.0.1:{port} cannot be bound"
        )
        assert time.monotonic() - started < 30  # refused before any service started


def test_up_rejects_an_unknown_config_key_by_name(tmp_path):
    config = tmp_path / "stack.toml"
    config.write_text('[inference]\nengnie = "scripted"\n')
    assert_one_line_error(run("up", "--config", str(config)), "'inference.engnie'")
