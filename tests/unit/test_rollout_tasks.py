"""polar.rollout.tasks: defaults, each validation rule naming its field, and task files (JSON Lines)."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from polar.rollout.tasks import (
    HARNESS_PRESETS,
    TaskFileError,
    normalize_task,
    parse_task_lines,
    validate_task,
)
from polar.v1 import rollout_pb2


def good_task(**fields) -> rollout_pb2.Task:
    task = rollout_pb2.Task(
        task_id="fix-bug.1", instruction="Fix the bug.", group_size=4, harness=rollout_pb2.HarnessSpec(preset="codex")
    )
    json_format.ParseDict(fields, task)
    return task


def problems_of(**fields) -> list[str]:
    return validate_task(normalize_task(good_task(**fields)))


def test_normalize_fills_the_documented_defaults_and_leaves_the_input_alone():
    task = rollout_pb2.Task(instruction="x", group_size=1, evaluator=rollout_pb2.EvaluatorSpec(kind="command"))
    normalized = normalize_task(task)
    assert len(normalized.task_id) == 32 and int(normalized.task_id, 16) >= 0
    assert normalized.builder == "prefix_merging"
    assert normalized.timeout_seconds == 1800
    assert normalized.runtime.kind == "local"
    assert normalized.evaluator.timeout_seconds == 300
    assert task.task_id == "" and task.builder == "" and task.runtime.kind == ""


def test_normalize_keeps_given_values_and_adds_no_evaluator():
    task = good_task(builder="per_request", timeoutSeconds=5, runtime={"kind": "docker", "image": "img"})
    normalized = normalize_task(task)
    assert normalized == good_task(builder="per_request", timeoutSeconds=5, runtime={"kind": "docker", "image": "img"})
    assert not normalized.HasField("evaluator")
    assert normalize_task(rollout_pb2.Task()).task_id != normalize_task(rollout_pb2.Task()).task_id


def test_a_good_task_has_no_problems():
    assert problems_of() == []
    assert problems_of(harness={"preset": "command", "command": ["python", "-V"]}, instruction="") == []
    assert problems_of(evaluator={"kind": "python", "callable": "pkg.mod:score"}) == []
    assert (
        problems_of(evaluator={"kind": "command", "command": "pytest -q"}, runtime={"kind": "docker", "image": "i"})
        == []
    )


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"taskId": "has space"}, "task_id: 'has space' is not 1 to 128 letters"),
        ({"taskId": "../escape"}, "task_id: '../escape' is not"),
        ({"taskId": "a/b"}, "task_id: 'a/b' is not"),
        ({"taskId": "x" * 129}, "task_id: 'xxxx"),
        ({"groupSize": 0}, "group_size: must be between 1 and 4096, got 0"),
        ({"groupSize": -3}, "group_size: must be between 1 and 4096, got -3"),
        ({"groupSize": 4097}, "group_size: must be between 1 and 4096, got 4097"),
        ({"harness": {"preset": ""}}, "harness.preset: required (known: codex, claude-code"),
        ({"harness": {"preset": "x"}}, "harness.preset: unknown preset 'x' (known: codex, claude-code"),
        ({"harness": {"preset": "command"}}, "harness.command: required for preset 'command'"),
        ({"harness": {"preset": "command", "command": ["", "x"]}}, "harness.command: the program"),
        ({"harness": {"preset": "qwen-code", "command": ["ls"]}}, "harness.command: only preset 'command'"),
        ({"harness": {"preset": "codex", "env": {"A=B": "1"}}}, "harness.env: 'A=B' is not an environment"),
        (
            {"harness": {"preset": "codex", "dialect": "DIALECT_OPENAI_CHAT"}},
            "harness.dialect: preset 'codex' cannot speak DIALECT_OPENAI_CHAT (it speaks DIALECT_OPENAI_RESPONSES)",
        ),
        (
            {"harness": {"preset": "command", "command": ["ls"], "dialect": "DIALECT_OPENAI_CHAT"}},
            "harness.dialect: preset 'command' takes none",
        ),
        ({"sampling": {"topK": -1}}, "sampling.top_k: must be >= 0 (0: no truncation), got -1"),
        ({"harness": {"preset": "codex", "env": {"A": "x\u0000"}}}, "harness.env['A']: contains a NUL"),
        ({"instruction": "  "}, "instruction: required (empty)"),
        ({"runtime": {"kind": "vm"}}, "runtime.kind: unknown runtime 'vm' (known: local, docker)"),
        ({"runtime": {"kind": "docker"}}, "runtime.image: required for runtime 'docker'"),
        (
            {"evaluator": {"kind": "llm"}},
            "evaluator.kind: unknown evaluator 'llm' (known: '', 'command', 'python', 'swe', 'harbor', 'gym')",
        ),
        (
            {"runtime": {"kind": "docker", "image": "x"}, "evaluator": {"kind": "harbor"}},
            "evaluator.harbor.image: required",
        ),
        (
            {"evaluator": {"kind": "harbor", "harbor": {"image": "x-tests"}}},
            "evaluator.harbor: a Harbor task runs in runtime 'docker'",
        ),
        ({"evaluator": {"kind": "command"}}, "evaluator.command: required for evaluator 'command'"),
        ({"evaluator": {"kind": "gym"}}, "evaluator.gym.url: '' is not an http(s) URL"),
        (
            {"evaluator": {"kind": "gym", "gym": {"url": "http://h:1", "rowJson": "[1]"}}},
            "evaluator.gym.row_json: must be a JSON object",
        ),
        (
            {"evaluator": {"kind": "gym", "gym": {"url": "http://h:1", "rowJson": "{oops"}}},
            "evaluator.gym.row_json: must be a JSON object",
        ),
        (
            {"evaluator": {"kind": "python", "callable": "score"}},
            "evaluator.callable: 'score' is not 'module:function'",
        ),
        ({"evaluator": {"timeoutSeconds": -1}}, "evaluator.timeout_seconds: must be a finite number of seconds >= 0"),
        ({"builder": "magic"}, "builder: unknown builder 'magic' (known: per_request, prefix_merging)"),
        ({"timeoutSeconds": -0.5}, "timeout_seconds: must be a finite number of seconds >= 0, got -0.5"),
        ({"timeoutSeconds": "NaN"}, "timeout_seconds: must be a finite number of seconds >= 0, got nan"),
        ({"timeoutSeconds": "Infinity"}, "timeout_seconds: must be a finite number of seconds >= 0, got inf"),
        ({"sampling": {"temperature": -1}}, "sampling.temperature: must be a finite number >= 0, got -1.0"),
        ({"sampling": {"temperature": "NaN"}}, "sampling.temperature: must be a finite number >= 0, got nan"),
        ({"sampling": {"temperature": "Infinity"}}, "sampling.temperature: must be a finite number >= 0, got inf"),
        ({"sampling": {"topP": 0}}, "sampling.top_p: must be in (0, 1], got 0.0"),
        ({"sampling": {"topP": 1.5}}, "sampling.top_p: must be in (0, 1], got 1.5"),
        ({"sampling": {"maxTokensPerCall": -1}}, "sampling.max_tokens_per_call: must be >= 0 (0: no cap), got -1"),
        (
            {"sampling": {"maxTokensPerSession": "-5"}},
            "sampling.max_tokens_per_session: must be >= 0 (0: no budget), got -5",
        ),
    ],
)
def test_each_bad_field_is_named(fields, problem):
    problems = problems_of(**fields)
    assert len(problems) == 1, problems
    assert problems[0].startswith(problem), problems


def test_a_task_s_sampling_policy_is_valid_at_its_bounds_and_read_from_a_task_file():
    assert problems_of(sampling={}) == []
    assert problems_of(sampling={"temperature": 0, "topP": 1, "maxTokensPerCall": 0, "maxTokensPerSession": "0"}) == []
    sampling = {"temperature": 0.6, "topP": 0.95, "maxTokensPerCall": 4096, "maxTokensPerSession": "65536"}
    assert problems_of(sampling=sampling) == []
    line = json.dumps({"instruction": "x", "groupSize": 2, "harness": {"preset": "codex"}, "sampling": sampling})
    [task] = parse_task_lines(line, "tasks.jsonl")
    assert task.sampling.max_tokens_per_call == 4096 and task.sampling.max_tokens_per_session == 65536
    assert task.sampling.HasField("temperature") and task.sampling.temperature == pytest.approx(0.6)
    bad = json.dumps({"instruction": "x", "groupSize": 2, "harness": {"preset": "codex"}, "sampling": {"topP": 2}})
    with pytest.raises(TaskFileError, match=r"tasks.jsonl:1: sampling.top_p: must be in \(0, 1\], got 2.0"):
        parse_task_lines(bad, "tasks.jsonl")


def test_every_problem_of_a_task_is_listed():
    task = rollout_pb2.Task(task_id="ok", group_size=0, harness=rollout_pb2.HarnessSpec(preset="nope"))
    problems = validate_task(normalize_task(task))
    assert [p.split(":")[0] for p in problems] == ["group_size", "harness.preset", "instruction"]


def test_parse_task_lines_reads_jsonl_skipping_blanks_and_comments():
    text = "\n".join(
        [
            "# two tasks",
            json.dumps({"taskId": "a", "instruction": "do a", "groupSize": 2, "harness": {"preset": "pi"}}),
            "",
            "   ",
            json.dumps({"instruction": "do b", "group_size": 1, "harness": {"preset": "codex"}, "priority": 5}),
        ]
    )
    tasks = parse_task_lines(text, "tasks.jsonl")
    assert [t.task_id for t in tasks] == ["a", ""]
    assert tasks[1].priority == 5 and tasks[1].group_size == 1
    assert tasks[0].harness.preset == "pi"


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "tasks.jsonl:2: Expecting property name"),
        ("[1, 2]", "tasks.jsonl:2: expected a JSON object (one Task), got an array"),
        ("null", "tasks.jsonl:2: expected a JSON object (one Task), got null"),
        (
            '{"groupSize": 1, "instruktion": "x"}',
            'tasks.jsonl:2: Message type "polar.v1.Task" has no field named "instruktion"',
        ),
        ('{"groupSize": "many"}', "tasks.jsonl:2: Failed to parse groupSize field"),
        (
            '{"groupSize": 0, "instruction": "x", "harness": {"preset": "pi"}}',
            "tasks.jsonl:2: group_size: must be between 1 and 4096",
        ),
        (
            '{"taskId": "a", "groupSize": 1, "instruction": "x", "harness": {"preset": "pi"}}',
            "tasks.jsonl:2: task_id: 'a' repeats line 1",
        ),
    ],
)
def test_a_bad_line_fails_the_whole_file_naming_source_and_line(line, problem):
    first, last = (
        json.dumps({"taskId": task_id, "instruction": "x", "groupSize": 1, "harness": {"preset": "pi"}})
        for task_id in ("a", "c")
    )
    with pytest.raises(TaskFileError) as raised:
        parse_task_lines(f"{first}\n{line}\n{last}", "tasks.jsonl")
    assert str(raised.value).startswith(problem), str(raised.value)


def test_every_bad_line_is_reported_up_to_a_cap():
    bad = '{"groupSize": 0, "instruction": "x", "harness": {"preset": "pi"}}'
    with pytest.raises(TaskFileError) as raised:
        parse_task_lines("\n".join([bad] * 25), "big.jsonl")
    lines = str(raised.value).splitlines()
    assert lines[0].startswith("big.jsonl:1: group_size") and lines[19].startswith("big.jsonl:20: group_size")
    assert lines[20] == "… and 5 more problems"


task_messages = st.builds(
    rollout_pb2.Task,
    task_id=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
    instruction=st.text(min_size=1).filter(str.strip),
    group_size=st.integers(1, 64),
    harness=st.builds(
        rollout_pb2.HarnessSpec,
        preset=st.sampled_from([p for p in HARNESS_PRESETS if p != "command"]),
        env=st.dictionaries(
            st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True),
            st.text().filter(lambda v: "\0" not in v),
            max_size=3,
        ),
    ),
    timeout_seconds=st.floats(0, 1e6),
    priority=st.integers(-(2**31), 2**31 - 1),
    metadata=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
)


@given(st.lists(task_messages, max_size=8, unique_by=lambda t: t.task_id), st.sampled_from(["\n", "\r\n"]))
def test_task_files_round_trip(tasks, newline):
    text = newline.join(json.dumps(json_format.MessageToDict(task)) for task in tasks)
    assert parse_task_lines(text, "t.jsonl") == tasks
