"""SWE-style dataset instances into Polar tasks (`polar tasks import swe FILE --flavor F`).

An instance file is JSON Lines (one instance per line), a JSON array, or Parquet (read with
pyarrow). Flavors:

- "swebench" (SWE-bench, SWE-bench Verified/Lite, SWE-smith's export) and "swegym" (SWE-Gym): the
  fields instance_id, repo ("owner/name"), base_commit, problem_statement, patch (the gold patch),
  test_patch, FAIL_TO_PASS and PASS_TO_PASS (JSON strings or lists), hints_text; an optional
  test_cmd replaces the default test command. Docker images by each project's naming rule:
  SWE-bench `swebench/sweb.eval.x86_64.<id, "__" as "_1776_">`, SWE-Gym
  `xingyaoww/sweb.eval.x86_64.<id, "__" as "_s_">`, lower-cased, tag `latest`.
- "r2e" (R2E-Gym): repo_name, commit_hash, docker_image, problem_statement and
  expected_output_json (test name -> status once fixed); the tests it expects to pass are the ones
  that must pass, run with the image's /root/run_tests.sh. It carries no test patch and no gold
  patch in a form applied here, so `polar tasks oracle` reports its gold run as missing.

The instruction is the problem statement (and the hints, only when asked), never the gold patch, the
test patch or the test names. The runtime is the instance's Docker image, whose repository at
/testbed becomes the workspace, or with `local` (a folder holding a git checkout of each repository
at `<folder>/<owner>/<name>`) no Docker: the workspace is that repository at base_commit alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from polar.app.swe.changes import git_env
from polar.rollout.tasks import TASK_ID
from polar.v1 import rollout_pb2

FLAVORS = ("swebench", "swegym", "r2e")
IMAGE_TEMPLATES = {
    "swebench": "swebench/sweb.eval.x86_64.{instance_id_1776}:latest",
    "swegym": "xingyaoww/sweb.eval.x86_64.{instance_id_s}:latest",
    "r2e": "{docker_image}",
}
R2E_TEST_COMMAND = "bash /root/run_tests.sh"
# Where the images hold the repository: the session's workspace is there, filled from the image
# (polar.app.node.runtimes.docker), so the image's editable installs import the workspace's files.
DOCKER_WORKDIR = "/testbed"
INSTRUCTION = """\
The repository {repo} is checked out in the current folder. Resolve the issue below by changing the \
repository's source files; its tests will be run afterwards (do not change them).

<issue>
{problem}
</issue>
"""
HINTS = "\n<hints>\n{hints}\n</hints>\n"


class InstanceError(ValueError):
    """An instance file that cannot be imported; the message names FILE:LINE and the field."""


@dataclass(frozen=True)
class ImportOptions:
    flavor: str
    local: Path | None = None  # a folder of checkouts (<owner>/<name>); None: the Docker image
    image_template: str = ""  # "": the flavor's rule
    preset: str = "pi"
    group_size: int = 1
    timeout_s: float = 1800.0
    evaluator_timeout_s: float = 600.0
    hints: bool = False
    test_command: str = ""  # "": the instance's test_cmd, else the flavor's default
    sampling: Mapping[str, object] = field(default_factory=dict)  # SamplingPolicy in protobuf JSON


@dataclass(frozen=True)
class Instance:
    """One dataset instance, in the fields every flavor maps to."""

    instance_id: str
    repo: str  # "owner/name"
    base_commit: str
    problem_statement: str
    hints: str
    gold_patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_command: str
    image_fields: Mapping[str, str]  # what an image template may name


# ------------------------------------------------------------------------------------------ reading


def read_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) for each instance of a JSON Lines, JSON array or Parquet file."""
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InstanceError(f"cannot read {path}: {exc}") from exc
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{path}: not a JSON array of instances: {exc}") from exc
        for index, record in enumerate(records):
            yield f"{path}[{index}]", _object(record, f"{path}[{index}]")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{where}: not JSON: {exc}") from exc
        yield where, _object(record, where)


def _parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError as exc:
        raise InstanceError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
    try:
        table = parquet.read_table(path)
    except Exception as exc:
        raise InstanceError(f"cannot read {path} as Parquet: {exc}") from exc
    for index, record in enumerate(table.to_pylist()):
        yield f"{path}[row {index}]", record


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise InstanceError(f"{where}: expected a JSON object (one instance), got {type(value).__name__}")
    return value


def parse_instance(record: Mapping, flavor: str, where: str) -> Instance:
    """The instance in `record` by its flavor's field names; InstanceError names a missing or bad field."""
    if flavor == "r2e":
        return _parse_r2e(record, where)
    instance_id = _text(record, "instance_id", where)
    return Instance(
        instance_id=instance_id,
        repo=_repo(_text(record, "repo", where), where),
        base_commit=_text(record, "base_commit", where),
        problem_statement=_text(record, "problem_statement", where),
        hints=_text(record, "hints_text", where, required=False),
        gold_patch=_text(record, "patch", where, required=False),
        test_patch=_text(record, "test_patch", where),
        fail_to_pass=_test_list(record, "FAIL_TO_PASS", where, required=True),
        pass_to_pass=_test_list(record, "PASS_TO_PASS", where, required=False),
        test_command=_text(record, "test_cmd", where, required=False),
        image_fields={
            "instance_id": instance_id,
            "instance_id_1776": instance_id.replace("__", "_1776_").lower(),
            "instance_id_s": instance_id.replace("__", "_s_").lower(),
            "repo_name": _repo(_text(record, "repo", where), where).split("/", 1)[1].lower(),
        },
    )


def _parse_r2e(record: Mapping, where: str) -> Instance:
    repo_name = _text(record, "repo_name", where)
    commit = _text(record, "commit_hash", where)
    expected = record.get("expected_output_json")
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{where}: expected_output_json: not JSON: {exc}") from exc
    if not isinstance(expected, dict):
        raise InstanceError(f"{where}: expected_output_json: required, an object of test name -> status")
    must_pass = tuple(name for name, status in expected.items() if str(status).upper() == "PASSED")
    if not must_pass:
        raise InstanceError(f"{where}: expected_output_json: no test is expected to pass")
    image = _text(record, "docker_image", where)
    return Instance(
        instance_id=f"{repo_name}-{commit[:12]}",
        repo=_repo(repo_name if "/" in repo_name else f"{repo_name}/{repo_name}", where),
        base_commit=commit,
        problem_statement=_text(record, "problem_statement", where),
        hints="",
        gold_patch="",
        test_patch="",
        fail_to_pass=must_pass,
        pass_to_pass=(),
        test_command=R2E_TEST_COMMAND,
        image_fields={"instance_id": f"{repo_name}-{commit[:12]}", "docker_image": image},
    )


def _text(record: Mapping, name: str, where: str, *, required: bool = True) -> str:
    value = record.get(name)
    if value is None or value == "":
        if required:
            raise InstanceError(f"{where}: {name}: required")
        return ""
    if not isinstance(value, str):
        raise InstanceError(f"{where}: {name}: expected a string, got {type(value).__name__}")
    return value


def _repo(value: str, where: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", value) or ".." in value.split("/"):
        raise InstanceError(f"{where}: repo: {value!r} is not 'owner/name'")
    return value


def _test_list(record: Mapping, name: str, where: str, *, required: bool) -> tuple[str, ...]:
    """A test list given as a JSON array or as a string holding one (SWE-bench writes strings)."""
    value = record.get(name)
    if value is None or value == "":
        if required:
            raise InstanceError(f"{where}: {name}: required")
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{where}: {name}: a string that is not a JSON list: {exc}") from exc
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(item, str) for item in value):
        raise InstanceError(f"{where}: {name}: expected a list of test ids (strings)")
    if required and not value:
        raise InstanceError(f"{where}: {name}: the list is empty")
    return tuple(value)


# ------------------------------------------------------------------------------------------- tasks


def task_id_for(instance_id: str) -> str:
    """The instance id as a task id: characters a task id may not hold become '_'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id)[:128]
    return cleaned if TASK_ID.fullmatch(cleaned) else f"i{cleaned}"[:128]


def instruction_for(instance: Instance, hints: bool) -> str:
    text = INSTRUCTION.format(repo=instance.repo, problem=instance.problem_statement.strip())
    if hints and instance.hints.strip():
        text += HINTS.format(hints=instance.hints.strip())
    return text


def to_task(instance: Instance, options: ImportOptions) -> rollout_pb2.Task:
    """The task that runs and grades `instance` (see the module docstring)."""
    task = rollout_pb2.Task(
        task_id=task_id_for(instance.instance_id),
        instruction=instruction_for(instance, options.hints),
        group_size=options.group_size,
        timeout_seconds=options.timeout_s,
        harness=rollout_pb2.HarnessSpec(preset=options.preset),
        metadata={"swe_instance": instance.instance_id, "swe_repo": instance.repo},
    )
    if options.local is not None:
        task.runtime.kind = "local"
        task.runtime.template = str(options.local / instance.repo)
        task.runtime.revision = instance.base_commit
    else:
        task.runtime.kind = "docker"
        task.runtime.image = (options.image_template or IMAGE_TEMPLATES[options.flavor]).format_map(
            dict(instance.image_fields)
        )
        task.runtime.workdir = DOCKER_WORKDIR
    task.evaluator.kind = "swe"
    task.evaluator.timeout_seconds = options.evaluator_timeout_s
    task.evaluator.swe.CopyFrom(
        rollout_pb2.SweTests(
            instance_id=instance.instance_id,
            test_patch=instance.test_patch,
            fail_to_pass=instance.fail_to_pass,
            pass_to_pass=instance.pass_to_pass,
            test_command=options.test_command or instance.test_command,
            gold_patch=instance.gold_patch,
        )
    )
    if options.sampling:
        json_format.ParseDict(dict(options.sampling), task.sampling)
    return task


def missing_checkouts(instances: Sequence[Instance], local: Path) -> list[str]:
    """Instances whose repository is not a git checkout at `local/<owner>/<name>` holding the base
    commit, each as "instance_id: why"."""
    problems = []
    for instance in instances:
        checkout = local / instance.repo
        if not (checkout / ".git").exists():
            problems.append(f"{instance.instance_id}: no git checkout at {checkout}")
            continue
        found = subprocess.run(
            ["git", "-C", str(checkout), "cat-file", "-e", f"{instance.base_commit}^{{commit}}"],
            env={**git_env(checkout), "PATH": os.environ.get("PATH", os.defpath)},
            capture_output=True,
        )
        if found.returncode != 0:
            problems.append(f"{instance.instance_id}: {checkout} has no commit {instance.base_commit}")
    return problems


def import_tasks(path: Path, options: ImportOptions) -> list[rollout_pb2.Task]:
    """Every instance of `path` as a task, or InstanceError naming each problem (nothing is
    returned for a file with a bad instance; with `local`, every checkout must hold its commit)."""
    if options.flavor not in FLAVORS:
        raise InstanceError(f"unknown flavor {options.flavor!r} (known: {', '.join(FLAVORS)})")
    instances = [parse_instance(record, options.flavor, where) for where, record in read_records(path)]
    if not instances:
        raise InstanceError(f"{path} holds no instances")
    ids: dict[str, str] = {}
    for instance in instances:
        task_id = task_id_for(instance.instance_id)
        if task_id in ids:
            raise InstanceError(
                f"{path}: instances {ids[task_id]!r} and {instance.instance_id!r} give the same task id {task_id!r}"
            )
        ids[task_id] = instance.instance_id
    if options.local is not None:
        problems = missing_checkouts(instances, options.local)
        if problems:
            listed = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
            raise InstanceError(
                f"{len(problems)} of {len(instances)} repositories are not ready under {options.local}: {listed}"
            )
    return [to_task(instance, options) for instance in instances]
