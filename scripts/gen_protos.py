"""Regenerate the committed Python stubs from protos/.

The stubs land in polar/v1/ so that their own imports (``from polar.v1 import common_pb2``) resolve
inside the ``polar`` package without rewriting. ``--check`` regenerates into a scratch folder and
exits 1 when the committed stubs differ, which is what the drift test runs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("polar") / "v1"
INIT_TEXT = '"""Generated protobuf and gRPC stubs for protos/polar/v1 (scripts/gen_protos.py). Do not edit."""\n'


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every proto; return the files written under out_root."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    target = out_root / PACKAGE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for stale in list(target.glob("*_pb2*.py")) + list(target.glob("*_pb2*.pyi")):
        stale.unlink()
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    (target / "__init__.py").write_text(INIT_TEXT)
    return sorted(p for p in target.iterdir() if p.is_file())


def check() -> int:
    """Return 0 when the committed stubs equal freshly generated ones, else print the drift, return 1."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(Path(scratch))
        committed_dir = ROOT / PACKAGE_DIR
        drift = []
        for path in fresh:
            committed = committed_dir / path.name
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                drift.append(path.name)
        fresh_names = {p.name for p in fresh}
        for path in committed_dir.glob("*_pb2*.py*"):
            if path.name not in fresh_names:
                drift.append(f"{path.name} (no proto generates it)")
        if drift:
            print("stubs out of date with protos/: " + ", ".join(drift), file=sys.stderr)
            print("run: python scripts/gen_protos.py", file=sys.stderr)
            return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs drifted")
    args = parser.parse_args()
    if args.check:
        return check()
    with tempfile.TemporaryDirectory() as scratch:
        for path in generate(Path(scratch)):
            shutil.copyfile(path, ROOT / PACKAGE_DIR / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
