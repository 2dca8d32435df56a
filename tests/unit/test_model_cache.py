"""The packaged models' folders (polar.inference.models): built once into the cache, silently, by
whichever command first needs one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RESOLVE = "from polar.inference.models import resolve_model; print(resolve_model('tiny'))"


def test_the_tiny_model_is_built_into_a_fresh_cache_once_and_silently(tmp_path: Path) -> None:
    env = {**os.environ, "POLAR_CACHE_DIR": str(tmp_path)}
    built = subprocess.run([sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and built.stderr == "", built.stderr[-2000:]
    folder = Path(built.stdout.strip())
    assert folder.parent == tmp_path / "models" and (folder / "config.json").is_file()
    assert [path.name for path in (tmp_path / "models").iterdir()] == [folder.name]  # no scratch folder left
    config = (folder / "config.json").stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stderr == "" and Path(again.stdout.strip()) == folder
    assert (folder / "config.json").stat().st_mtime_ns == config  # found, not built again
