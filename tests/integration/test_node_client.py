"""A Node.js client (tests/node/generate_client.js, protos loaded at run time) calls Generate on a
Python server and gets exactly the tokens and logprobs the engine emitted: the contract is the
.proto files, not the Python stubs."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from polar.inference.engines.scripted import ScriptedEngine
from polar.inference.server import start_server

pytestmark = [pytest.mark.node, pytest.mark.anyio]

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
TOKENS = [11, 42, 7, 99, 3, 250, 18, 64, 5, 301]
LOGPROBS = [-0.1, -2.5, -0.003, -7.25, 0.0, -1e-6, -13.5, -0.5, -0.3333, -4.0]
SCRIPT = {
    "name": "node-check",
    "tokenizer": None,
    "vocab_size": 512,
    "delay_seconds": 0.005,  # a token at a time, as an engine decodes: a message each
    "cycle": True,
    "outputs": [{"token_ids": TOKENS, "logprobs": LOGPROBS}],
}


@pytest.fixture(scope="module")
def node_client() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("the Node.js client test needs node and npm on PATH")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NODE_DIR, check=True, timeout=300
        )
    return NODE_DIR / "generate_client.js"


def as_float32(value: float) -> float:
    """What a proto `float` carries for this value."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


async def run_node(script: Path, port: int, request: dict) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        "node",
        str(script),
        f"127.0.0.1:{port}",
        json.dumps(request),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, stdout.decode(), stderr.decode()


async def test_node_client_receives_the_engines_tokens_and_logprobs(node_client):
    engine = ScriptedEngine.from_script(SCRIPT)
    server, port = await start_server(engine)
    try:
        code, out, err = await run_node(
            node_client, port, {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 50}}
        )
        assert code == 0, err
        result = json.loads(out)
        assert result["token_ids"] == TOKENS
        assert result["logprobs"] == [as_float32(x) for x in LOGPROBS]
        assert result["messages"] == 10  # the last one with the end
        assert result["policy_versions"] == [0] * 10
        assert result["finish_reason"] == "FINISH_REASON_STOP"
        assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "cached_prompt_tokens": 0}

        code, out, err = await run_node(node_client, port, {"prompt_token_ids": [1], "sampling": {"max_tokens": 4}})
        assert code == 0, err
        result = json.loads(out)
        assert result["token_ids"] == TOKENS[:4] and result["finish_reason"] == "FINISH_REASON_LENGTH"

        code, out, err = await run_node(
            node_client, port, {"prompt_token_ids": [1, 512], "sampling": {"max_tokens": 4}}
        )
        assert code == 1 and out == ""
        error = json.loads(err)
        assert error["code"] == "INVALID_ARGUMENT" and "prompt_token_ids[1] = 512" in error["details"]
    finally:
        await server.stop(None)
        await engine.stop()
