"""The `polar` command line as a user runs it: real subprocesses, real gRPC, real signals.

The scripted engine (token ids, no tokenizer) keeps every server here free of model loading.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import polar
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.slow

POLAR = [sys.executable, "-m", "polar"]
SCRIPT = {
    "tokenizer": None,
    "vocab_size": 100,
    "cycle": True,
    "outputs": [{"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -1.5]}],
}
STARTUP_SECONDS = 60


class _Lines:
    """A child's output lines, read by a thread so that waits can time out."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = STARTUP_SECONDS) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s; got {self.seen}") from None
            if line is None:
                raise AssertionError(f"output ended without a line matching {pattern!r}; got {self.seen}")
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match


@pytest.fixture
def script_file(tmp_path: Path) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return path


@pytest.fixture
def stack_config(tmp_path: Path, script_file: Path) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(
        f'[inference]\nengine = "scripted"\nscript = "{script_file}"\nport = 0\n'
        # The script has no tokenizer; the gateway renders with the tiny model's.
        '[gateway]\nport = 0\ngrpc_port = 0\ntokenizer = "tiny"\n'
        "[envoy]\nharness_port = 0\ninference_port = 0\nadmin_port = 0\n"
    )
    return path


@pytest.fixture
def spawn():
    """Start a `polar` subprocess with piped output; kill whatever is still running at the end."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, _Lines]:
        process = subprocess.Popen(
            [*POLAR, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(process)
        return process, _Lines(process.stdout)

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLAR, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)


def _generate(endpoint: str) -> list[inference_pb2.GenerateResponse]:
    with grpc.insecure_channel(endpoint) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=10, temperature=0)
        )
        return list(stub.Generate(request, timeout=30))


def _health(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        request = health_pb2.HealthCheckRequest(service="polar.v1.InferenceService")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("polar: error: ")
    for needle in needles:
        assert needle in lines[0]


def _start_stack(spawn, config: Path) -> tuple[subprocess.Popen, _Lines, str, int]:
    """`polar up` on config; return it, its output, and the inference row's endpoint and pid."""
    up, lines = spawn("up", "--config", str(config))
    lines.wait_for(r"^polar up: 3 services running")
    row = lines.wait_for(r"^\s+inference\s+(\S+)\s+(\d+)\s")
    return up, lines, row.group(1), int(row.group(2))


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
    _assert_one_line_error(_run("serve", "inference", "--model", "no-such-model"), "no-such-model")


def test_unreadable_script_is_a_one_line_error(tmp_path):
    script = tmp_path / "broken.json"
    script.write_text('{"outputs": [')
    _assert_one_line_error(_run("serve", "inference", "--engine", "scripted", "--script", str(script)), "broken.json")


def test_malformed_script_entry_is_a_one_line_error(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"tokenizer": None, "vocab_size": 10, "outputs": [{"token_ids": [99]}]}))
    _assert_one_line_error(_run("serve", "inference", "--engine", "scripted", "--script", str(script)), "outputs[0]")


def test_an_engine_whose_package_is_missing_is_a_one_line_error():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    _assert_one_line_error(_run("serve", "inference", "--engine", "vllm", "--port", "0"), "'vllm'", "setup_vllm.sh")


def test_usage_mistake_is_a_one_line_error():
    result = _run("serve", "inference", "--port", "70000")
    _assert_one_line_error(result, "--port")
    assert result.returncode == 2


def test_console_script_prints_the_version():
    polar_script = Path(sys.executable).parent / "polar"
    result = subprocess.run([str(polar_script), "version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout == f"polar {polar.__version__}\n"


# --------------------------------------------------------------------------------------------- up


def test_up_serves_until_sigint_and_leaves_no_child(spawn, stack_config):
    up, _, endpoint, pid = _start_stack(spawn, stack_config)

    assert _health(endpoint) == health_pb2.HealthCheckResponse.SERVING
    assert [t for r in _generate(endpoint) for t in r.token_ids] == [5, 6, 7]
    assert _alive(pid)

    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=30) == 0
    # polar up reaps its children before it exits: the pid must already be gone, not just dying.
    assert not _alive(pid)
    assert "Traceback" not in up.stderr.read()


def test_up_killed_with_sigkill_still_takes_its_children_down(spawn, stack_config):
    up, _, _, pid = _start_stack(spawn, stack_config)

    up.kill()
    up.wait(timeout=10)

    assert _wait_dead(pid), f"inference (pid {pid}) outlived its SIGKILLed supervisor"


def test_up_fails_when_a_child_dies(spawn, stack_config):
    up, _, _, pid = _start_stack(spawn, stack_config)

    os.kill(pid, signal.SIGKILL)

    assert up.wait(timeout=30) == 1
    error = up.stderr.read().strip().splitlines()[-1]
    assert error == f"polar: error: inference (pid {pid}) was killed by SIGKILL"


def test_up_fails_when_a_child_cannot_start(tmp_path, spawn):
    config = tmp_path / "stack.toml"
    config.write_text('[inference]\nengine = "scripted"\nscript = "missing.json"\nport = 0\n')

    up, _ = spawn("up", "--config", str(config))

    assert up.wait(timeout=STARTUP_SECONDS) == 1
    errors = up.stderr.read().strip().splitlines()
    assert "missing.json" in errors[0]  # the child's own one-line error
    assert errors[-1] == "polar: error: inference exited with code 1 before it was ready"


def test_up_rejects_an_unknown_config_key_by_name(tmp_path):
    config = tmp_path / "stack.toml"
    config.write_text('[inference]\nengnie = "scripted"\n')
    _assert_one_line_error(_run("up", "--config", str(config)), "'inference.engnie'")
