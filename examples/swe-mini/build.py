"""Build the swe-mini repositories as git checkouts, and (for authors) their instance file.

Each task lives in `sources/<name>/` as plain files:

    issue.md     the problem statement
    base/        the repository at its base commit (the bug, and tests that pass)
    fix/         files the gold patch changes, as they are after it
    tests/       files the test patch adds or changes, as they are after it

`python examples/swe-mini/build.py [DIR]` makes `DIR/polar-mini/<name>` (default DIR:
examples/swe-mini/repos) a git repository whose one commit is `base/`, committed with a fixed author,
date and message, so its hash is the instances' `base_commit` on every machine. A repository
already at that commit is left alone. Then
`polar tasks import swe examples/swe-mini/instances.jsonl --flavor swebench --local DIR` imports it.

`--images` also builds each repository's Docker image, `polar-swe-mini/<name>` (the Dockerfile
here: the checkout at /testbed, FROM the base image of scripts/setup_docker.sh); an image already
built from the same commit and base image is kept. Then
`polar tasks import swe examples/swe-mini/instances.jsonl --flavor swebench --image-template
'polar-swe-mini/{repo_name}'` imports tasks that run, and are graded, in those containers.

`--instances` (for whoever edits `sources/`) rewrites instances.jsonl: the gold and test patches
as git diffs of the overlays, and FAIL_TO_PASS / PASS_TO_PASS from running pytest with the test
patch before and after the gold patch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "sources"
INSTANCES = HERE / "instances.jsonl"
OWNER = "polar-mini"
IMAGE_REPOSITORY = "polar-swe-mini"
BASE_IMAGE = "polar-base:bookworm"
DATE = "2025-01-01T00:00:00+00:00"
# The repositories need no pytest plugin, and loading those of the node's environment (hypothesis,
# anyio, ...) costs more than the tests themselves.
TEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider {files}"
IDENTITY = {
    "GIT_AUTHOR_NAME": "Polar Examples",
    "GIT_AUTHOR_EMAIL": "examples@polar.invalid",
    "GIT_AUTHOR_DATE": DATE,
    "GIT_COMMITTER_NAME": "Polar Examples",
    "GIT_COMMITTER_EMAIL": "examples@polar.invalid",
    "GIT_COMMITTER_DATE": DATE,
}


def git_environment() -> dict[str, str]:
    """No user or system configuration (hooks, autocrlf, signing), a fixed identity and date."""
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": tempfile.gettempdir(),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "LANG": "C.UTF-8",
        **IDENTITY,
    }


def git(folder: Path, *arguments: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(folder), *arguments], env=git_environment(), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"git {' '.join(arguments)} in {folder} failed: {result.stderr.strip()}")
    return result.stdout


def copy_files(source: Path, destination: Path) -> None:
    """source's files into destination, each written fresh (mode 0644 whatever the source's)."""
    for path in sorted(source.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            target = destination / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
            target.chmod(0o644)


def build_repository(name: str, destination: Path) -> str:
    """destination: a repository of one commit, `sources/<name>/base`; its hash."""
    if (destination / ".git").exists():
        shutil.rmtree(destination)
    destination.mkdir(parents=True)
    git(destination, "init", "--quiet", "--initial-branch=main")
    copy_files(SOURCES / name / "base", destination)
    git(destination, "add", "--all")
    git(destination, "commit", "--quiet", "--no-verify", "--message", f"{name}: base")
    return git(destination, "rev-parse", "HEAD").strip()


def expected_commits() -> dict[str, str]:
    """Each repository's base commit as instances.jsonl records it."""
    commits = {}
    for line in INSTANCES.read_text().splitlines():
        instance = json.loads(line)
        commits[instance["repo"].split("/", 1)[1]] = instance["base_commit"]
    return commits


def build_all(root: Path, names: list[str] | None = None) -> dict[str, str]:
    """Every repository (or those named) under root/polar-mini, skipping those already at their
    base commit; {name: its commit}."""
    expected = expected_commits() if INSTANCES.exists() else {}
    built = {}
    for source in sorted(SOURCES.iterdir()):
        if names is not None and source.name not in names:
            continue
        destination = root / OWNER / source.name
        if expected.get(source.name) and _head(destination) == expected[source.name]:
            built[source.name] = expected[source.name]
            continue
        built[source.name] = build_repository(source.name, destination)
    return built


def image_name(name: str) -> str:
    return f"{IMAGE_REPOSITORY}/{name}"


def build_images(root: Path, built: dict[str, str], base: str = BASE_IMAGE) -> list[str]:
    """The image of every repository in `built` ({name: commit}, checked out under root), unless
    one of the same commit and base image exists; the names of the images (re)built."""
    ask = ["docker", "image", "inspect", "--format", "{{.Id}}", base]
    inspect = subprocess.run(ask, capture_output=True, text=True)
    if inspect.returncode != 0:
        raise SystemExit(f"no image {base!r}: build it with scripts/setup_docker.sh ({inspect.stderr.strip()})")
    base_id = inspect.stdout.strip()
    rebuilt = []
    for name, commit in sorted(built.items()):
        stamp = f"{commit} {base_id}"
        label = '{{index .Config.Labels "polar.swe-mini.stamp"}}'
        ask = ["docker", "image", "inspect", "--format", label, image_name(name)]
        current = subprocess.run(ask, capture_output=True, text=True)
        if current.returncode == 0 and current.stdout.strip() == stamp:
            continue
        argv = ["docker", "build", "--quiet", "--file", str(HERE / "Dockerfile"), "--build-arg", f"BASE={base}"]
        argv += ["--label", f"polar.swe-mini.stamp={stamp}", "--tag", image_name(name), str(root / OWNER / name)]
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"docker build of {image_name(name)} failed: {result.stderr.strip()[-2000:]}")
        rebuilt.append(image_name(name))
    return rebuilt


def _head(folder: Path) -> str:
    if not (folder / ".git").exists():
        return ""
    result = subprocess.run(
        ["git", "-C", str(folder), "rev-parse", "HEAD"], env=git_environment(), capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else ""


# --------------------------------------------------------------------------------- instances (authors)


def overlay_diff(checkout: Path, overlay: Path) -> str:
    """The git diff that turns the checkout's files into themselves with `overlay` copied over."""
    copy_files(overlay, checkout)
    git(checkout, "add", "--all")
    diff = git(checkout, "diff", "--cached", "--full-index", "HEAD")
    git(checkout, "reset", "--quiet", "--hard", "HEAD")
    git(checkout, "clean", "-fdxq")
    return diff


def pytest_results(checkout: Path, files: list[str]) -> dict[str, str]:
    from polar.app.swe.grading import parse_pytest_log

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *files],
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    return parse_pytest_log(result.stdout)


def instance(name: str, checkout: Path, base_commit: str) -> dict:
    from polar.app.swe.grading import files_in_patch

    gold = overlay_diff(checkout, SOURCES / name / "fix")
    tests = overlay_diff(checkout, SOURCES / name / "tests")
    files = [path for path in files_in_patch(tests) if path.endswith(".py")]
    copy_files(SOURCES / name / "tests", checkout)
    before = pytest_results(checkout, files)
    copy_files(SOURCES / name / "fix", checkout)
    after = pytest_results(checkout, files)
    git(checkout, "reset", "--quiet", "--hard", "HEAD")
    git(checkout, "clean", "-fdxq")
    fail_to_pass = [test for test, status in after.items() if status == "PASSED" and before.get(test) != "PASSED"]
    pass_to_pass = [test for test, status in after.items() if status == "PASSED" and before.get(test) == "PASSED"]
    if not fail_to_pass or len(after) != len([s for s in after.values() if s == "PASSED"]):
        raise SystemExit(
            f"{name}: the gold patch must make every test pass and some newly: before {before}, after {after}"
        )
    return {
        "instance_id": f"{OWNER}__{name}-1",
        "repo": f"{OWNER}/{name}",
        "base_commit": base_commit,
        "problem_statement": (SOURCES / name / "issue.md").read_text(),
        "hints_text": "",
        "patch": gold,
        "test_patch": tests,
        "FAIL_TO_PASS": json.dumps(fail_to_pass),
        "PASS_TO_PASS": json.dumps(pass_to_pass),
        "test_cmd": TEST_COMMAND,
        "created_at": DATE,
        "version": "1.0",
        "environment_setup_commit": base_commit,
    }


def write_instances() -> None:
    sys.path.insert(0, str(HERE.parents[1]))  # this checkout's polar, for its pytest log reader
    with tempfile.TemporaryDirectory() as scratch:
        lines = []
        for source in sorted(SOURCES.iterdir()):
            checkout = Path(scratch) / source.name
            base_commit = build_repository(source.name, checkout)
            lines.append(json.dumps(instance(source.name, checkout, base_commit)))
    INSTANCES.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} instances to {INSTANCES}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", default=str(HERE / "repos"), help="where to build (default: %(default)s)")
    parser.add_argument("--instances", action="store_true", help="rewrite instances.jsonl from sources/ (authors only)")
    parser.add_argument("--images", action="store_true", help="also build each repository's Docker image")
    args = parser.parse_args()
    if args.instances:
        write_instances()
    built = build_all(Path(args.dir))
    expected = expected_commits()
    wrong = [name for name, commit in built.items() if expected.get(name) != commit]
    if wrong:
        print(f"base commits differ from instances.jsonl for: {', '.join(wrong)}", file=sys.stderr)
        return 1
    print(f"{len(built)} repositories at their base commits under {Path(args.dir) / OWNER}")
    if args.images:
        rebuilt = build_images(Path(args.dir), built)
        print(f"{len(built)} images {IMAGE_REPOSITORY}/<name> ({len(rebuilt)} built now)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
