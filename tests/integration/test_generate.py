"""`polar generate` and `polar export` on a real rollout stack (polar/testing/rollout.py: rollout server,
node, Envoy, gateway) with a scripted model, and the example agent (examples/agent/agent.py) as the
harness: it calls the gateway over Chat Completions with two tools and carries out the tool calls.

The evaluator passes even attempts and fails odd ones (it reads the attempt number from the task id
the generation gives each attempt), so counts, rate and caps are known in advance. Beside the task
that can pass: one that times out, one whose runtime fails, and one whose reply holds a tool call
that fails to parse; their evaluators pass, and none of them may be accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path

import pytest

from polar.app.generate import export
from polar.app.generate.run import GenerateOptions, export_released, generate
from polar.config import StackConfig
from polar.testing.rollout import TEST_NODE, running_rollout
from polar.v1 import common_pb2
from tests.helpers.stack_config import write_stack_config

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
AGENT = str(REPO / "examples" / "agent")
WRITE = '<tool_call>{"name": "write_file", "arguments": {"path": "hello.txt", "content": "hello"}}</tool_call>'
SCRIPT = {
    "tokenizer": "smollm2-135m",
    "rules": [
        {"prompt_regex": "BROKEN", "text": '<tool_call>{"name": "write_file", "arguments": </tool_call>'},
        {"prompt_regex": "wrote hello.txt", "text": "Done."},
        {"prompt_regex": "hello", "text": WRITE},
    ],
}
# Passes (reward 1) when the agent wrote the file and the attempt number (the task id's last field) is even.
EVEN_AND_WRITTEN = 'test "$(cat hello.txt)" = hello && test "$(expr "${POLAR_TASK_ID##*-}" % 2)" = 0'
NODE = dataclasses.replace(TEST_NODE, harness_isolation="none", template_roots=str(REPO), running_slots=4)


def _task(instruction: str, **fields) -> dict:
    task = {
        "instruction": instruction,
        "groupSize": 1,
        "harness": {"preset": "command", "command": ["python3", "agent.py"]},
        "runtime": {"kind": "local", "template": AGENT},
        "evaluator": {"kind": "command", "command": "true"},
        "timeoutSeconds": 60,
        "metadata": {"set": "generate-test"},
    }
    return {**task, **fields}


TASKS = [
    _task("Write hello to hello.txt.", taskId="writes", evaluator={"kind": "command", "command": EVEN_AND_WRITTEN}),
    _task("Wait.", taskId="slow", harness={"preset": "command", "command": ["sleep", "30"]}, timeoutSeconds=1),
    _task("Write hello.", taskId="broken-runtime", runtime={"kind": "local", "template": AGENT, "prepare": ["exit 3"]}),
    _task("BROKEN: write hello.", taskId="unparsed"),
]


def _write_tasks(path: Path, tasks: list[dict]) -> str:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return str(path)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _generate(options: GenerateOptions) -> tuple[int, str]:
    out = io.StringIO()
    code = await asyncio.to_thread(generate, StackConfig(), options, out)
    return code, out.getvalue()


async def test_generation_counts_caps_resumes_and_exports(tmp_path: Path):
    tasks_file = _write_tasks(tmp_path / "tasks.jsonl", TASKS)
    out = tmp_path / "run"
    async with running_rollout(SCRIPT, node=NODE) as rollout:
        options = GenerateOptions(tasks_file, out, attempts=2, accept=1.0, rollout=rollout.address, concurrency=4)
        code, printed = await _generate(options)
        assert code == 0, printed
        first = _lines(out / "attempts.jsonl")
        assert len(first) == 8
        # Resumed with more attempts: the first two of each task are not run again.
        code, printed = await _generate(dataclasses.replace(options, attempts=4))
        assert code == 0, printed
        attempts = _lines(out / "attempts.jsonl")
        assert attempts[:8] == first
        assert sorted((a["task_id"], a["attempt"]) for a in attempts) == sorted(
            (t["taskId"], n) for t in TASKS for n in range(4)
        )
        by_task = {t["taskId"]: [a for a in attempts if a["task_id"] == t["taskId"]] for t in TASKS}
        assert {a["outcome"] for a in by_task["slow"]} == {"timed_out"}
        assert {a["outcome"] for a in by_task["broken-runtime"]} == {"failed"}
        assert all(a["reward"] == 1.0 and "failed to parse" in a["why_not"] for a in by_task["unparsed"])
        assert [a["accepted"] for a in sorted(by_task["writes"], key=lambda a: a["attempt"])] == [
            True,
            False,
            True,
            False,
        ]
        assert sum(a["accepted"] for a in attempts) == 2

        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["counts"]["attempts"] == 16 and manifest["counts"]["accepted"] == 2
        assert manifest["acceptance_rate"] == pytest.approx(2 / 16)
        assert manifest["counts"]["outcomes"] == {"completed": 8, "timed_out": 4, "failed": 4}
        assert manifest["harnesses"][0]["command"] == ["python3", "agent.py"] and manifest["seconds_per_attempt"] > 0
        assert "2 accepted (12.5%)" in printed

        rows = _lines(out / "accepted.jsonl")
        assert sorted((r["task_id"], r["attempt"]) for r in rows) == [("writes", 0), ("writes", 2)]
        groups = await rollout.groups(16)
        trajectories = {t.session_id: t for group in groups for t in group}
        for row in rows:
            _check_row(row, trajectories[row["session_id"]])

        # A cap of one accepted attempt per task: the passing task stops after its first attempt.
        capped = tmp_path / "capped"
        code, printed = await _generate(
            GenerateOptions(
                _write_tasks(tmp_path / "one.jsonl", TASKS[:1]),
                capped,
                attempts=4,
                accept=1.0,
                max_per_task=1,
                rollout=rollout.address,
            )
        )
        assert code == 0, printed
        assert [(a["attempt"], a["accepted"]) for a in _lines(capped / "attempts.jsonl")] == [(0, True)]

        # `polar export` of everything released: the rows of the completed, passing, well-parsed sessions.
        exported = tmp_path / "released.jsonl"
        read, written, cursor = await asyncio.to_thread(
            export_released, rollout.address, exported, min_reward=1.0, fmt="jsonl"
        )
        assert read == 17 and cursor
        assert sorted(r["session_id"] for r in _lines(exported)) == sorted(
            [r["session_id"] for r in rows] + [a["session_id"] for a in _lines(capped / "attempts.jsonl")]
        )
        assert written == 3
        _check_loadable(out / "accepted.jsonl", rows, tmp_path)


def _check_loadable(jsonl: Path, rows: list[dict], tmp_path: Path) -> None:
    """The rows load as a Hugging Face dataset from the JSON Lines file, from Parquet and from a
    datasets folder, unchanged (a key a message lacks reads back as None)."""
    datasets = pytest.importorskip("datasets")

    def same(loaded) -> None:
        assert loaded["input_ids"] == [r["input_ids"] for r in rows] and loaded["loss_mask"] == [
            r["loss_mask"] for r in rows
        ]
        messages = [[{k: v for k, v in m.items() if v is not None} for m in row] for row in loaded["messages"]]
        assert messages == [r["messages"] for r in rows]

    cache = str(tmp_path / "hf-cache")
    same(datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=cache))
    parquet = export.convert(jsonl, "parquet", tmp_path / "accepted.parquet")
    same(datasets.load_dataset("parquet", data_files=str(parquet), split="train", cache_dir=cache))
    same(datasets.load_from_disk(str(export.convert(jsonl, "datasets", tmp_path / "accepted"))))


def _check_row(row: dict, trajectory: common_pb2.Trajectory) -> None:
    """The row's token view is the trace's, its mask marks exactly what the engine sampled, and its
    messages are the last call's request body followed by that call's reply."""
    [trace] = [t for t in trajectory.traces if t.trace_id == row["trace_id"]]
    assert row["input_ids"] == list(trace.token_ids)
    assert row["loss_mask"] == list(trace.loss_mask) and len(row["logprobs"]) == len(row["input_ids"])
    calls = {c.call_id: c for c in trajectory.calls}
    sampled_calls = [calls[s.call_id] for s in trace.segments if s.kind == common_pb2.TraceSegment.KIND_SAMPLED]
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert masked == [t for c in sampled_calls for t in c.sampled_token_ids]
    masked_logprobs = [lp for lp, m in zip(row["logprobs"], row["loss_mask"]) if m]
    assert masked_logprobs == pytest.approx([lp for c in sampled_calls for lp in c.sampled_logprobs], abs=1e-6)
    assert [lp for lp, m in zip(row["logprobs"], row["loss_mask"]) if not m] == [0.0] * row["loss_mask"].count(0)

    last = sampled_calls[-1]
    body = json.loads(last.request_body)
    sent = body["messages"]
    assert len(row["messages"]) == len(sent) + 1
    for exported, original in zip(row["messages"], sent):
        assert exported["role"] == original["role"] and exported["content"] == (original.get("content") or "")
        calls_sent = original.get("tool_calls") or []
        assert [json.loads(c["function"]["arguments"]) for c in exported.get("tool_calls", [])] == [
            json.loads(c["function"]["arguments"]) for c in calls_sent
        ]
    assert row["messages"][-1] == {"role": "assistant", "content": "Done."}
    assert json.loads(row["tools"]) == body["tools"]
    assert row["messages"][1]["tool_calls"][0]["function"]["name"] == "write_file"


@pytest.mark.timeout(600)
def test_the_command_starts_the_stack_and_a_rerun_repeats_nothing(tmp_path: Path):
    """`polar generate --config` on the stack `polar up` would start (scripted model), with the
    progress lines a pipe gets, Parquet output, and a rerun that finds every attempt done (and so
    starts no stack)."""
    from tests.helpers.polar_command import run

    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = write_stack_config(
        tmp_path / "stack.toml",
        rollout={"heartbeat_interval_s": 0.2},
        inference={"engine": "scripted", "script": script},
        envoy={"workers": 1},
        node={
            "init_workers": 1,
            "ready_slots": 1,
            "running_slots": 2,
            "postrun_workers": 1,
            "harness_isolation": "none",
            "template_roots": REPO,
        },
    )
    tasks = _write_tasks(tmp_path / "tasks.jsonl", TASKS[:1])
    out = tmp_path / "run"
    argv = (
        "generate",
        tasks,
        "--config",
        str(config),
        "--attempts",
        "3",
        "--accept",
        "1",
        "--out",
        str(out),
        "--format",
        "parquet",
    )
    first = run(*argv, timeout=300)
    assert first.returncode == 0, first.stderr
    progress = [line for line in first.stdout.splitlines() if line.startswith("generate [")]
    assert progress[-1].startswith("generate [##############################] 3/3 attempts, 2 accepted (66.7%)")
    assert (out / "accepted.parquet").is_file() and (out / "rollout.db").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["engine"] == "scripted" and manifest["stack_config"]["inference"]["script"] == str(script)

    again = run(*argv, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "3 attempts, 2 accepted (66.7%)" in again.stdout.splitlines()[-1]
    assert "polar up:" not in again.stdout
    assert sorted((a["attempt"], a["accepted"]) for a in _lines(out / "attempts.jsonl")) == [
        (0, True),
        (1, False),
        (2, True),
    ]

    other = run("generate", tasks, "--config", str(config), "--attempts", "3", "--accept", "0.5", "--out", str(out))
    assert other.returncode == 1 and other.stderr.startswith("polar: error: ") and "accept 1.0 -> 0.5" in other.stderr
