"""Polar as a NeMo Gym environment, driven by NeMo Gym's own commands (nemo-gym 0.4.0 in .venv-nemo-gym).

A real Polar stack (polar/testing/rollout.py: rollout server, scripted inference server, Envoy, a node)
runs in a thread of this process; `ng_run` starts the polar_agent server of integrations/gym beside
NeMo Gym's own equivalence_rule resources server; `ng_collect_rollouts` sends rows to the agent. The
rows it writes are checked against Polar's own records of the same sessions (reward, the prompt and
generated ids and logprobs of every call) and against NeMo RL's checks of a Gym row, ported here from
nemo_rl/environments/nemo_gym.py: each call's prompt ids begin with every id seen before it, one
logprob per generated token, a float reward.

The model is the scripted one. Harnesses: the Pi and Claude Code CLIs (their presets, installed as for
the end-to-end tests), which call their own shell tool and then answer; tests.helpers.faulty_harness
(OpenAI Chat Completions, a tool call then an answer, or a crash); and the compacting agent of the
forks test (Anthropic Messages, a compaction that forks the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar import codec
from polar.gym_items import main_trace
from polar.rollout.harness import PRESETS
from polar.testing.rollout import TEST_NODE, RolloutHandle, running_rollout
from polar.v1 import common_pb2, rollout_pb2
from tests.helpers.agent_clis import installed_clis
from tests.helpers.harness_programs import harness_command

pytestmark = [pytest.mark.nemo_gym, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GYM_VENV = REPO / ".venv-nemo-gym"
GYM_ROOT = REPO / "integrations" / "gym"
COMPACTING_AGENT = REPO / "tests" / "fixtures" / "train_tiny" / "compacting_agent.py"
FINAL_ANSWER = "Done: out.txt says hello."
TOOL_CALL = '<tool_call>\n{"name": "write_file", "arguments": {"path": "out.txt", "content": "hello"}}\n</tool_call>'
# The harness CLIs run by their presets, and the instruction that has each call its own shell tool.
CLIS = ("pi", "claude-code")
CLI_INSTRUCTION = "Create a file named hello.txt containing the word hello, using the shell ({preset})."


def shell_call(preset: str) -> str:
    return "<tool_call>\n" + json.dumps(PRESETS[preset].shell_tool.call("echo hello > hello.txt")) + "\n</tool_call>"


SCRIPT = {
    "name": "polar-scripted",
    "cycle": True,
    "rules": [
        {"prompt_regex": "<tool_response>", "text": FINAL_ANSWER},
        {"prompt_regex": "rivers|Summary so far", "text": "Rivers flow."},
        *({"prompt_regex": re.escape(f"({preset})"), "text": shell_call(preset)} for preset in CLIS),
    ],
    "outputs": [{"text": TOOL_CALL}],
}
FOUND_HELLO = 'test "$(cat out.txt)" = hello'
STARTUP_TIMEOUT_S = 240.0
COLLECT_TIMEOUT_S = 300.0

if not (GYM_VENV / "bin" / "ng_run").exists():
    pytest.skip(
        f"NeMo Gym is not installed: {GYM_VENV.name} has no ng_run (scripts/setup_nemo_gym.sh builds it)",
        allow_module_level=True,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class StackThread:
    """A Polar stack (running_rollout) served by an event loop of its own thread, so the test's own
    thread can wait on Gym's commands; `call` runs a coroutine on that loop. Its node runs commands
    unsandboxed (the mixed-rewards evaluator counts its runs in a file of the test's) and finds the
    harness CLIs in `harness_path` ("" where there is no Node.js to run them)."""

    def __init__(self, harness_path: str) -> None:
        self.node = dataclasses.replace(TEST_NODE, harness_isolation="none", harness_path=harness_path)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.handle: RolloutHandle | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with running_rollout(SCRIPT, node=self.node) as rollout:
                self.handle = rollout
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def start(self) -> RolloutHandle:
        self._thread.start()
        self._ready.wait(120)
        if self.handle is None:
            raise RuntimeError(f"the Polar stack did not start: {self._error!r}")
        return self.handle

    def call(self, coroutine: Any, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


@pytest.fixture(scope="module")
def stack() -> Iterator[StackThread]:
    # The CLIs are installed on first use, as for the end-to-end tests.
    served = StackThread(str(installed_clis()) if shutil.which("npm") else "")
    served.start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def gym(stack: StackThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`ng_run` serving polar_agent (on the test stack, no default harness) and NeMo Gym's
    equivalence_rule resources server; the addresses the commands and tasks need."""
    folder = tmp_path_factory.mktemp("gym")
    # Gym builds a venv per server unless one is there (+skip_venv_if_present): each server's is
    # .venv-nemo-gym, laid where +uv_venv_dir says Gym looks.
    for server in ("responses_api_agents/polar_agent", "resources_servers/equivalence_rule"):
        (folder / "venvs" / server).mkdir(parents=True)
        (folder / "venvs" / server / ".venv").symlink_to(GYM_VENV)
    head_port, resources_port, agent_port = free_port(), free_port(), free_port()
    config = folder / "polar_agent_test.yaml"
    config.write_text(
        json.dumps(
            {
                "polar_agent": {
                    "responses_api_agents": {
                        "polar_agent": {
                            "entrypoint": "app.py",
                            "host": "127.0.0.1",
                            "port": agent_port,
                            "rollout_address": stack.handle.address,
                            "task": {"runtime": {"kind": "local"}, "timeoutSeconds": 60},
                            "wait_timeout_s": 120,
                        }
                    }
                },
                "equivalence_rule": {
                    "resources_servers": {
                        "equivalence_rule": {
                            "entrypoint": "app.py",
                            "host": "127.0.0.1",
                            "port": resources_port,
                            "grading_rule": "exact",
                            "domain": "knowledge",
                        }
                    }
                },
            }
        )
    )
    common = [
        f"+head_server={{host: 127.0.0.1, port: {head_port}}}",
        f"+uv_venv_dir={folder / 'venvs'}",
        "+skip_venv_if_present=true",
        # Hydra's run folder (its logs of each command's config), kept out of the checkout.
        f"hydra.run.dir={folder / 'hydra'}",
    ]
    env = gym_env()
    log = (folder / "ng_run.log").open("w")
    process = subprocess.Popen(
        [str(GYM_VENV / "bin" / "ng_run"), f"+config_paths=[{config}]", *common],
        cwd=GYM_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_servers(process, folder / "ng_run.log", resources_port)
        yield {
            "common": common,
            "folder": folder,
            "resources_url": f"http://127.0.0.1:{resources_port}",
            "agent_url": f"http://127.0.0.1:{agent_port}",
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()


def gym_env() -> dict[str, str]:
    """Gym's commands' environment: its venv first on PATH (ng_run calls uv and python), Polar's
    checkout on PYTHONPATH for the agent's imports, and no Ray dashboard or usage reporting."""
    env = {name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{GYM_VENV / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_DISABLE_DOCKER_CPU_WARNING"] = "1"
    env["WANDB_MODE"] = "disabled"
    return env


def wait_for_servers(process: subprocess.Popen, log: Path, resources_port: int) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"ng_run exited with {process.returncode}:\n{log.read_text()[-6000:]}")
        if "All 2 / 2 servers ready" in log.read_text():
            return
        time.sleep(1)
    raise AssertionError(f"ng_run's servers were not ready after {STARTUP_TIMEOUT_S:g} s:\n{log.read_text()[-6000:]}")


def collect(gym: dict[str, Any], name: str, rows: list[dict[str, Any]], repeats: int = 1) -> dict[str, list[dict]]:
    """`ng_collect_rollouts` over `rows`: the rows it wrote and those of its failures file."""
    folder: Path = gym["folder"]
    inputs, output = folder / f"{name}.jsonl", folder / f"{name}_rollouts.jsonl"
    inputs.write_text("".join(json.dumps({"agent_ref": {"name": "polar_agent"}} | row) + "\n" for row in rows))
    result = subprocess.run(
        [
            str(GYM_VENV / "bin" / "ng_collect_rollouts"),
            f"+input_jsonl_fpath={inputs}",
            f"+output_jsonl_fpath={output}",
            f"+num_repeats={repeats}",
            *gym["common"],
        ],
        cwd=GYM_ROOT,
        env=gym_env(),
        capture_output=True,
        text=True,
        timeout=COLLECT_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    failures = output.with_name(output.stem + "_failures.jsonl")
    return {"rows": read_jsonl(output), "failures": read_jsonl(failures)}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def row(instruction: str, harness: list[str], evaluator: dict[str, Any] | None = None) -> dict[str, Any]:
    task: dict[str, Any] = {"harness": {"preset": "command", "command": harness}}
    if evaluator is not None:
        task["evaluator"] = evaluator
    return {"responses_create_params": {"input": [{"role": "user", "content": instruction}]}, "polar_task": task}


def trajectories(stack: StackThread) -> dict[str, common_pb2.Trajectory]:
    """Polar's own records of every session released so far, by session id, read from the rollout
    server's results stream."""

    async def read() -> dict[str, common_pb2.Trajectory]:
        found: dict[str, common_pb2.Trajectory] = {}
        async for batch in stack.handle.stub.WatchResults(rollout_pb2.WatchResultsRequest(until_caught_up=True)):
            for trajectory in codec.read_trajectory_batch(batch.zstd_trajectories):
                found[trajectory.session_id] = trajectory
        return found

    return stack.call(read())


def nemo_rl_checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """NeMo RL's reading of a Gym row (nemo_rl/environments/nemo_gym.py): the items with token ids,
    each call's prompt beginning with everything seen so far; fails as NeMo RL does. Returns the
    calls as it reads them."""
    assert isinstance(result["reward"], float) and not isinstance(result["reward"], bool)
    seen: list[int] = []
    calls = []
    for item in result["response"]["output"]:
        if not item.get("generation_token_ids"):
            continue
        prompt = item["prompt_token_ids"]
        assert prompt[: len(seen)] == seen, "Non-contiguous messages found!"
        assert len(item["generation_log_probs"]) == len(item["generation_token_ids"])
        seen = [*seen, *prompt[len(seen) :], *item["generation_token_ids"]]
        calls.append(item)
    assert calls, "a row with no trainable call"
    return calls


def assert_row_is_polar_s(result: dict[str, Any], trajectory: common_pb2.Trajectory) -> None:
    """The row's reward is Polar's evaluator's, and its calls are the main trace's recorded calls:
    each one's prompt, sampled ids and logprobs as the gateway recorded them."""
    assert result["reward"] == trajectory.reward
    records = {record.call_id: record for record in trajectory.calls}
    trace = main_trace(trajectory)
    sampled = [s.call_id for s in trace.segments if s.kind == common_pb2.TraceSegment.KIND_SAMPLED]
    calls = nemo_rl_checks(result)
    assert len(calls) == len(sampled)
    for item, call_id in zip(calls, sampled):
        record = records[call_id]
        assert item["prompt_token_ids"] == list(record.prompt_token_ids)
        assert item["generation_token_ids"] == list(record.sampled_token_ids)
        assert item["generation_log_probs"] == pytest.approx(list(record.sampled_logprobs))


def test_collected_rows_are_polar_s_sessions_with_mixed_rewards(
    stack: StackThread, gym: dict[str, Any], tmp_path: Path
) -> None:
    # Alternating rewards within each row's group: each run of the evaluator takes the next free
    # number by mkdir, which is atomic (evaluators run concurrently), and scores its parity.
    runs = tmp_path / "runs"
    runs.mkdir()
    alternate = f"n=0; until mkdir {runs}/$n 2>/dev/null; do n=$((n + 1)); done; echo $((n % 2))"
    rows = [
        row(
            "Write hello to out.txt.",
            harness_command("faulty_harness", "normal"),
            {"kind": "command", "command": FOUND_HELLO},
        ),
        row(
            "Write hello to out.txt.",
            harness_command("faulty_harness", "normal"),
            {"kind": "command", "command": alternate},
        ),
    ]
    # The sampling NeMo RL sets on each row reaches every model call of its sessions.
    rows[0]["responses_create_params"] |= {"temperature": 0.5, "top_p": 0.75, "max_output_tokens": 96}
    collected = collect(gym, "mixed", rows, repeats=4)
    assert collected["failures"] == []
    results = collected["rows"]
    assert len(results) == 8
    by_session = trajectories(stack)
    for result in results:
        trajectory = by_session[result["polar_session_id"]]
        assert trajectory.outcome == common_pb2.SESSION_OUTCOME_COMPLETED, trajectory.error
        assert_row_is_polar_s(result, trajectory)
        assert result["response"]["output"][-1]["content"][0]["text"] == FINAL_ANSWER
    rewards = {index: sorted(r["reward"] for r in results if r["_ng_task_index"] == index) for index in (0, 1)}
    assert rewards == {0: [1.0, 1.0, 1.0, 1.0], 1: [0.0, 0.0, 1.0, 1.0]}
    sampled = {
        (result["_ng_task_index"], call.sampling.temperature, call.sampling.top_p, call.sampling.max_tokens <= 96)
        for result in results
        for call in by_session[result["polar_session_id"]].calls
    }
    assert {entry for entry in sampled if entry[0] == 0} == {(0, 0.5, 0.75, True)}


def test_real_harness_clis_give_rows_of_their_recorded_sessions(stack: StackThread, gym: dict[str, Any]) -> None:
    if not stack.node.harness_path:
        pytest.skip("the harness CLIs need node and npm on PATH")
    evaluator = {"kind": "command", "command": 'test "$(cat hello.txt)" = hello'}
    rows = [
        row(CLI_INSTRUCTION.format(preset=preset), [])
        | {"polar_task": {"harness": {"preset": preset}, "evaluator": evaluator}}
        for preset in CLIS
    ]
    collected = collect(gym, "clis", rows)
    assert collected["failures"] == []
    by_session = trajectories(stack)
    assert len(collected["rows"]) == len(CLIS)
    for result in collected["rows"]:
        trajectory = by_session[result["polar_session_id"]]
        assert trajectory.outcome == common_pb2.SESSION_OUTCOME_COMPLETED, trajectory.error
        assert result["reward"] == 1.0
        assert_row_is_polar_s(result, trajectory)
        assert FINAL_ANSWER in [
            item["content"][0]["text"] for item in result["response"]["output"] if item["type"] == "message"
        ]


def test_a_compacted_session_yields_its_main_chain_only(stack: StackThread, gym: dict[str, Any]) -> None:
    harness = [sys.executable, str(COMPACTING_AGENT), "compact"]
    [result] = collect(gym, "compaction", [row("Write some words.", harness)])["rows"]
    trajectory = trajectories(stack)[result["polar_session_id"]]
    assert [trace.fork_reason for trace in trajectory.traces] == ["", "compaction"]
    assert result["polar_trace_id"] == trajectory.traces[1].trace_id and result["polar_other_traces"] == 1
    assert_row_is_polar_s(result, trajectory)


def test_a_task_graded_by_a_gym_resources_server_gets_its_reward(stack: StackThread, gym: dict[str, Any]) -> None:
    def gym_task(expected: str) -> rollout_pb2.Task:
        return rollout_pb2.Task(
            instruction="Write hello to out.txt.",
            group_size=1,
            harness=rollout_pb2.HarnessSpec(preset="command", command=harness_command("faulty_harness", "normal")),
            evaluator=rollout_pb2.EvaluatorSpec(
                kind="gym",
                gym=rollout_pb2.GymVerifier(
                    url=gym["resources_url"], row_json=json.dumps({"expected_answer": expected})
                ),
            ),
            timeout_seconds=60,
        )

    async def run() -> list[common_pb2.Trajectory]:
        task_ids = await stack.handle.submit(gym_task(FINAL_ANSWER), gym_task("Something else."))
        found = {}
        async with asyncio.timeout(90):
            while len(found) < 2:
                status = await stack.handle.stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=task_ids))
                if all(task.released for task in status.tasks):
                    for task in status.tasks:
                        found[task.task_id] = task
                await asyncio.sleep(0.2)
        return [found[task_id] for task_id in task_ids]

    right, wrong = stack.call(run())
    assert (right.mean_reward, wrong.mean_reward) == (1.0, 0.0)


def test_bad_rows_come_back_as_failures_with_their_reason(gym: dict[str, Any]) -> None:
    rows = [
        {"responses_create_params": {"input": "Write hello to out.txt."}, "polar_task": {}},
        row("Write hello.", []) | {"polar_task": {"harness": {"preset": "no-such-cli"}}},
        row("Write hello to out.txt.", harness_command("faulty_harness", "crash")),
        row("Write hello.", []) | {"polar_task": {"harness": {"preset": "command", "command": ["true"]}, "builder": 7}},
    ]
    collected = collect(gym, "bad", rows)
    assert collected["rows"] == []
    failures = sorted(collected["failures"], key=lambda failure: failure["_ng_task_index"])
    assert [f["_ng_failure_class"] for f in failures] == ["skipped", "skipped", "legitimate", "skipped"]
    assert [f["reward"] for f in failures] == [0.0] * 4
    assert "harness.preset" in failures[0]["error_message"]
    assert "no-such-cli" in failures[1]["error_message"]
    assert "exited with code 3" in failures[2]["error_message"]
    assert "polar_task is not a Polar task" in failures[3]["error_message"]


def test_the_agent_s_responses_route_answers_a_refused_task_with_its_reason(gym: dict[str, Any]) -> None:
    # The test's YAML names no harness, so the agent's own task is refused, at once and with the reason.
    request = urllib.request.Request(
        f"{gym['agent_url']}/v1/responses",
        data=json.dumps({"input": "Write hello to out.txt."}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    assert "harness.preset" in json.loads(refused.value.read())["detail"]
