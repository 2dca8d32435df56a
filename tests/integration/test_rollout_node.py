"""A gateway node running sessions for a real rollout server: pools, prewarming, outcomes and faults.

Real services on loopback ports (polar/testing/rollout.py): the rollout server on SQLite, the scripted
inference server, Envoy, the node with its gateway; the harness is a real subprocess
(tests/helpers/faulty_harness.py) speaking OpenAI Chat Completions through Envoy. The scripted model answers with a
`write_file` tool call, then, once the tool result is in the prompt, with a final message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
from pathlib import Path

import pytest

from polar.testing.rollout import TEST_NODE, command_task, running_rollout
from polar.trajectory import verify, views_from_protos
from polar.trajectory.records import BuiltTrace
from polar.v1 import common_pb2, rollout_pb2
from tests.helpers.harness_programs import harness_command

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

HARNESS = "tests.helpers.faulty_harness"  # in the command line of each of its processes
TOOL_CALL = '<tool_call>\n{"name": "write_file", "arguments": {"path": "out.txt", "content": "hello"}}\n</tool_call>'
SCRIPT = {
    "name": "polar-scripted",
    "cycle": True,
    "rules": [{"prompt_regex": "<tool_response>", "text": "Done: out.txt says hello."}],
    "outputs": [{"text": TOOL_CALL}],
}
FOUND_HELLO = 'test "$(cat out.txt)" = hello'
OUTCOME = common_pb2.SessionOutcome


def harness(mode: str = "normal") -> list[str]:
    return harness_command("faulty_harness", mode)


def assert_faithful(trajectory: common_pb2.Trajectory) -> None:
    """Every trainable token of every trace is one the engine sampled, with its logprob."""
    calls = views_from_protos(trajectory.calls)
    traces = [BuiltTrace.from_proto(trace) for trace in trajectory.traces]
    report = verify(calls, traces)
    assert report.ok, report.render()


async def test_a_group_runs_end_to_end_and_arrives_whole() -> None:
    async with running_rollout(SCRIPT) as rollout:
        [task_id] = await rollout.submit(
            command_task(
                harness(),
                instruction="Write hello to out.txt.",
                group_size=2,
                evaluator=FOUND_HELLO,
                metadata={"suite": "smoke"},
            )
        )
        [group] = await rollout.groups(1)
    assert [t.session_id for t in group] == [f"{task_id}.0", f"{task_id}.1"]
    for trajectory in group:
        assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, trajectory.error
        assert trajectory.group_id == task_id and trajectory.task_id == task_id
        assert trajectory.reward == 1.0
        assert len(trajectory.calls) == 2
        assert len(trajectory.traces) == 1  # the second call extends the first: one merged trace
        assert trajectory.builder == "prefix_merging"
        assert_faithful(trajectory)
        assert trajectory.attempt == 1 and trajectory.harness_exit_code == 0
        assert "Done: out.txt says hello." in trajectory.harness_output
        assert trajectory.metadata["suite"] == "smoke"
        timings = trajectory.stage_timings
        assert timings.running_seconds > 0 and timings.postrun_seconds > 0
        assert timings.queued_seconds >= 0


async def test_the_task_builder_is_used() -> None:
    async with running_rollout(SCRIPT) as rollout:
        await rollout.submit(command_task(harness(), builder="per_request"))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.builder == "per_request"
    assert len(trajectory.traces) == 2
    assert_faithful(trajectory)


async def test_bodies_the_gateway_spilled_to_disk_reach_the_rollout_server_whole() -> None:
    # A cap of 0: every call's bodies leave the gateway's memory for its spill file.
    async with running_rollout(SCRIPT, gateway={"max_session_body_bytes": 0}) as rollout:
        await rollout.submit(command_task(harness(), evaluator=FOUND_HELLO))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED and len(trajectory.calls) == 2, trajectory.error
    for call in trajectory.calls:
        assert json.loads(call.request_body)["max_tokens"] == 128  # the request as the harness sent it
        assert json.loads(call.response_body)["object"] == "chat.completion" and not call.bodies_dropped
    assert_faithful(trajectory)


async def test_a_task_s_sampling_policy_reaches_every_recorded_call_and_trace() -> None:
    followed = common_pb2.SamplingPolicy(temperature=0.25, top_p=0.5, max_tokens_per_call=64)
    cut = common_pb2.SamplingPolicy(temperature=0.0, max_tokens_per_call=4)  # shorter than any reply
    async with running_rollout(SCRIPT) as rollout:
        ids = await rollout.submit(
            command_task(harness(), evaluator=FOUND_HELLO, sampling=followed),
            command_task(harness(), builder="per_request", sampling=cut),
        )
        groups = {group[0].task_id: group for group in await rollout.groups(2)}
    [full], [truncated] = groups[ids[0]], groups[ids[1]]

    assert full.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED and full.reward == 1.0, full.error
    assert len(full.calls) == 2
    for call in full.calls:
        # The example agent asks for 128 tokens at its own temperature; the task's policy decides.
        assert json.loads(call.request_body)["max_tokens"] == 128
        assert call.sampling.max_tokens == 64 and not call.truncated
        assert call.sampling.temperature == pytest.approx(0.25) and call.sampling.top_p == pytest.approx(0.5)
    [trace] = full.traces
    assert not trace.truncated
    assert [s.sampling for s in trace.segments if s.kind == common_pb2.TraceSegment.KIND_SAMPLED] == [
        call.sampling for call in full.calls
    ]
    assert_faithful(full)

    assert truncated.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, truncated.error
    assert truncated.calls and truncated.traces
    for call in truncated.calls:
        assert len(call.sampled_token_ids) == call.sampling.max_tokens == 4 and call.sampling.temperature == 0.0
        assert call.truncated and call.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(trace.truncated for trace in truncated.traces)
    assert_faithful(truncated)


async def test_a_prewarmed_session_skips_init() -> None:
    config = dataclasses.replace(TEST_NODE, prewarm=True, ready_slots=2)
    async with running_rollout(SCRIPT, node=config) as rollout:
        node = rollout.nodes[0].node
        async with asyncio.timeout(30):
            while node.ready.size < 2:
                await asyncio.sleep(0.02)
        await rollout.submit(command_task(harness(), evaluator=FOUND_HELLO))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, trajectory.error
    assert trajectory.stage_timings.init_seconds == 0.0
    assert trajectory.reward == 1.0


async def test_without_prewarming_every_session_passes_init() -> None:
    config = dataclasses.replace(TEST_NODE, prewarm=False)
    async with running_rollout(SCRIPT, node=config) as rollout:
        await rollout.submit(command_task(harness()))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.stage_timings.init_seconds > 0.0
    assert rollout.nodes[0].node.ready.size == 0


async def test_a_crashing_harness_keeps_its_calls() -> None:
    async with running_rollout(SCRIPT) as rollout:
        await rollout.submit(command_task(harness("crash"), evaluator="echo 0.25"))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_FAILED
    assert "exited with code 3" in trajectory.error
    assert trajectory.harness_exit_code == 3
    assert "harness: giving up" in trajectory.harness_output
    assert len(trajectory.calls) == 1
    assert_faithful(trajectory)
    assert trajectory.reward == 0.25  # the evaluator still judged what the harness left behind


async def test_a_harness_past_its_timeout_is_killed_with_its_children() -> None:
    async with running_rollout(SCRIPT) as rollout:
        # Long enough for the harness's one call on a loaded machine (it hangs only after it).
        await rollout.submit(command_task(harness("hang"), timeout_s=10.0))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_TIMED_OUT
    assert "timeout of 10 s" in trajectory.error
    assert len(trajectory.calls) == 1
    assert 10.0 <= trajectory.stage_timings.running_seconds < 30.0
    assert not _harness_running("hang") and not _processes_running("time.sleep(600)")


async def test_a_harness_that_never_calls_the_model() -> None:
    async with running_rollout(SCRIPT) as rollout:
        await rollout.submit(command_task(harness("silent")))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_FAILED
    assert "without calling the model" in trajectory.error
    assert len(trajectory.calls) == 0 and len(trajectory.traces) == 0


async def test_a_harness_whose_first_call_does_not_fit_the_context_fails_with_that_reason() -> None:
    async with running_rollout({**SCRIPT, "context_length": 16}) as rollout:
        [task_id] = await rollout.submit(command_task(harness()))
        [[trajectory]] = await rollout.groups(1)
        status = await rollout.session_status(f"{task_id}.0")
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_FAILED
    assert trajectory.error.startswith("the harness's first call does not fit the model's context: the prompt is ")
    assert "the model's context holds 16" in trajectory.error
    [call] = trajectory.calls
    assert call.prompt_too_long and not call.sampled_token_ids and len(call.prompt_token_ids) > 16
    assert len(trajectory.traces) == 0
    assert trajectory.attempt == 1 and status.attempts == 1  # not dispatched again
    assert status.state == rollout_pb2.SESSION_STATE_DONE and status.error == trajectory.error


async def test_a_flooding_harness_is_capped_and_still_completes() -> None:
    async with running_rollout(SCRIPT) as rollout:
        await rollout.submit(command_task(harness("flood"), evaluator=FOUND_HELLO))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, trajectory.error
    assert len(trajectory.calls) == 2 and trajectory.reward == 1.0
    assert len(trajectory.harness_output.encode()) <= TEST_NODE.harness_output_limit + 200
    assert "omitted" in trajectory.harness_output


async def test_a_failing_prepare_step_fails_the_session_without_running_the_harness() -> None:
    async with running_rollout(SCRIPT) as rollout:
        runtime = rollout_pb2.RuntimeSpec(kind="local", prepare=["echo preparing", "exit 7"])
        await rollout.submit(command_task(harness(), runtime=runtime))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_FAILED
    assert trajectory.error.startswith("runtime:") and "exit 7" in trajectory.error
    assert len(trajectory.calls) == 0
    assert trajectory.stage_timings.running_seconds == 0.0


async def test_a_crashing_evaluator_fails_the_session_and_keeps_the_calls() -> None:
    async with running_rollout(SCRIPT) as rollout:
        await rollout.submit(command_task(harness(), evaluator="echo broken >&2; kill -SEGV $$"))
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_FAILED
    assert "evaluator:" in trajectory.error
    assert trajectory.reward == 0.0
    assert len(trajectory.calls) == 2
    assert_faithful(trajectory)


async def test_a_cancelled_running_session_keeps_its_partial_calls() -> None:
    async with running_rollout(SCRIPT) as rollout:
        [task_id] = await rollout.submit(command_task(harness("hang"), timeout_s=120))
        session_id = f"{task_id}.0"
        async with asyncio.timeout(30):
            while (await rollout.session_status(session_id)).call_count < 1:
                await asyncio.sleep(0.05)
        response = await rollout.stub.Cancel(rollout_pb2.CancelRequest(session_ids=[session_id]), timeout=10)
        assert response.cancelled == 1
        [[trajectory]] = await rollout.groups(1)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_CANCELLED
    assert len(trajectory.calls) == 1
    assert not _processes_running("time.sleep(600)")


async def test_a_session_cancelled_while_waiting_for_init_ends_cancelled() -> None:
    config = dataclasses.replace(TEST_NODE, init_workers=1, prewarm=False)
    slow_prepare = rollout_pb2.RuntimeSpec(kind="local", prepare=["sleep 2"])
    async with running_rollout(SCRIPT, node=config) as rollout:
        [task_id] = await rollout.submit(command_task(harness(), group_size=2, runtime=slow_prepare))
        waiting = f"{task_id}.1"
        node = rollout.nodes[0].node
        async with asyncio.timeout(30):
            while node.init.waiting < 1:
                await asyncio.sleep(0.02)
        await rollout.stub.Cancel(rollout_pb2.CancelRequest(session_ids=[waiting]), timeout=10)
        [group] = await rollout.groups(1)
    by_id = {t.session_id: t for t in group}
    assert by_id[waiting].outcome == OUTCOME.SESSION_OUTCOME_CANCELLED, by_id[waiting].error
    assert by_id[waiting].stage_timings.running_seconds == 0.0
    assert by_id[f"{task_id}.0"].outcome == OUTCOME.SESSION_OUTCOME_COMPLETED


async def test_session_status_follows_the_stages() -> None:
    async with running_rollout(SCRIPT) as rollout:
        [task_id] = await rollout.submit(command_task(harness("slow"), evaluator=FOUND_HELLO))
        running = await rollout.wait_for_state(f"{task_id}.0", rollout_pb2.SESSION_STATE_RUNNING)
        assert running.node_id == rollout.nodes[0].node.node_id
        done = await rollout.wait_for_state(f"{task_id}.0", rollout_pb2.SESSION_STATE_DONE)
    assert done.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED and done.reward == 1.0
    assert done.call_count == 2 and done.attempts == 1


async def test_a_restarted_rollout_server_loses_nothing(tmp_path: Path) -> None:
    """The server stops while a session runs and a finished group is stored; started again on the same
    store and port, it still has the finished group, and the node's running session reports into it."""
    from polar.config import RolloutConfig
    from polar.rollout.server import start_rollout_server

    async with running_rollout(SCRIPT, store_path=tmp_path / "rollout.db") as rollout:
        [first] = await rollout.submit(command_task(harness(), evaluator=FOUND_HELLO))
        [[finished]] = await rollout.groups(1)
        [second] = await rollout.submit(_slow_task())
        await rollout.wait_for_state(f"{second}.0", rollout_pb2.SESSION_STATE_RUNNING)
        host, port = rollout.rollout.host, rollout.rollout.port
        await rollout.rollout.stop()
        await asyncio.sleep(0.5)
        rollout.rollout = await start_rollout_server(
            RolloutConfig(
                host=host, port=port, store=str(rollout.store_path), heartbeat_interval_s=0.5, node_timeout_s=5.0
            )
        )
        groups = await rollout.groups(2)
    assert [group[0].task_id for group in groups] == [first, second]
    assert groups[0][0] == finished
    [after] = groups[1]
    assert after.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, after.error
    assert after.attempt == 1 and after.reward == 1.0 and len(after.calls) == 2


async def test_a_node_that_stops_hands_its_sessions_back_at_once() -> None:
    """A node stopped while its session runs tells the server, which forgets the node and dispatches
    the session again now, not after the node's timeout (a minute here): it is pending before the
    stop returns, and the next node runs it as its second attempt."""
    async with running_rollout(SCRIPT, node_timeout_s=60.0) as rollout:
        [task_id] = await rollout.submit(_slow_task())
        session_id = f"{task_id}.0"
        await rollout.wait_for_state(session_id, rollout_pb2.SESSION_STATE_RUNNING)
        first_node = (await rollout.session_status(session_id)).node_id
        await rollout.nodes[0].stop()
        status = await rollout.session_status(session_id)
        assert status.state == rollout_pb2.SESSION_STATE_PENDING and not status.node_id
        # Forgotten at once, not left listed until its timeout.
        assert not (await rollout.stub.ListNodes(rollout_pb2.ListNodesRequest(), timeout=10)).nodes
        await rollout.start_node()
        [[trajectory]] = await rollout.groups(1, timeout_s=30.0)
        status = await rollout.session_status(session_id)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, (trajectory.error, trajectory.harness_output)
    assert trajectory.attempt == 2 and status.node_id != first_node
    assert_faithful(trajectory)


async def test_a_report_too_large_for_the_server_fails_its_session_and_the_group_is_released() -> None:
    """A session whose calls each fit a heartbeat but whose trajectory exceeds the server's limit:
    the node reports it failed, naming both sizes, and its group is released beside a normal one."""
    limit = 256 * 1024
    async with running_rollout(SCRIPT, max_request_bytes=limit) as rollout:
        assert rollout.nodes[0].node.max_request_bytes == limit
        big, small = await rollout.submit(
            command_task(harness(), instruction="Write hello to out.txt. " + "hello " * 16_000, evaluator=FOUND_HELLO),
            command_task(harness(), instruction="Write hello to out.txt.", evaluator=FOUND_HELLO),
        )
        groups = {group[0].task_id: group for group in await rollout.groups(2)}
        status = await rollout.session_status(f"{big}.0")
    [failed], [fine] = groups[big], groups[small]
    assert failed.outcome == OUTCOME.SESSION_OUTCOME_FAILED and failed.attempt == 1 and status.attempts == 1
    size = int(re.search(r"its report is (\d+) bytes, over the rollout server's limit of (\d+) bytes", failed.error)[1])
    assert size > limit and f"limit of {limit} bytes" in failed.error
    assert failed.reward == 1.0 and "Done: out.txt says hello." in failed.harness_output  # kept
    assert list(failed.calls) == [] and list(failed.traces) == []
    assert fine.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED and fine.reward == 1.0 and len(fine.calls) == 2


async def test_a_server_restarted_with_a_lower_limit_gets_heartbeats_and_a_failed_report_from_its_node(
    tmp_path: Path,
) -> None:
    """The server goes down while a session records a call larger than the limit it comes back with:
    the node's heartbeat holding the call is refused, sent again without it, and the node learns the
    new limit and stays alive; the session's report, too large, becomes a failed one naming it."""
    from polar.codec import MAX_ROLLOUT_MESSAGE_BYTES
    from polar.config import RolloutConfig
    from polar.rollout.server import start_rollout_server

    limit = 128 * 1024
    async with running_rollout(SCRIPT, store_path=tmp_path / "rollout.db") as rollout:
        node = rollout.nodes[0].node
        assert node.max_request_bytes == MAX_ROLLOUT_MESSAGE_BYTES
        task = command_task(
            harness("slow"), instruction="Write hello to out.txt. " + "hello " * 16_000, evaluator=FOUND_HELLO
        )
        task.harness.env["POLAR_TEST_PAUSE"] = "5"  # the server is back well before the second call
        [task_id] = await rollout.submit(task)
        async with asyncio.timeout(30):
            while (run := node.runs.get(f"{task_id}.0")) is None:  # assigned: no call made yet
                await asyncio.sleep(0.01)
        host, port = rollout.rollout.host, rollout.rollout.port
        await rollout.rollout.stop()
        async with asyncio.timeout(30):
            while run.gateway_session is None or not run.gateway_session.records:
                await asyncio.sleep(0.02)
        [call] = run.gateway_session.records
        assert run.calls_delivered == 0 and len(run.gateway_session.serialized(call)) > limit
        rollout.rollout = await start_rollout_server(
            RolloutConfig(
                host=host, port=port, store=str(rollout.store_path), heartbeat_interval_s=0.5, max_request_bytes=limit
            )
        )
        async with asyncio.timeout(10):
            while node.max_request_bytes != limit:
                await asyncio.sleep(0.05)
        [[failed]] = await rollout.groups(1)
        status = await rollout.session_status(f"{task_id}.0")
    assert failed.outcome == OUTCOME.SESSION_OUTCOME_FAILED and failed.attempt == 1 and status.attempts == 1
    assert re.search(rf"its report is \d+ bytes, over the rollout server's limit of {limit} bytes", failed.error), (
        failed.error
    )
    assert failed.reward == 1.0 and list(failed.calls) == []


async def test_a_node_registers_again_under_a_new_identity_and_keeps_working(tmp_path: Path) -> None:
    """The rollout server comes back on an empty store: it no longer knows the node, which registers
    again (a new id and secret) and runs the next task."""
    from polar.config import RolloutConfig
    from polar.rollout.server import start_rollout_server

    async with running_rollout(SCRIPT, store_path=tmp_path / "first.db") as rollout:
        node = rollout.nodes[0].node
        first_id, first_secret = node.node_id, node._node_secret
        host, port = rollout.rollout.host, rollout.rollout.port
        await rollout.rollout.stop()
        rollout.rollout = await start_rollout_server(
            RolloutConfig(host=host, port=port, store=str(tmp_path / "second.db"), heartbeat_interval_s=0.5)
        )
        [task_id] = await rollout.submit(command_task(harness(), evaluator=FOUND_HELLO))
        [[trajectory]] = await rollout.groups(1)
        status = await rollout.session_status(f"{task_id}.0")
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED and trajectory.reward == 1.0, trajectory.error
    assert status.node_id == node.node_id != first_id
    assert node._node_secret and node._node_secret != first_secret


def _slow_task() -> rollout_pb2.Task:
    task = command_task(harness("slow"), evaluator=FOUND_HELLO)
    task.harness.env["POLAR_TEST_PAUSE"] = "3"
    return task


def _harness_running(mode: str) -> list[int]:
    """Pids of faulty_harness processes in `mode`: other test processes may run it in other modes at
    the same time (test_cli.py's stacks run it in its normal mode)."""
    return _processes_running(f"{HARNESS} {mode}")


def _processes_running(needle: str) -> list[int]:
    """Pids of live processes whose command line contains `needle` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


async def test_a_killed_node_s_session_is_run_again_elsewhere() -> None:
    """A node process is SIGKILLed while its harness runs: the harness dies with it (PDEATHSIG), the
    server declares the node dead after its timeout, and another node runs the session again; the
    call the dead node recorded arrives too, as an abandoned call."""
    from polar.app.stack import node_spec, running
    from polar.config import GatewayConfig, InferenceConfig

    async with running_rollout(SCRIPT, node=None, heartbeat_interval_s=0.2, node_timeout_s=2.0) as rollout:
        config = dataclasses.replace(TEST_NODE, rollout_address=rollout.address)
        gateway = GatewayConfig(port=rollout.http_port, grpc_port=0, inference_address=rollout.inference_address)
        spec = node_spec(config, gateway, InferenceConfig(), base_url=rollout.base_url)
        # Started from a thread: the inference server it needs runs on this test's event loop.
        starting = running(spec, 120, 10, http_socket=rollout.http_socket)
        doomed = await asyncio.to_thread(starting.__enter__)
        try:
            [task_id] = await rollout.submit(_slow_task())
            session_id = f"{task_id}.0"
            async with asyncio.timeout(60):
                while (status := await rollout.session_status(session_id)).call_count < 1:
                    await asyncio.sleep(0.05)
            first_node = status.node_id
            assert _harness_running("slow")
            os.kill(doomed.process.pid, signal.SIGKILL)
            await asyncio.to_thread(doomed.process.wait)
        finally:
            await asyncio.to_thread(starting.__exit__, None, None, None)
        async with asyncio.timeout(10):
            while _harness_running("slow"):
                await asyncio.sleep(0.05)
        await rollout.start_node()
        [[trajectory]] = await rollout.groups(1)
        status = await rollout.session_status(session_id)
    assert trajectory.outcome == OUTCOME.SESSION_OUTCOME_COMPLETED, trajectory.error
    assert trajectory.attempt == 2 and status.attempts == 2
    assert status.node_id != first_node
    assert len(trajectory.calls) == 2 and trajectory.reward == 1.0
    assert_faithful(trajectory)
    # The call the dead node recorded (and delivered in a heartbeat) is kept, apart from the traces.
    [abandoned] = trajectory.abandoned_calls
    assert abandoned.call_id == "c0001" and len(abandoned.sampled_token_ids) > 0
