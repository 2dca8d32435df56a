"""Machines behind the real Envoy, for the control-plane tests: each "machine" is a loopback address
of its own (127.0.0.2, 127.0.0.3, ...) with its own processes. An inference machine is a scripted
`polar serve inference --rollout` process that joins Envoy's control plane as a stack's does; Envoy
runs on an address of its own; the control plane (the rollout server) stays in the test process,
on 127.0.0.1. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

from polar import envoy
from polar.config import EnvoyConfig
from polar.xds.snapshot import INFERENCE_CLUSTER
from tests.helpers.polar_command import Lines

START_S = 60.0  # a `polar serve inference` process started on a machine other tests load too
ENVOY_HOST = "127.0.0.5"


def inference_machine(
    start, folder: Path, name: str, host: str, script: dict, rollout: str
) -> tuple[subprocess.Popen, Lines]:
    """Machine `name`'s inference server on `host`, its own process (started by `start`, a
    polar_command.spawned function), answering `script` and joining the control plane at `rollout`;
    its Popen and its output lines."""
    script_file = folder / f"{name}.json"
    script_file.write_text(json.dumps(script))
    return start(
        "serve",
        "inference",
        "--engine",
        "scripted",
        "--script",
        str(script_file),
        "--host",
        host,
        "--port",
        "0",
        "--rollout",
        rollout,
    )


async def joined(lines: Lines, host: str) -> str:
    """Until the server on `host` serves, which it says once it joined the control plane; its address."""
    pattern = rf"^inference: serving .* on ({re.escape(host)}:\d+)"
    return (await asyncio.to_thread(lines.wait_for, pattern, START_S)).group(1)


@contextlib.asynccontextmanager
async def envoy_on(control_plane: str, node_id: str, host: str = ENVOY_HOST) -> AsyncIterator[envoy.RunningEnvoy]:
    """A real Envoy on `host` learning its upstreams from the control plane at `control_plane`."""
    config = EnvoyConfig(
        host=host,
        harness_port=0,
        inference_port=0,
        admin_port=0,
        workers=1,
        health_check_interval_s=0.2,
        xds_address=control_plane,
        node_id=node_id,
    )
    async with envoy.running_async(config) as running:
        yield running


def health_flags(proxy: envoy.RunningEnvoy) -> dict[str, str]:
    """The inference cluster's hosts (HOST:PORT) and their health flags, as Envoy's /clusters shows them."""
    text = envoy.admin_get(proxy.admin, "/clusters", timeout_s=5)
    assert text is not None
    rows = (line.split("::") for line in text.splitlines())
    return {row[1]: row[3] for row in rows if row[0] == INFERENCE_CLUSTER and row[2] == "health_flags"}
