"""A real gateway over a real inference server, on free loopback ports, for tests (like httpx's MockTransport).

    async with running_gateway({"outputs": [{"text": "Hello!"}]}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=gw.key)
        ...
        [record] = gw.records()

`script` is a scripted-engine script (see polar/inference/engines/scripted.py: outputs by order or by
prompt regex; text outputs end with `<|im_end|>`); its tokenizer defaults to the `tiny` model's, which
the gateway loads too. Or pass any `engine` (e.g. the tiny torch engine). Nothing is faked: only the
model is scripted.

By default the real Envoy stands where `polar up` puts it: `base_url` is its harness listener, in front
of the gateway's HTTP port, and the gateway's gRPC calls reach the inference server through its
inference listener. `envoy=False` leaves Envoy out, for tests of what only the gateway itself does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.dialects.base import Dialect
from gateway.render import History
from gateway.server import RunningGateway, start_gateway
from polar.config import EnvoyConfig, GatewayConfig
from polar.envoy import RunningEnvoy, running_async
from polar.inference.engines.base import Engine
from polar.inference.engines.scripted import ScriptedEngine
from polar.inference.server import start_server
from polar.sampling_policy import NO_POLICY, SamplingPolicy
from polar.service_base import join_host_port, listening_socket
from polar.v1 import common_pb2

STOP_GRACE_SECONDS = 1.0
HOST = "127.0.0.1"
# One worker thread is plenty for a test's traffic; the access log is not read by tests (records are).
TEST_ENVOY = EnvoyConfig(harness_port=0, inference_port=0, admin_port=0, workers=1, access_log="/dev/null")


@dataclass
class GatewayHandle:
    """The running gateway, its inference server, and one open session."""

    running: RunningGateway
    inference_address: str
    inference_server: grpc.aio.Server
    engine: Engine
    key: str  # the session opened at start
    envoy: RunningEnvoy | None  # None when the gateway was started without Envoy

    @property
    def base_url(self) -> str:
        """What harnesses use, e.g. http://127.0.0.1:PORT (append /v1 for the OpenAI SDK): Envoy's
        harness listener, or the gateway's own HTTP address without Envoy."""
        return self.running.base_url

    @property
    def grpc_address(self) -> str:
        """host:port of the GatewayService."""
        return self.running.grpc_address

    def open_session(
        self, *, task_id: str = "", history: History | None = None, sampling: SamplingPolicy = NO_POLICY
    ) -> str:
        """A new session's key; `sampling` is its task's policy."""
        return self.running.store.open(task_id=task_id, history=history, sampling=sampling).key

    def close_session(self, key: str | None = None) -> None:
        self.running.store.close(key or self.key)

    async def stop_inference(self) -> None:
        """Take the inference server down (the gateway keeps running and must answer OVERLOADED)."""
        await self.inference_server.stop(0)

    async def restart_inference(self) -> None:
        """Serve the engine again on the inference server's address, after `stop_inference`."""
        self.inference_server, _ = await start_server(self.engine, self.inference_address)

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
    envoy: bool = True,
    settings: Mapping[str, Any] | None = None,
    stop_engine: bool = True,
) -> AsyncIterator[GatewayHandle]:
    """Start an inference server (the scripted engine for `script`, or `engine`), Envoy (unless
    `envoy` is false) and a gateway over them; stop them in reverse order.

    `dialects` serve their names' routes instead of the registry's modules (a test's own dialect);
    `settings` are GatewayConfig fields over the test's (e.g. {"token_timeout_s": 0.5}).
    `stop_engine=False` leaves a given `engine` running at the end, for a caller that shares it.
    """
    if engine is None:
        engine = ScriptedEngine.from_script(script if script is not None else {"outputs": []})
    elif script is not None:
        raise ValueError("give a script or an engine, not both")
    async with contextlib.AsyncExitStack() as stack:
        if stop_engine:
            stack.push_async_callback(engine.stop)
        inference_server, port = await start_server(engine, f"{HOST}:0")
        handle: GatewayHandle | None = None

        async def stop_inference_server() -> None:
            # The handle's, which restart_inference may have replaced.
            await (handle.inference_server if handle is not None else inference_server).stop(STOP_GRACE_SECONDS)

        stack.push_async_callback(stop_inference_server)
        address = join_host_port(HOST, port)
        gateway_inference, http_socket, base_url, proxy = address, None, "", None
        if envoy:
            # Envoy starts first (the gateway asks inference for its model through it), so the
            # gateway's HTTP port is bound before either starts, as `polar up` does.
            http_socket = stack.enter_context(listening_socket(HOST))  # the gateway closes it too
            gateway_http = join_host_port(HOST, http_socket.getsockname()[1])
            proxy = await stack.enter_async_context(running_async(TEST_ENVOY, [address], gateway_http))
            gateway_inference = join_host_port(HOST, proxy.inference_port)
            base_url = "http://" + join_host_port(HOST, proxy.harness_port)
        config = GatewayConfig(
            host=HOST,
            port=0,
            grpc_port=0,
            chat_format=chat_format,
            parser=parser,
            history=history,
            inference_address=gateway_inference,
            base_url=base_url,
        )
        config = dataclasses.replace(config, **(settings or {}))
        running = await start_gateway(config, http_socket=http_socket, dialects=dialects)
        stack.push_async_callback(running.stop)
        key = running.store.open(task_id="test").key
        handle = GatewayHandle(running, address, inference_server, engine, key, proxy)
        yield handle
