"""Harbor task directories into Polar tasks (`polar tasks import harbor DIR... --out FILE`).

A task directory (Harbor's format):

    instruction.md      the prompt, as it is
    task.toml           limits and metadata (the fields read are listed below)
    environment/        the image's build context (environment/Dockerfile), unless task.toml's
                        [environment] docker_image names an image already on this machine
    tests/              the verifier: tests/test.sh writes the reward to /logs/verifier/reward.txt
                        (or reward.json)
    solution/           optional: solution/solve.sh, what `polar tasks oracle` runs

A DIR that holds no task.toml but folders that do is a data set: each of those folders is a task.

Images are built here, once: each is tagged by a hash of what it is built from (the files of its
folder, their paths and modes), so an unchanged task builds nothing the second time:

    polar-harbor/NAME:HASH            environment/: the sessions' image
    polar-harbor/NAME-tests:HASH      that image with tests/ at /tests: the verifier's
    polar-harbor/NAME-solution:HASH   that image with solution/ at /solution: the oracle's

The sessions' image never holds the tests or the solution. The workspace is the image's WORKDIR
(filled from the image, polar.app.node.runtimes.docker): it is what the verifier's container gets
of the session, so the image must set a WORKDIR other than /.

task.toml fields honoured:
    [task] name                     the task's name (metadata harbor_task), else the folder's
    [metadata] *                    copied into the task's metadata as harbor_<key> (values as text)
    [agent] timeout_sec             the harness's timeout (else --timeout)
    [verifier] timeout_sec, env     test.sh's timeout (else --test-timeout, 600) and variables
    [solution] env                  solve.sh's variables (the oracle)
    [environment] cpus, memory_mb   the container's limits (memory_mb in MiB; `memory`, Harbor's
                                    older "4G"-style field, too)
    [environment] build_timeout_sec the image build's timeout (else 600)
    [environment] docker_image      a prebuilt image instead of environment/
Every other field (storage_mb, gpus, allow_internet, network_mode, healthcheck, mcp_servers, users)
is ignored: a session's container has no network, always.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from polar.rollout.tasks import TASK_ID
from polar.v1 import rollout_pb2

IMAGE_REPOSITORY = "polar-harbor"
CONTENT_LABEL = "polar.harbor.content"
DEFAULT_AGENT_TIMEOUT_S = 1800.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
DEFAULT_BUILD_TIMEOUT_S = 600.0
HASH_CHARS = 16
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class HarborTaskError(ValueError):
    """A task directory that cannot be imported; the message names the directory and what is wrong."""


@dataclass(frozen=True)
class ImportOptions:
    preset: str = "pi"
    group_size: int = 1
    timeout_s: float = DEFAULT_AGENT_TIMEOUT_S  # the harness's, where task.toml gives none
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S  # test.sh's, where task.toml gives none
    sampling: Mapping[str, object] = field(default_factory=dict)  # SamplingPolicy in protobuf JSON
    docker: str = "docker"


def task_directories(paths: Sequence[Path]) -> list[Path]:
    """The task directories named: each path is one (it holds task.toml) or a data set of them."""
    found: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise HarborTaskError(f"{path}: no such folder")
        if (path / "task.toml").is_file():
            found.append(path)
            continue
        inside = sorted(child for child in path.iterdir() if (child / "task.toml").is_file())
        if not inside:
            raise HarborTaskError(f"{path}: neither a task directory (no task.toml) nor a folder of them")
        found += inside
    return found


def import_tasks(paths: Sequence[Path], options: ImportOptions) -> list[rollout_pb2.Task]:
    """One task per task directory, their images built (see the module docstring)."""
    tasks = [to_task(directory, options) for directory in task_directories(paths)]
    seen: dict[str, int] = {}
    for task in tasks:
        seen[task.task_id] = seen.get(task.task_id, 0) + 1
    repeated = sorted(task_id for task_id, count in seen.items() if count > 1)
    if repeated:
        raise HarborTaskError(f"two task directories have the same name: {', '.join(repeated)}")
    return tasks


def to_task(directory: Path, options: ImportOptions) -> rollout_pb2.Task:
    config = read_config(directory)
    instruction_path = directory / "instruction.md"
    if not instruction_path.is_file():
        raise HarborTaskError(f"{directory}: no instruction.md")
    instruction = instruction_path.read_text(encoding="utf-8")
    if not instruction.strip():
        raise HarborTaskError(f"{instruction_path}: empty")
    if not (directory / "tests" / "test.sh").is_file():
        raise HarborTaskError(f"{directory}: no tests/test.sh")

    section = _sections(directory, config)
    name = str(section["task"].get("name") or directory.resolve().name)
    environment = section["environment"]
    # Every field read before anything is built: a wrong one is refused at once.
    task = rollout_pb2.Task(
        task_id=task_id_for(name),
        instruction=instruction,
        group_size=options.group_size,
        timeout_seconds=_seconds(directory, section["agent"], "timeout_sec", options.timeout_s),
        harness=rollout_pb2.HarnessSpec(preset=options.preset),
        metadata={"harbor_task": name, **_metadata(section["metadata"])},
    )
    task.runtime.kind = "docker"
    task.runtime.cpus = _number(directory, environment, "cpus", 0.0)
    task.runtime.memory_bytes = _memory_bytes(directory, environment)
    task.evaluator.kind = "harbor"
    task.evaluator.timeout_seconds = _seconds(directory, section["verifier"], "timeout_sec", options.verifier_timeout_s)
    tests = task.evaluator.harbor
    tests.name = name
    tests.env.update(_variables(directory, section["verifier"]))
    tests.solution_env.update(_variables(directory, section["solution"]))
    if options.sampling:
        json_format.ParseDict(dict(options.sampling), task.sampling)
    build_timeout_s = _seconds(directory, environment, "build_timeout_sec", DEFAULT_BUILD_TIMEOUT_S)
    if not environment.get("docker_image") and not (directory / "environment" / "Dockerfile").is_file():
        raise HarborTaskError(f"{directory}: no environment/Dockerfile (nor [environment] docker_image)")

    builder = ImageBuilder(options.docker, build_timeout_s)
    base_name = image_name(name)
    if environment.get("docker_image"):
        image = str(environment["docker_image"])
        builder.require(image, directory)
    else:
        image = builder.build_folder(directory / "environment", base_name, directory)
    task.runtime.image = image
    task.runtime.workdir = builder.workdir(image, directory)
    tests.image = builder.build_layer(image, directory / "tests", "/tests", f"{base_name}-tests", directory)
    if (directory / "solution" / "solve.sh").is_file():
        tests.solution_image = builder.build_layer(
            image, directory / "solution", "/solution", f"{base_name}-solution", directory
        )
    return task


def read_config(directory: Path) -> dict:
    path = directory / "task.toml"
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HarborTaskError(f"{directory}: no task.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{path}: not TOML: {exc}") from None


def _sections(directory: Path, config: dict) -> dict[str, dict]:
    sections = {}
    for key in ("task", "metadata", "agent", "verifier", "solution", "environment"):
        value = config.get(key, {})
        if not isinstance(value, dict):
            raise HarborTaskError(f"{directory / 'task.toml'}: [{key}] must be a table")
        sections[key] = value
    return sections


def task_id_for(name: str) -> str:
    """A Harbor name ("org/name" or a folder's) as a task id: other characters become '_'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:128]
    return cleaned if TASK_ID.fullmatch(cleaned) else f"t{cleaned}"[:128]


def image_name(name: str) -> str:
    """polar-harbor/<name, as Docker's repository names allow>."""
    cleaned = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "task"
    return f"{IMAGE_REPOSITORY}/{cleaned[:100]}"


def _metadata(table: dict) -> dict[str, str]:
    return {
        f"harbor_{key}": value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        for key, value in table.items()
    }


def _variables(directory: Path, table: dict) -> dict[str, str]:
    variables = table.get("env", {})
    if not isinstance(variables, dict):
        raise HarborTaskError(f'{directory / "task.toml"}: env must be a table of NAME = "value"')
    return {str(name): str(value) for name, value in variables.items()}


def _number(directory: Path, table: dict, key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise HarborTaskError(f"{directory / 'task.toml'}: {key} must be a number >= 0, not {value!r}")
    return float(value)


def _seconds(directory: Path, table: dict, key: str, default: float) -> float:
    seconds = _number(directory, table, key, default)
    return seconds or default


def _memory_bytes(directory: Path, environment: dict) -> int:
    if "memory_mb" in environment:
        return int(_number(directory, environment, "memory_mb", 0) * (1 << 20))
    text = environment.get("memory")
    if text is None:
        return 0
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT])\s*", str(text).upper())
    if match is None:
        raise HarborTaskError(f"{directory / 'task.toml'}: memory {text!r} is not a size like '2G' or '512M'")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def content_hash(folder: Path, *prefix: str) -> str:
    """A hash of the folder's files (relative paths, executable bits, contents) after `prefix`."""
    digest = hashlib.sha256()
    for part in prefix:
        digest.update(part.encode() + b"\0")
    for path in sorted(_files(folder)):
        relative = path.relative_to(folder).as_posix()
        if path.is_symlink():
            digest.update(f"link {relative} {path.readlink()}\0".encode())
            continue
        digest.update(f"file {relative} {path.stat().st_mode & 0o111:o}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:HASH_CHARS]


def _files(folder: Path) -> Iterator[Path]:
    for path in folder.rglob("*"):
        if path.is_symlink() or path.is_file():
            yield path


class ImageBuilder:
    """Builds a task's images with the docker CLI, each only when no image of its tag exists."""

    def __init__(self, docker: str, build_timeout_s: float) -> None:
        self.docker = shutil.which(docker) or docker
        self.build_timeout_s = build_timeout_s

    def _run(self, argv: Sequence[str], directory: Path, what: str, timeout_s: float) -> str:
        try:
            result = subprocess.run(
                [self.docker, *argv], capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except FileNotFoundError:
            raise HarborTaskError(f"{directory}: {what}: no docker command on this machine") from None
        except subprocess.TimeoutExpired:
            raise HarborTaskError(f"{directory}: {what}: ran past {timeout_s:g} s") from None
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip()[-2000:]
            raise HarborTaskError(f"{directory}: {what} failed: {tail}")
        return result.stdout

    def exists(self, image: str) -> bool:
        argv = [self.docker, "image", "inspect", "--format", "{{.Id}}", image]
        try:
            return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return False

    def inspect(self, image: str, field: str, directory: Path, what: str = "docker image inspect") -> str:
        return self._run(["image", "inspect", "--format", field, image], directory, what, 60).strip()

    def require(self, image: str, directory: Path) -> None:
        self.inspect(image, "{{.Id}}", directory, f"image {image!r} (pull or build it first)")

    def workdir(self, image: str, directory: Path) -> str:
        workdir = self.inspect(image, "{{.Config.WorkingDir}}", directory).rstrip("/")
        if not workdir.startswith("/"):
            raise HarborTaskError(
                f"{directory}: image {image!r} sets no WORKDIR other than /: the agent's workspace is its"
                " WORKDIR, the folder the verifier gets (add e.g. `WORKDIR /app` to environment/Dockerfile)"
            )
        return workdir

    def build_folder(self, context: Path, name: str, directory: Path) -> str:
        """The image of `context`'s Dockerfile, tagged by the folder's content."""
        digest = content_hash(context)
        image = f"{name}:{digest}"
        if not self.exists(image):
            argv = ["build", "--quiet", f"--label={CONTENT_LABEL}={digest}", "--tag", image, str(context)]
            self._run(argv, directory, f"docker build of {context}", self.build_timeout_s)
        return image

    def build_layer(self, base: str, folder: Path, target: str, name: str, directory: Path) -> str:
        """`base` with `folder`'s files at `target`, tagged by both."""
        digest = content_hash(folder, self.inspect(base, "{{.Id}}", directory), target)
        image = f"{name}:{digest}"
        if self.exists(image):
            return image
        with tempfile.TemporaryDirectory(prefix="polar-harbor-") as scratch:
            context = Path(scratch)
            shutil.copytree(folder, context / "files", symlinks=True)
            (context / "Dockerfile").write_text(f"FROM {base}\nCOPY files {target}\n")
            argv = ["build", "--quiet", f"--label={CONTENT_LABEL}={digest}", "--tag", image, str(context)]
            self._run(argv, directory, f"docker build of {folder} into {target}", self.build_timeout_s)
        return image
