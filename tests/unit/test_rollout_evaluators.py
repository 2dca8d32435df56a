"""Evaluators in a real local runtime: command evaluators (reward file, last line, exit code, crashes,
timeouts), Python evaluators (success, exceptions, non-numbers, timeouts) and NeMo Gym resources servers
(the reward /verify gives the final reply, and servers that give none). None of them raises."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.app.node.evaluators import Evaluation, evaluate
from polar.app.node.runtimes import LocalProvider
from polar.v1 import common_pb2, rollout_pb2

pytestmark = pytest.mark.anyio

TASK = rollout_pb2.Task(task_id="task-7", instruction="make the tests pass")


@pytest.fixture
async def runtime(tmp_path):
    runtime = await LocalProvider(tmp_path / "sessions").create(rollout_pb2.RuntimeSpec(kind="local"), name="s")
    yield runtime
    await runtime.close()


async def run_command(runtime, command: str, timeout_s: float = 0) -> Evaluation:
    spec = rollout_pb2.EvaluatorSpec(kind="command", command=command, timeout_seconds=timeout_s)
    return await evaluate(spec, runtime=runtime, task=TASK, session_id="task-7.0")


async def test_no_evaluator_means_reward_zero(runtime):
    evaluation = await evaluate(rollout_pb2.EvaluatorSpec(), runtime=runtime, task=TASK, session_id="s")
    assert evaluation == Evaluation(0.0, "", "")


async def test_an_unknown_kind_is_an_error_not_an_exception(runtime):
    evaluation = await evaluate(rollout_pb2.EvaluatorSpec(kind="llm-judge"), runtime=runtime, task=TASK, session_id="s")
    assert evaluation.reward == 0.0 and "unknown evaluator kind 'llm-judge'" in evaluation.error


# ------------------------------------------------------------------------------------- command


@pytest.mark.parametrize(("command", "reward"), [("exit 0", 1.0), ("echo checking; exit 1", 0.0), ("exit 7", 0.0)])
async def test_without_a_number_the_exit_code_decides(runtime, command, reward):
    evaluation = await run_command(runtime, command)
    assert (evaluation.reward, evaluation.error) == (reward, "")


async def test_a_number_printed_last_is_the_reward_whatever_the_exit_code(runtime):
    evaluation = await run_command(runtime, "echo '3 of 4 tests passed'; echo 0.75; exit 1")
    assert (evaluation.reward, evaluation.error) == (0.75, "")
    assert evaluation.output == "3 of 4 tests passed\n0.75\n"


async def test_a_number_that_is_not_last_does_not_count(runtime):
    evaluation = await run_command(runtime, "echo 0.75; echo done")
    assert evaluation.reward == 1.0


@pytest.mark.parametrize("last_line", ["nan", "inf", "-inf", "0.5 points"])
async def test_a_last_line_that_is_not_a_finite_number_falls_back_to_the_exit_code(runtime, last_line):
    evaluation = await run_command(runtime, f"echo '{last_line}'; exit 1")
    assert (evaluation.reward, evaluation.error) == (0.0, "")


async def test_the_reward_file_wins_over_output_and_exit_code(runtime):
    evaluation = await run_command(runtime, 'echo " 0.25 " > "$POLAR_REWARD_FILE"; echo 0.9; exit 3')
    assert (evaluation.reward, evaluation.error) == (0.25, "")


async def test_a_reward_file_that_holds_no_number_is_an_error(runtime):
    evaluation = await run_command(runtime, 'echo "all good" > "$POLAR_REWARD_FILE"; echo 1')
    assert evaluation.reward == 0.0
    assert evaluation.error == "the reward file holds 'all good', not a finite number"


async def test_a_reward_file_from_an_earlier_run_is_not_read_again(runtime):
    assert (await run_command(runtime, 'echo 0.5 > "$POLAR_REWARD_FILE"')).reward == 0.5
    assert (await run_command(runtime, "exit 1")).reward == 0.0


async def test_the_command_runs_in_the_workspace_and_knows_the_session(runtime):
    (runtime.workspace / "answer.txt").write_text("42\n")
    command = 'pwd; echo "$POLAR_TASK_ID|$POLAR_SESSION_ID|$POLAR_INSTRUCTION|$POLAR_WORKSPACE|$HOME"; cat answer.txt'
    evaluation = await run_command(runtime, command)
    lines = evaluation.output.splitlines()
    assert lines[0] == str(runtime.workspace)
    assert lines[1] == f"task-7|task-7.0|make the tests pass|{runtime.workspace}|{runtime.home}"
    assert evaluation.reward == 42.0


async def test_a_crashing_command_gives_zero_and_says_how_it_died(runtime):
    evaluation = await run_command(runtime, 'echo 1 > "$POLAR_REWARD_FILE"; echo partial; ulimit -c 0; kill -SEGV $$')
    assert evaluation.reward == 0.0
    assert evaluation.error == "killed by signal SIGSEGV"
    assert evaluation.output == "partial\n"


async def test_a_command_past_its_timeout_gives_zero_and_says_so(runtime):
    started = time.monotonic()
    # 2 s: the shell must have printed before the timeout, and under CI's load it had not after 0.3 s.
    evaluation = await run_command(runtime, "echo 1; sleep 60", timeout_s=2)
    assert evaluation.reward == 0.0
    assert evaluation.error == "timed out after 2 s"
    assert evaluation.output == "1\n"
    assert time.monotonic() - started < 7


async def test_a_runtime_whose_folder_is_gone_gives_an_error(runtime):
    await runtime.close()
    evaluation = await run_command(runtime, "exit 0")
    assert evaluation.reward == 0.0 and evaluation.error.startswith("could not start: ")


# One runtime for all examples: each evaluation starts afresh in it.
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reward=st.floats(allow_nan=False, allow_infinity=False))
async def test_any_finite_number_printed_last_comes_back_exactly(runtime, reward):
    evaluation = await run_command(runtime, f"echo '{reward!r}'")
    assert evaluation.reward == reward


# -------------------------------------------------------------------------------------- python


@pytest.fixture
def evaluator_module(tmp_path, monkeypatch):
    """A module `task_scoring` on sys.path with one evaluator per behaviour."""
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "task_scoring.py").write_text(
        textwrap.dedent(
            """
            import time

            def fraction_done(workspace, task):
                done = (workspace / "done.txt").read_text().split()
                return len(done) / 4 if task.task_id == "task-7" else -1.0

            def broken(workspace, task):
                raise ValueError("no tests were collected")

            def verdict(workspace, task):
                return "pass"

            def not_a_number(workspace, task):
                return float("nan")

            def passed(workspace, task):
                return True

            def slow(workspace, task):
                time.sleep(5)
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    yield "task_scoring"
    sys.modules.pop("task_scoring", None)


async def run_python(runtime, target: str, timeout_s: float = 0) -> Evaluation:
    spec = rollout_pb2.EvaluatorSpec(kind="python", callable=target, timeout_seconds=timeout_s)
    return await evaluate(spec, runtime=runtime, task=TASK, session_id="task-7.0")


async def test_a_python_evaluator_gets_the_workspace_and_task_and_returns_the_reward(runtime, evaluator_module):
    (runtime.workspace / "done.txt").write_text("a b c\n")
    assert await run_python(runtime, f"{evaluator_module}:fraction_done") == Evaluation(0.75, "", "")


async def test_a_bool_counts_as_a_number(runtime, evaluator_module):
    assert (await run_python(runtime, f"{evaluator_module}:passed")).reward == 1.0


async def test_a_python_evaluator_that_raises_gives_zero_and_the_exception(runtime, evaluator_module):
    evaluation = await run_python(runtime, f"{evaluator_module}:broken")
    assert evaluation.reward == 0.0
    assert evaluation.error == "task_scoring:broken raised ValueError: no tests were collected"


@pytest.mark.parametrize(("function", "shown"), [("verdict", "'pass' (str)"), ("not_a_number", "nan (float)")])
async def test_a_python_evaluator_that_returns_no_finite_number_gives_zero(runtime, evaluator_module, function, shown):
    evaluation = await run_python(runtime, f"{evaluator_module}:{function}")
    assert evaluation.reward == 0.0
    assert evaluation.error == f"task_scoring:{function} returned {shown}, not a finite number"


async def test_a_python_evaluator_past_its_timeout_gives_zero_at_the_timeout(runtime, evaluator_module):
    started = time.monotonic()
    evaluation = await run_python(runtime, f"{evaluator_module}:slow", timeout_s=0.3)
    assert time.monotonic() - started < 2
    assert evaluation.reward == 0.0
    assert evaluation.error == "task_scoring:slow timed out after 0.3 s (its thread is left running)"


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ("no_colon", "callable 'no_colon' is not of the form 'module:function'"),
        ("no_such_module:f", "no_such_module:f raised ModuleNotFoundError: No module named 'no_such_module'"),
        ("math:no_such_function", "math:no_such_function raised AttributeError: module 'math' has no attribute"),
    ],
)
async def test_a_python_evaluator_that_cannot_be_found_gives_zero(runtime, target, error):
    evaluation = await run_python(runtime, target)
    assert evaluation.reward == 0.0 and evaluation.error.startswith(error)


# ------------------------------------------------------------------------------------------ gym


def answered(text: str) -> common_pb2.CallRecord:
    body = {"choices": [{"message": {"role": "assistant", "content": text}}]}
    return common_pb2.CallRecord(
        call_id="c0001", dialect=common_pb2.DIALECT_OPENAI_CHAT, model="m", response_body=json.dumps(body).encode()
    )


@pytest.fixture
async def resources_server():
    """A stand-in NeMo Gym resources server (the real ones run in the nemo_gym tier): /seed_session
    sets a session cookie, /verify requires it and gives reward 1 when the last message of the
    response is the row's expected answer; it keeps what it was sent."""
    seen: list[dict] = []

    async def seed_session(request: web.Request) -> web.Response:
        seen.append(await request.json())
        response = web.json_response({})
        response.set_cookie("session", "s1")
        return response

    async def verify(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if request.cookies.get("session") != "s1":
            return web.json_response({"detail": "no session"}, status=400)
        if body.get("expected_answer") == "inf":
            return web.Response(text='{"reward": Infinity}', content_type="application/json")
        text = body["response"]["output"][-1]["content"][0]["text"]
        return web.json_response({**body, "reward": float(text == body["expected_answer"])})

    app = web.Application()
    app.router.add_post("/seed_session", seed_session)
    app.router.add_post("/verify", verify)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen
    await runner.cleanup()


async def run_gym(runtime, url: str, row: dict, calls: list[common_pb2.CallRecord]) -> Evaluation:
    spec = rollout_pb2.EvaluatorSpec(kind="gym", gym=rollout_pb2.GymVerifier(url=url, row_json=json.dumps(row)))
    return await evaluate(spec, runtime=runtime, task=TASK, session_id="task-7.0", calls=calls)


@pytest.mark.parametrize(("expected", "reward"), [("Paris", 1.0), ("Lyon", 0.0)])
async def test_a_gym_resources_server_grades_the_final_reply(runtime, resources_server, expected, reward):
    url, seen = resources_server
    evaluation = await run_gym(runtime, url, {"expected_answer": expected}, [answered("Thinking."), answered("Paris")])
    assert (evaluation.reward, evaluation.error) == (reward, "")
    seeded, verified = seen
    assert seeded["responses_create_params"]["input"] == [{"role": "user", "content": TASK.instruction}]
    assert seeded["expected_answer"] == expected and "response" not in seeded
    assert verified["response"]["id"] == "resp_task-7.0"


@pytest.mark.parametrize(
    ("row", "url_of", "error"),
    [
        ({"expected_answer": "inf"}, None, "/verify answered no finite reward"),
        ({}, None, "/verify answered HTTP 500"),
        ({"expected_answer": "Paris"}, "http://127.0.0.1:9", "NeMo Gym resources server http://127.0.0.1:9: "),
    ],
)
async def test_a_gym_server_that_gives_no_reward_gives_zero_and_says_why(runtime, resources_server, row, url_of, error):
    url, _ = resources_server
    evaluation = await run_gym(runtime, url_of or url, row, [answered("Paris")])
    assert evaluation.reward == 0.0 and error in evaluation.error
