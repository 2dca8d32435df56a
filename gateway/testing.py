"""A real gateway over a real inference server, on free loopback ports, for tests (like httpx's MockTransport).

    async with running_gateway({"outputs": [{"text": "Hello!"}]}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=gw.key)
        ...
        [record] = gw.records()

`script` is a scripted-engine script (see polar/inference/engines/scripted.py: outputs by order or by
prompt regex; text outputs end with `<|im_end|>`); its tokenizer defaults to the `tiny` model's, which
the gateway loads too. Or pass any `engine` (e.g. the tiny torch engine). Nothing is faked: only the
model is scripted.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.dialects.base import Dialect
from gateway.render import History
from gateway.server import RunningGateway, start_gateway
from polar.inference.engines.base import Engine
from polar.inference.engines.scripted import ScriptedEngine
from polar.inference.server import start_server
from polar.v1 import common_pb2

STOP_GRACE_SECONDS = 1.0


@dataclass
class GatewayHandle:
    """The running gateway, its inference server, and one open session."""

    running: RunningGateway
    inference_address: str
    inference_server: grpc.aio.Server
    engine: Engine
    key: str  # the session opened at start

    @property
    def base_url(self) -> str:
        """e.g. http://127.0.0.1:PORT (append /v1 for the OpenAI SDK)."""
        return self.running.base_url

    @property
    def grpc_address(self) -> str:
        """host:port of the GatewayService."""
        return self.running.grpc_address

    def open_session(self, *, task_id: str = "", history: History | None = None) -> str:
        """A new session's key."""
        return self.running.store.open(task_id=task_id, history=history).key

    def close_session(self, key: str | None = None) -> None:
        self.running.store.close(key or self.key)

    async def stop_inference(self) -> None:
        """Take the inference server down (the gateway keeps running and must answer OVERLOADED)."""
        await self.inference_server.stop(0)

    def records(self, key: str | None = None) -> list[common_pb2.CallRecord]:
        """The session's call records (default: the session opened at start), in arrival order."""
        return self.running.store.find(key or self.key).ordered_records()


@contextlib.asynccontextmanager
async def running_gateway(
    script: Mapping[str, Any] | None = None,
    *,
    engine: Engine | None = None,
    history: History = "faithful",
    chat_format: str = "hermes",
    parser: str = "hermes",
    dialects: Mapping[str, Dialect] | None = None,
) -> AsyncIterator[GatewayHandle]:
    """Start an inference server (the scripted engine for `script`, or `engine`) and a gateway over it.

    `dialects` serve their names' routes instead of the registry's modules (a test's own dialect).
    """
    if engine is None:
        engine = ScriptedEngine.from_script(script if script is not None else {"outputs": []})
    elif script is not None:
        raise ValueError("give a script or an engine, not both")
    inference_server, port = await start_server(engine, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        running = await start_gateway(
            address, chat_format=chat_format, parser=parser, history=history, dialects=dialects
        )
        try:
            key = running.store.open(task_id="test").key
            yield GatewayHandle(running, address, inference_server, engine, key)
        finally:
            await running.stop()
    finally:
        await inference_server.stop(STOP_GRACE_SECONDS)
        await engine.stop()
