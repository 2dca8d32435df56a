"""Tasks as submitted: their defaults, their validation, and task files (JSON Lines).

`normalize_task` fills the defaults the contract documents (rollout.proto, Task); `validate_task`
lists what is wrong with a normalized task, each problem naming its field ("harness.preset: …"), so
the server can refuse a whole submission with every reason at once. A task file holds one Task per
line in the protobuf JSON mapping; `parse_task_lines` reads all of it or raises `TaskFileError`
naming each bad line.
"""

from __future__ import annotations

import json
import math
import re
import uuid

from google.protobuf import json_format

from polar.rollout.harness import PRESETS
from polar.rollout.templates import template_problem
from polar.sampling_policy import policy_problems
from polar.trajectory import BUILDERS
from polar.v1 import common_pb2, rollout_pb2

HARNESS_PRESETS = ("codex", "claude-code", "qwen-code", "gemini-cli", "pi", "command")
RUNTIME_KINDS = ("local", "docker")
EVALUATOR_KINDS = ("", "command", "python", "swe", "harbor", "gym")  # "": no evaluator, every reward is 0
# A GRPO group is a handful to a few hundred sessions; a typo's billion would be one endless transaction.
MAX_GROUP_SIZE = 4096

DEFAULT_BUILDER = "prefix_merging"
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_EVALUATOR_TIMEOUT_S = 300.0

# Session ids are f"{task_id}.{index}" and name folders and containers on the nodes, so a task id
# stays a plain token: no separators, no spaces, nothing a path or a shell would read specially.
TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# An environment variable's name: anything but "=" and NUL (POSIX), and not empty.
ENV_NAME = re.compile(r"[^=\0]+")
# "package.module:function.attribute"
PYTHON_CALLABLE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
# Problems listed in a TaskFileError before the rest are only counted.
MAX_LISTED_PROBLEMS = 20


class TaskFileError(ValueError):
    """A task file with at least one bad line; the message names each as source:LINE."""


def normalize_task(task: rollout_pb2.Task) -> rollout_pb2.Task:
    """A copy of `task` with the documented defaults filled in: a fresh task id, the builder, the
    harness timeout, the runtime kind, and the evaluator timeout (when there is an evaluator)."""
    normalized = rollout_pb2.Task()
    normalized.CopyFrom(task)
    if not normalized.task_id:
        normalized.task_id = uuid.uuid4().hex
    if not normalized.builder:
        normalized.builder = DEFAULT_BUILDER
    if normalized.timeout_seconds == 0:
        normalized.timeout_seconds = DEFAULT_TIMEOUT_S
    if not normalized.runtime.kind:
        normalized.runtime.kind = "local"
    if normalized.evaluator.kind and normalized.evaluator.timeout_seconds == 0:
        normalized.evaluator.timeout_seconds = DEFAULT_EVALUATOR_TIMEOUT_S
    return normalized


def validate_task(task: rollout_pb2.Task) -> list[str]:
    """What is wrong with a normalized task (see `normalize_task`), one "field: problem" each."""
    problems = []
    if not TASK_ID.fullmatch(task.task_id):
        problems.append(
            f"task_id: {task.task_id!r} is not 1 to 128 letters, digits, '.', '_' or '-'"
            " starting with a letter or digit"
        )
    if not 0 < task.group_size <= MAX_GROUP_SIZE:
        problems.append(f"group_size: must be between 1 and {MAX_GROUP_SIZE}, got {task.group_size}")
    problems += _harness_problems(task)
    problems += _runtime_problems(task.runtime)
    problems += _evaluator_problems(task.evaluator)
    if task.evaluator.kind == "harbor" and task.runtime.kind != "docker":
        problems.append("evaluator.harbor: a Harbor task runs in runtime 'docker'")
    if task.builder not in BUILDERS:
        problems.append(f"builder: unknown builder {task.builder!r} (known: {', '.join(sorted(BUILDERS))})")
    problems += _timeout_problems("timeout_seconds", task.timeout_seconds)
    problems += policy_problems(task.sampling, "sampling")
    return problems


def _harness_problems(task: rollout_pb2.Task) -> list[str]:
    harness = task.harness
    problems = []
    if not harness.preset:
        problems.append(f"harness.preset: required (known: {', '.join(HARNESS_PRESETS)})")
    elif harness.preset not in HARNESS_PRESETS:
        problems.append(f"harness.preset: unknown preset {harness.preset!r} (known: {', '.join(HARNESS_PRESETS)})")
    if harness.preset == "command":
        if not harness.command:
            problems.append("harness.command: required for preset 'command' (the argv to run)")
        elif not harness.command[0]:
            problems.append("harness.command: the program (its first element) is empty")
    else:
        if harness.command:
            problems.append(f"harness.command: only preset 'command' runs a command, not {harness.preset!r}")
        if not task.instruction.strip():
            problems.append("instruction: required (empty)")
    if harness.dialect and harness.preset in PRESETS:
        spoken = PRESETS[harness.preset].dialects
        if not spoken:
            problems.append(
                f"harness.dialect: preset {harness.preset!r} takes none (its command speaks what it speaks)"
            )
        elif harness.dialect not in spoken:
            known = ", ".join(common_pb2.Dialect.Name(d) for d in spoken)
            problems.append(
                f"harness.dialect: preset {harness.preset!r} cannot speak {_dialect_name(harness.dialect)} (it speaks {known})"
            )
    for name, value in harness.env.items():
        if not ENV_NAME.fullmatch(name):
            problems.append(f"harness.env: {name!r} is not an environment variable name")
        if "\0" in value:
            problems.append(f"harness.env[{name!r}]: contains a NUL character")
    return problems


def _dialect_name(dialect: int) -> str:
    try:
        return common_pb2.Dialect.Name(dialect)
    except ValueError:
        return f"dialect {dialect}"


def _runtime_problems(runtime: rollout_pb2.RuntimeSpec) -> list[str]:
    if runtime.kind not in RUNTIME_KINDS:
        return [f"runtime.kind: unknown runtime {runtime.kind!r} (known: {', '.join(RUNTIME_KINDS)})"]
    if runtime.kind == "docker" and not runtime.image:
        return ["runtime.image: required for runtime 'docker'"]
    if (problem := template_problem(runtime.template)) is not None:
        return [f"runtime.template: {problem}"]
    if runtime.revision and not runtime.template:
        return ["runtime.revision: needs a template (the git repository to check it out of)"]
    docker_only = [name for name in ("workdir", "cpus", "memory_bytes", "max_processes") if getattr(runtime, name)]
    if runtime.kind != "docker" and docker_only:
        return [f"runtime.{docker_only[0]}: only for runtime 'docker'"]
    if runtime.workdir and (not runtime.workdir.startswith("/") or ".." in runtime.workdir.split("/")):
        return [f"runtime.workdir: {runtime.workdir!r} is not an absolute path without '..'"]
    if runtime.cpus < 0 or runtime.memory_bytes < 0 or runtime.max_processes < 0:
        return ["runtime: cpus, memory_bytes and max_processes must be >= 0"]
    return []


def _gym_problems(gym: rollout_pb2.GymVerifier) -> list[str]:
    problems = []
    if not gym.url.startswith(("http://", "https://")):
        problems.append(f"evaluator.gym.url: {gym.url!r} is not an http(s) URL of a NeMo Gym resources server")
    if gym.row_json:
        try:
            row = json.loads(gym.row_json)
        except ValueError as exc:
            row = exc
        if not isinstance(row, dict):
            problems.append("evaluator.gym.row_json: must be a JSON object (the Gym row)")
    return problems


def _evaluator_problems(evaluator: rollout_pb2.EvaluatorSpec) -> list[str]:
    problems = []
    if evaluator.kind not in EVALUATOR_KINDS:
        known = ", ".join(repr(kind) for kind in EVALUATOR_KINDS)
        problems.append(f"evaluator.kind: unknown evaluator {evaluator.kind!r} (known: {known})")
    elif evaluator.kind == "command" and not evaluator.command.strip():
        problems.append("evaluator.command: required for evaluator 'command'")
    elif evaluator.kind == "python" and not PYTHON_CALLABLE.fullmatch(evaluator.callable):
        problems.append(f"evaluator.callable: {evaluator.callable!r} is not 'module:function'")
    elif evaluator.kind == "swe":
        if not evaluator.swe.fail_to_pass:
            problems.append("evaluator.swe.fail_to_pass: at least one test is required")
        if evaluator.swe.max_patch_bytes < 0:
            problems.append(f"evaluator.swe.max_patch_bytes: must be >= 0, got {evaluator.swe.max_patch_bytes}")
    elif evaluator.kind == "harbor" and not evaluator.harbor.image:
        problems.append("evaluator.harbor.image: required for evaluator 'harbor'")
    elif evaluator.kind == "gym":
        problems += _gym_problems(evaluator.gym)
    problems += _timeout_problems("evaluator.timeout_seconds", evaluator.timeout_seconds)
    return problems


def _timeout_problems(field: str, seconds: float) -> list[str]:
    if not math.isfinite(seconds) or seconds < 0:
        return [f"{field}: must be a finite number of seconds >= 0, got {seconds}"]
    return []


def parse_task_lines(text: str, source: str) -> list[rollout_pb2.Task]:
    """The tasks of a JSON Lines task file, one Task per line in the protobuf JSON mapping; blank
    lines and lines starting with "#" are skipped. Every line is checked (parsed, normalized and
    validated, task ids unique) before anything is returned, so a file with a bad line gives none."""
    tasks = []
    problems = []
    first_line_of: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source}:{number}"
        try:
            value = json.loads(stripped)
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a JSON object (one Task), got {_json_type(value)}")
                continue
            task = json_format.ParseDict(value, rollout_pb2.Task())
        except (json.JSONDecodeError, json_format.ParseError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        problems += [f"{where}: {problem}" for problem in validate_task(normalize_task(task))]
        if task.task_id:
            if task.task_id in first_line_of:
                problems.append(f"{where}: task_id: {task.task_id!r} repeats line {first_line_of[task.task_id]}")
            first_line_of.setdefault(task.task_id, number)
        tasks.append(task)
    if problems:
        listed = problems[:MAX_LISTED_PROBLEMS]
        if len(problems) > len(listed):
            listed.append(f"… and {len(problems) - len(listed)} more problems")
        raise TaskFileError("\n".join(listed))
    return tasks


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPES[type(value)]
