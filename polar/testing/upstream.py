"""A fake upstream for the upstream engine's tests: an aiohttp server speaking vLLM's completions
protocol (``GET /v1/models``, ``POST /tokenize``, ``POST /v1/completions``) and SGLang's
(``GET /get_model_info``, ``POST /generate``), driven by a real tokenizer.

    async with fake_upstream("smollm2-135m", reply="Hello there.") as upstream:
        engine = UpstreamEngine(EngineOptions(model="smollm2-135m", extra={"url": upstream.url}))

Its replies are `reply` encoded by the tokenizer plus the end-of-turn token, one token per event when
streaming, the i-th with logprob ``-(i + 1) / 100`` (so a test can tell each token's logprob from
the others), cut at max_tokens and at the first stop id. What it is asked is kept in `requests`; a
client that goes away mid-stream is counted in `disconnects`, a stream sent to its end in `finished`. Faults, set on the handle: `status`
(answer generations with this HTTP error), `delay_s` (wait before each token), `vocab_size` and
`encode_offset` (a tokenizer that is not the served one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from polar.inference import models

HOST = "127.0.0.1"


@dataclass
class FakeUpstream:
    url: str
    name: str
    tokenizer: Any
    reply: str
    vocab_size: int
    context_length: int = 8192
    status: int = 0  # answer generations with this HTTP status (0: serve them)
    delay_s: float = 0.0  # wait before each token
    encode_offset: int = 0  # added to every id /tokenize and the probe return: another tokenizer
    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnects: int = 0
    finished: int = 0  # streams sent to their end

    def reply_ids(self) -> list[int]:
        ids = list(self.tokenizer.encode(self.reply, add_special_tokens=False))
        return ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _logprob(i: int) -> float:
    return -(i + 1) / 100


def _sample(
    upstream: FakeUpstream, prompt: list[int], max_tokens: int, stops: set[int], ignore_eos: bool
) -> tuple[list[int], str]:
    ids = upstream.reply_ids()
    if not ignore_eos:
        stops = stops | {upstream.tokenizer.eos_token_id}
    out = []
    for token in ids[:max_tokens]:
        out.append(token)
        if token in stops:
            return out, "stop"
    return out, "length" if len(out) >= max_tokens else "stop"


def _bad_prompt(upstream: FakeUpstream, prompt: Any) -> str:
    if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
        return "prompt must be a list of token ids"
    bad = [t for t in prompt if not 0 <= t < upstream.vocab_size]
    return f"Token id {bad[0]} is out of vocabulary" if bad else ""


def _app(upstream: FakeUpstream) -> web.Application:
    async def models_list(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": upstream.name, "root": upstream.name, "max_model_len": upstream.context_length}],
            }
        )

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        ids = upstream.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return web.json_response({"tokens": [t + upstream.encode_offset for t in ids], "count": len(ids)})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": upstream.name, "tokenizer_path": upstream.name, "is_generation": True})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.requests.append(body)
        problem = _bad_prompt(upstream, body.get("prompt"))
        if problem:
            return web.json_response(
                {"error": {"message": problem, "type": "BadRequestError", "code": 400}}, status=400
            )
        if upstream.status:
            return web.json_response(
                {"error": {"message": "the fake upstream fails", "code": upstream.status}}, status=upstream.status
            )
        ids, reason = _sample(
            upstream,
            body["prompt"],
            body["max_tokens"],
            set(body.get("stop_token_ids") or ()),
            body.get("ignore_eos", False),
        )

        def choice(part: list[int], start: int, finish: str | None) -> dict[str, Any]:
            return {
                "index": 0,
                "text": upstream.tokenizer.decode(part),
                "logprobs": {
                    "tokens": [f"token_id:{t}" for t in part],
                    "token_logprobs": [_logprob(start + i) for i in range(len(part))],
                },
                "finish_reason": finish,
            }

        if not body.get("stream"):
            await asyncio.sleep(upstream.delay_s * len(ids))
            return web.json_response(
                {"id": "cmpl-fake", "object": "text_completion", "choices": [choice(ids, 0, reason)]}
            )
        return await _stream(
            request,
            upstream,
            [{"choices": [choice([t], i, reason if i == len(ids) - 1 else None)]} for i, t in enumerate(ids)],
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.requests.append(body)
        if "text" in body:  # the probe: the prompt's ids come back as its logprobs
            ids = upstream.tokenizer.encode(body["text"], add_special_tokens=True)
            entries = [[None, t + upstream.encode_offset, None] for t in ids]
            return web.json_response(
                {"text": "", "meta_info": {"input_token_logprobs": entries, "output_token_logprobs": []}}
            )
        problem = _bad_prompt(upstream, body.get("input_ids"))
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)
        if upstream.status:
            return web.json_response({"error": {"message": "the fake upstream fails"}}, status=upstream.status)
        params = body["sampling_params"]
        ids, reason = _sample(
            upstream,
            body["input_ids"],
            params["max_new_tokens"],
            set(params.get("stop_token_ids") or ()),
            params.get("ignore_eos", False),
        )

        def event(count: int) -> dict[str, Any]:
            entries = [[_logprob(i), t, None] for i, t in enumerate(ids[:count])]
            finish = {"type": reason} if count == len(ids) else None
            return {
                "text": upstream.tokenizer.decode(ids[:count]),
                "meta_info": {"output_token_logprobs": entries, "finish_reason": finish},
            }

        if not body.get("stream"):
            return web.json_response(event(len(ids)))
        return await _stream(request, upstream, [event(n) for n in range(1, len(ids) + 1)])

    app = web.Application()
    app.router.add_get("/v1/models", models_list)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/generate", generate)
    return app


async def _stream(request: web.Request, upstream: FakeUpstream, events: list[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        for event in events:
            await asyncio.sleep(upstream.delay_s)
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        upstream.disconnects += 1
        raise
    upstream.finished += 1
    return response


@functools.lru_cache(maxsize=4)
def _tokenizer_and_vocab(model: str) -> tuple[Any, int]:
    from transformers import AutoConfig, AutoTokenizer

    folder = models.resolve_model(model)
    return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder).vocab_size


@contextlib.asynccontextmanager
async def fake_upstream(
    model: str = "smollm2-135m", *, reply: str = "Hello there.", name: str = "fake-model"
) -> AsyncIterator[FakeUpstream]:
    """The fake upstream serving `model`'s tokenizer on a free loopback port."""
    tokenizer, vocab_size = _tokenizer_and_vocab(model)
    upstream = FakeUpstream(url="", name=name, tokenizer=tokenizer, reply=reply, vocab_size=vocab_size)
    runner = web.AppRunner(_app(upstream), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    upstream.url = f"http://{HOST}:{port}"
    try:
        yield upstream
    finally:
        await runner.cleanup()
