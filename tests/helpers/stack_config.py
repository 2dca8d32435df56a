"""The stack config files the CLI tests hand to `polar train`, `polar generate` and `polar up`: every
service on a loopback port the kernel chooses (port 0), plus each test's own settings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

Value = str | int | float | bool | Path

# Every listening port of the stack; [trainer]'s only where a test trains.
PORTS: dict[str, dict[str, Value]] = {
    "rollout": {"port": 0},
    "inference": {"port": 0},
    "envoy": {"harness_port": 0, "inference_port": 0, "admin_port": 0},
    "gateway": {"port": 0, "grpc_port": 0},
}


def write_stack_config(path: Path, **sections: Mapping[str, Value]) -> Path:
    """Writes the TOML file at `path`: the ports above, then each section's keys (a key given here
    replaces the port's); returns `path`."""
    merged: dict[str, dict[str, Value]] = {name: dict(keys) for name, keys in PORTS.items()}
    if "trainer" in sections:
        merged["trainer"] = {"port": 0}
    for name, keys in sections.items():
        merged.setdefault(name, {}).update(keys)
    text = "".join(
        f"[{name}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in keys.items())
        for name, keys in merged.items()
    )
    path.write_text(text)
    return path


def _toml(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A JSON string is a TOML basic string (the same escapes), so any path or text survives.
    return json.dumps(str(value))
