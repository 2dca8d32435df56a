"""The harness cannot touch the control plane: attacks replayed from a harness inside a real `polar up`
stack (rollout server, scripted inference, Envoy, a node) are refused, and the stack's legitimate
callers still work with nothing lost.

tests/helpers/attacking_harness.py runs as each session's harness: it reads the stack's credential files, opens TCP
connections to the control plane's ports, calls every control-plane rpc a model-written command could
reach from the machine (reward reporting, heartbeats under the node's id, also with the node's own
credential where it can read it, another session's key and records, closing it, draining, pausing
and updating the model, directly and via Envoy) and stops
Envoy through its TCP listeners, then solves its task through its own gateway key, streamed and whole.
The stack runs under each `harness_isolation` of the local runtime; those that need user namespaces
are skipped where this machine cannot make them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from pathlib import Path

import grpc
import pytest

from polar import credentials
from polar.app.node.isolation import probe
from polar.envoy import admin_get
from polar.v1 import gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.helpers.harness_programs import harness_command
from tests.helpers.polar_command import STARTUP_SECONDS, run
from tests.helpers.stack_config import write_stack_config

pytestmark = pytest.mark.slow

DONE_IDS = [41462, 30, 2]  # "Done." and <|im_end|> in the tiny model's tokenizer
ATTACKER = harness_command("attacking_harness")


GRPC_REFUSAL = {
    "none": "refused UNAUTHENTICATED",
    "namespace": "refused UNAUTHENTICATED",
    "network": "refused UNAVAILABLE",
}
CREDENTIAL_READS = {"read the node credential file", "read the operator credential file"}
TCP_CONNECTIONS = {f"TCP connection to the {name} port" for name in ("rollout", "inference", "gateway")}
# What each isolation leaves a harness: the files, and the ports (whose rpcs still refuse it).
ALLOWED = {"none": CREDENTIAL_READS | TCP_CONNECTIONS, "namespace": TCP_CONNECTIONS, "network": set()}


@pytest.fixture(params=["none", "namespace", "network"])
def isolation(request, tmp_path: Path) -> str:
    if request.param != "none" and (problem := probe(request.param, tmp_path / "probe")) is not None:
        pytest.skip(f"harness_isolation = {request.param!r} cannot run here: {problem}")
    return request.param


@pytest.fixture
def stack_config(tmp_path: Path, isolation: str) -> Path:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"cycle": True, "outputs": [{"token_ids": DONE_IDS, "logprobs": [-0.5, -1.0, -1.5]}]}))
    return write_stack_config(
        tmp_path / "stack.toml",
        rollout={"store": tmp_path / "rollout.db", "heartbeat_interval_s": 0.2},
        inference={"engine": "scripted", "script": script},
        envoy={"workers": 1},
        node={
            "init_workers": 1,
            "ready_slots": 1,
            "running_slots": 2,
            "postrun_workers": 1,
            "harness_isolation": isolation,
        },
    )


def test_attacks_from_a_harness_are_refused_and_the_stack_still_works(spawn, stack_config, isolation, tmp_path):
    up, lines = spawn("up", "--config", str(stack_config))
    lines.wait_for(r"^polar up: 4 services running")
    rows = {
        name: lines.wait_for(rf"^\s+{name}\s+(\S+)\s+(\d+)\s.*").group(0)
        for name in ("rollout", "inference", "envoy", "node")
    }
    admin = re.search(r"admin (unix:/\S+)$", rows["envoy"]).group(1)
    assert rows["node"].endswith(f"local harnesses isolated: {isolation}")
    rows = {name: row.split()[1] for name, row in rows.items()}
    nodes = run("status", "--rollout", rows["rollout"])
    assert nodes.returncode == 0, nodes.stderr
    node_id = nodes.stdout.splitlines()[1].split()[0]
    assert node_id.startswith("node-")

    env = {
        "POLAR_ATTACK_ROLLOUT": rows["rollout"],
        "POLAR_ATTACK_INFERENCE": rows["inference"],
        "POLAR_ATTACK_ENVOY_INFERENCE": rows["envoy"],
        "POLAR_ATTACK_GATEWAY": rows["node"],
        "POLAR_ATTACK_NODE_ID": node_id,
        "POLAR_ATTACK_TOKEN_FOLDER": os.environ["POLAR_STATE_DIR"] + "/credentials",
    }
    task = {
        "taskId": "attack",
        "instruction": "Say done.",
        "groupSize": 2,
        "harness": {"preset": "command", "command": ATTACKER, "env": env},
        "evaluator": {"kind": "command", "command": "echo 0.5"},
    }
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(task) + "\n")
    submitted = run("submit", str(tasks), "--rollout", rows["rollout"])
    assert submitted.returncode == 0, submitted.stderr
    watched = run("status", "--watch", "--interval", "0.2", "--rollout", rows["rollout"], timeout=STARTUP_SECONDS)
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.splitlines()[-1].startswith("total: 1 task, 1 released; 2 sessions: 2 done")

    # Nothing lost: both sessions completed with the evaluator's reward, not the forged one, and
    # each kept its two calls, streamed and whole (no session was closed under its harness, the
    # model was never paused).
    exported = run("results", "--export", str(tmp_path / "out.jsonl"), "--rollout", rows["rollout"])
    assert exported.returncode == 0, exported.stderr
    trajectories = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [t["sessionId"] for t in trajectories] == ["attack.0", "attack.1"]
    for trajectory in trajectories:
        assert trajectory["outcome"] == "SESSION_OUTCOME_COMPLETED", trajectory.get("error")
        assert trajectory["reward"] == 0.5 and trajectory["attempt"] == 1
        assert len(trajectory["calls"]) == 2
        output = trajectory["harnessOutput"]
        streamed = [line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("STREAMED ")]
        assert streamed[-1] == "[DONE]" and len(streamed) >= 3, output
        assert "Done." in "".join(
            json.loads(event)["choices"][0]["delta"].get("content") or ""
            for event in streamed[:-1]
            if json.loads(event)["choices"]
        )
        assert output.splitlines()[-1] == "Done."

        [report] = [line for line in output.splitlines() if line.startswith("ATTACKS ")]
        attacks = json.loads(report.removeprefix("ATTACKS "))
        assert len(attacks) == 23
        allowed = {name for name, outcome in attacks.items() if not outcome.startswith("refused")}
        assert allowed == ALLOWED[isolation], attacks
        stolen = [outcome for name, outcome in attacks.items() if name.startswith("stolen node token")]
        assert len(stolen) == 2
        if isolation != "none":
            assert all(attacks[name] == "refused: No such file or directory" for name in CREDENTIAL_READS), attacks
            assert all(outcome == "refused: No such file or directory" for outcome in stolen), attacks
        else:
            # With the node's credential, the node's id is still not the attacker's: it lacks the node's secret.
            refusal = f"refused PERMISSION_DENIED: node '{node_id}': the node_secret sent is not"
            assert all(outcome.startswith(refusal) for outcome in stolen), attacks
        if isolation == "network":
            assert all(attacks[name] == "refused: Connection refused" for name in TCP_CONNECTIONS), attacks
        grpc_attacks = [outcome for name, outcome in attacks.items() if "Service." in name and "stolen" not in name]
        assert all(outcome.startswith(GRPC_REFUSAL[isolation]) for outcome in grpc_attacks), attacks
        if isolation != "network":
            assert all("authorization: Bearer <token>" in outcome for outcome in grpc_attacks)

    # The operator's credential (found by the `polar` commands in the state folder) still opens
    # every door the harness found shut.
    operator = credentials.for_commands()
    assert operator is not None and operator.folder == Path(os.environ["POLAR_STATE_DIR"]) / "credentials"
    with credentials.channel(rows["inference"], credentials.OPERATOR, operator) as channel:
        inference = inference_pb2_grpc.InferenceServiceStub(channel)
        inference.Pause(inference_pb2.PauseRequest(), timeout=10)
        inference.Resume(inference_pb2.ResumeRequest(), timeout=10)
    with credentials.channel(rows["node"], credentials.OPERATOR, operator) as channel:
        status = gateway_pb2_grpc.GatewayServiceStub(channel).GetNodeStatus(
            gateway_pb2.GetNodeStatusRequest(), timeout=10
        )
        assert not status.status.draining
    # The node's credential is not the operator's: it cannot read sessions.
    with credentials.channel(rows["node"], credentials.NODE, operator) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            gateway_pb2_grpc.GatewayServiceStub(channel).GetSession(
                gateway_pb2.GetSessionRequest(key="attack.0"), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # Envoy's admin interface answers on its Unix socket (mode 0600) only.
    assert admin_get(admin, "/ready") is not None
    assert stat.S_IMODE(os.stat(admin.removeprefix("unix:")).st_mode) == 0o600

    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=30) == 0
    warned = "can read the stack's credentials" in up.stderr.read()
    assert warned == (isolation == "none")
