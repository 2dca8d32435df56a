"""The examples' own modules (examples/…), loaded by file path: each is a program in a folder of its
own, not a package, and its folder stays off sys.path."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@functools.cache
def example_module(path: str) -> ModuleType:
    """The module in examples/`path` (e.g. "agent/agent.py"), loaded once. It is registered in
    sys.modules under "examples." + its path with dots (dataclasses look their module up there)."""
    file = EXAMPLES / path
    name = "examples." + Path(path).with_suffix("").as_posix().replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"no Python module at {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
