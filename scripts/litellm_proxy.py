"""LiteLLM's proxy, the gateway benchmarks' comparison, and the scripted backend behind it.

    load ──HTTP──▶ LiteLLM proxy ──HTTP──▶ scripted backend        (the comparison)
    load ──HTTP──▶ scripted backend                                 (LiteLLM's baseline)

The backend is a small aiohttp OpenAI-compatible server with the scripted engine's reply, whole or as
one chat chunk per token, written at once from pre-encoded bytes. LiteLLM runs from its own virtual
environment (.venv-litellm; create it with `python3 -m venv .venv-litellm && .venv-litellm/bin/pip
install 'litellm[proxy]'`); without it, or if it fails to start, `error` says why and Polar's figures
stand alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from polar.service_base import listening_socket

import benchmark_common
from gateway_stack import MAX_TOKENS, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, SYSTEM_PROMPT, USER_PROMPT
from http_client import http_request

LITELLM_VENV = benchmark_common.ROOT / ".venv-litellm"
LITELLM_MODEL = "bench"  # the model name clients send to LiteLLM, routed to the scripted backend
LITELLM_DIALECTS = ("openai_chat", "anthropic")  # what its proxy translates to chat completions here


class LiteLLM:
    """LiteLLM's proxy (from .venv-litellm) in front of the scripted backend, both started here."""

    def __init__(self) -> None:
        self.error = ""
        self.version = ""
        self.address = ""
        self.backend = ""
        self.key = "sk-" + secrets.token_hex(24)
        self.pids: dict[str, int] = {}
        self._process: subprocess.Popen | None = None
        self._log: Path | None = None
        self._started = 0.0
        self.startup_s = 0.0  # from its start until it answered /health/liveliness

    @classmethod
    @contextlib.contextmanager
    def started(cls, scratch: Path, pieces: list[str]) -> Iterator[LiteLLM]:
        proxy = cls()
        binary = LITELLM_VENV / "bin" / "litellm"
        if not binary.exists():
            proxy.error = (
                f"{binary.relative_to(benchmark_common.ROOT)} is missing: create it with `python3 -m venv .venv-litellm && "
                ".venv-litellm/bin/pip install 'litellm[proxy]'`"
            )
            yield proxy
            return
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        backend = context.Process(target=_backend_main, args=(child, pieces), daemon=True)
        backend.start()
        try:
            proxy.backend = f"127.0.0.1:{parent.recv()}"
            proxy.pids["backend"] = backend.pid
            proxy._start(scratch, binary)
            yield proxy
        finally:
            if proxy._process is not None:
                proxy._process.terminate()
                try:
                    proxy._process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proxy._process.kill()
                    proxy._process.wait()
            parent.send(None)
            backend.join(STOP_TIMEOUT_S)

    def _start(self, scratch: Path, binary: Path) -> None:
        version = subprocess.run(
            [str(LITELLM_VENV / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.version = version.stdout.strip()
        config = scratch / "litellm.yaml"
        # JSON is YAML. One model routed to the backend; no retries, no callbacks, no stored logs.
        config.write_text(
            json.dumps(
                {
                    "model_list": [
                        {
                            "model_name": LITELLM_MODEL,
                            "litellm_params": {
                                "model": f"openai/{LITELLM_MODEL}",
                                "api_base": f"http://{self.backend}/v1",
                                "api_key": "sk-bench",
                            },
                        }
                    ],
                    "litellm_settings": {
                        "num_retries": 0,
                        "request_timeout": 60,
                        "telemetry": False,
                        "callbacks": [],
                        # Anthropic Messages → chat completions, the translation measured here (for
                        # "openai/" models LiteLLM would otherwise call the Responses API).
                        "use_chat_completions_url_for_anthropic_messages": True,
                    },
                    # It refuses to start without a master key; with one and no database, checking
                    # a request's key is a comparison, as the gateway's lookup is.
                    "general_settings": {
                        "master_key": self.key,
                        "disable_spend_logs": True,
                        "disable_error_logs": True,
                    },
                    "router_settings": {"num_retries": 0},
                }
            )
        )
        # LiteLLM binds the port it is given itself: one free now, which nothing else here binds.
        with listening_socket("127.0.0.1") as probe:
            port = probe.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        env = dict(os.environ)
        env.update(
            LITELLM_LOCAL_MODEL_COST_MAP="True",  # its price list from the wheel, not the network
            LITELLM_TELEMETRY_DISABLED="true",
            LITELLM_LOG="ERROR",
            NO_PROXY="127.0.0.1,localhost",
        )
        self._log = scratch / "litellm.log"
        self._started = time.monotonic()
        self._process = subprocess.Popen(
            [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
            stdin=subprocess.DEVNULL,
            stdout=self._log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=scratch,
        )

    def wait_ready(self) -> None:
        """Wait for its readiness endpoint; on failure, set `error` with its log's tail."""
        assert self._process is not None and self._log is not None
        deadline = self._started + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = self._log.read_text(errors="replace").strip().splitlines()[-5:]
                self.error = f"litellm exited with code {self._process.returncode}: " + " | ".join(tail)
                return
            try:
                with urllib.request.urlopen(f"http://{self.address}/health/liveliness", timeout=2) as response:
                    if response.status == 200:
                        self.pids["litellm"] = self._process.pid
                        self.startup_s = time.monotonic() - self._started
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.error = f"litellm did not answer /health/liveliness within {STARTUP_TIMEOUT_S:g} s"


def backend_request(stream: bool, address: str) -> bytes:
    """What LiteLLM sends its backend for the Anthropic request (what its baseline sends directly)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_PROMPT}]
    body = {"model": LITELLM_MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
    return http_request(address, "/v1/chat/completions", {"Authorization": "Bearer sk-bench"}, body)


def _backend_main(conn: Connection, pieces: list[str]) -> None:
    """LiteLLM's upstream: an OpenAI-compatible chat completions server with a fixed reply."""
    from aiohttp import web

    created = int(time.time())
    usage = {"prompt_tokens": 20, "completion_tokens": len(pieces) + 1, "total_tokens": 21 + len(pieces)}
    message = {"role": "assistant", "content": "".join(pieces)}
    whole = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": created,
            "model": LITELLM_MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": usage,
        }
    ).encode()

    def chunk(delta: dict, finish: str | None, **extra) -> bytes:
        body = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": created,
            "model": LITELLM_MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    # One event per token, all there at once as the scripted engine's tokens are: written together.
    events = [chunk({"role": "assistant", "content": pieces[0]}, None)]
    events += [chunk({"content": piece}, None) for piece in pieces[1:]]
    events += [chunk({}, "stop", usage=usage), b"data: [DONE]\n\n"]
    stream = b"".join(events)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=whole, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write_eof(stream)
        return response

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        app.router.add_post("/chat/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(runner.addresses[0][1])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # anything: stop
        await runner.cleanup()

    asyncio.run(serve())
