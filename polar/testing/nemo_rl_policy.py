"""A stand-in for the vLLM HTTP server NeMo RL exposes for NeMo Gym (``vllm_cfg.expose_http_server``),
in front of a real vLLM OpenAI server that does the sampling: the upstream engine's ``nemo_rl`` API
tested without a NeMo RL run.

It keeps NeMo RL's contract (its ``vllm_worker_async.py``, the server its async vLLM workers start):

- Only ``POST /v1/chat/completions`` and ``POST /tokenize`` (no ``GET /v1/models``).
- A chat request's prompt is its messages rendered by the chat template, except that
  ``required_prefix_token_ids`` (less one trailing end-of-sequence id) replaces the rendering up to
  the end-of-sequence token that closes the messages' last assistant turn (or, without one, all of
  them): the ids from that token on are the template's. ``/tokenize`` renders a chat request the
  same way.
- A chat request is refused (HTTP 500, NeMo RL's failed assertion) unless top_k is unset or -1,
  top_p is set, and temperature and top_p are the policy's.
- A whole reply's message carries ``prompt_token_ids``, ``generation_token_ids`` and
  ``generation_log_probs`` (each logprob at least -9999, NeMo RL's floor).

The rendering is vLLM's own ``/tokenize``; the prompt so made is sampled by vLLM's
``/v1/completions`` as ids. Every reply served is kept in `served`.

    with nemo_rl_policy("unix:/path/vllm.sock", "smollm2-135m", temperature=0.7, top_p=1.0) as policy:
        ...  # [inference] upstream_api = "nemo_rl", upstream_url = policy.url
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from polar.inference import models

HOST = "127.0.0.1"
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Served:
    """One reply: the prompt vLLM sampled from, and what it sampled."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


@dataclass
class NeMoRLPolicy:
    url: str
    temperature: float
    top_p: float
    served: list[Served] = field(default_factory=list)


class _Server:
    def __init__(self, policy: NeMoRLPolicy, vllm_url: str, model: str) -> None:
        from transformers import AutoTokenizer

        self.policy = policy
        self.model = model
        self.eos = AutoTokenizer.from_pretrained(models.resolve_model(model)).eos_token_id
        socket = vllm_url[len("unix:") :] if vllm_url.startswith("unix:") else ""
        self.root = "http://localhost" if socket else vllm_url.rstrip("/")
        self.connector = (lambda: aiohttp.UnixConnector(path=socket)) if socket else aiohttp.TCPConnector

    async def vllm(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with session.post(self.root + path, json=body) as response:
            if response.status >= 400:
                refusal = web.HTTPBadRequest if response.status < 500 else web.HTTPInternalServerError
                raise refusal(text=await response.text(), content_type="application/json")
            return await response.json()

    async def render(self, session: aiohttp.ClientSession, request: dict[str, Any]) -> tuple[list[int], int]:
        """A chat request's prompt ids, and vLLM's context length."""
        messages = request["messages"]

        async def tokenize(chosen: list[dict[str, Any]], generation_prompt: bool) -> dict[str, Any]:
            body = {"model": self.model, "messages": chosen, "add_generation_prompt": generation_prompt}
            return await self.vllm(session, "/tokenize", body)

        rendered = await tokenize(messages, request.get("add_generation_prompt", True))
        template, context = rendered["tokens"], rendered["max_model_len"]
        prefix = request.get("required_prefix_token_ids")
        if not prefix:
            return template, context
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        closed = messages[: assistants[-1] + 1] if assistants else messages
        needed = (await tokenize(closed, False))["tokens"].count(self.eos)
        positions = [i for i, t in enumerate(template) if t == self.eos]
        if needed == 0 or len(positions) < needed:
            raise web.HTTPInternalServerError(text="Internal Server Error")
        kept = prefix[:-1] if prefix[-1] == self.eos else prefix
        return list(kept) + template[positions[needed - 1] :], context

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        async with aiohttp.ClientSession(connector=self.connector()) as session:
            if "messages" not in body:
                return web.json_response(await self.vllm(session, "/tokenize", {**body, "model": self.model}))
            tokens, context = await self.render(session, body)
        return web.json_response({"count": len(tokens), "max_model_len": context, "tokens": tokens})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        policy = self.policy
        on_policy = (
            body.get("top_k") in (None, -1)
            and body.get("top_p") is not None
            and body.get("temperature") == policy.temperature
            and body["top_p"] == policy.top_p
        )
        if not on_policy or body.get("stream") or not body.get("logprobs") or body.get("top_logprobs") is None:
            raise web.HTTPInternalServerError(text="Internal Server Error")
        async with aiohttp.ClientSession(connector=self.connector()) as session:
            prompt, _ = await self.render(session, body)
            sampled = await self.vllm(
                session,
                "/v1/completions",
                {
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": body.get("max_tokens"),
                    "temperature": body["temperature"],
                    "top_p": body["top_p"],
                    "seed": body.get("seed"),
                    "stop_token_ids": body.get("stop_token_ids") or [],
                    "ignore_eos": body.get("ignore_eos", False),
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                    "skip_special_tokens": False,
                },
            )
        choice = sampled["choices"][0]
        ids = [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]
        logprobs = [max(float(v), LOGPROB_FLOOR) for v in choice["logprobs"]["token_logprobs"]]
        policy.served.append(Served(prompt, ids, logprobs))
        message = {
            "role": "assistant",
            "content": choice["text"],
            "prompt_token_ids": prompt,
            "generation_token_ids": ids,
            "generation_log_probs": logprobs,
        }
        return web.json_response(
            {
                "id": sampled["id"],
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": choice["finish_reason"]}],
                "usage": sampled["usage"],
            }
        )


@contextlib.contextmanager
def nemo_rl_policy(vllm_url: str, model: str, temperature: float, top_p: float) -> Iterator[NeMoRLPolicy]:
    """The stand-in on a free port of 127.0.0.1, served from a thread of its own (so that a test
    may block on other processes while it answers), over the vLLM server at `vllm_url`
    (``http://HOST:PORT`` or ``unix:PATH``)."""
    policy = NeMoRLPolicy(url="", temperature=temperature, top_p=top_p)
    server = _Server(policy, vllm_url, model)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stopping: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stopping
        stopping = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", server.chat)
        app.router.add_post("/tokenize", server.tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, HOST, 0).start()
        policy.url = f"http://{HOST}:{runner.addresses[0][1]}"
        started.set()
        try:
            await stopping.wait()
        finally:
            await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not started.wait(60):
        raise RuntimeError("the NeMo RL stand-in did not start")
    try:
        yield policy
    finally:
        loop.call_soon_threadsafe(stopping.set)
        thread.join(30)
        loop.close()
