"""For the weight-sync tests: a tiny-model inference server of the test's own process, on a loopback
port, with what the tests read from it (greedy tokens and their policy versions, parameters)."""

from __future__ import annotations

import grpc
import torch

from polar.inference.engines import EngineOptions, create_engine
from polar.inference.server import start_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

PROMPT = (1, 9690, 28, 905)


class TinyServer:
    """The tiny model on the CPU in fp32, served by an InferenceService of this process."""

    async def start(self, policy_version: int = 0, port: int = 0) -> TinyServer:
        """Serve on `port` (0: a free one)."""
        options = EngineOptions(
            model="tiny", device="cpu", dtype="float32", max_batch_size=2, policy_version=policy_version
        )
        self.engine = create_engine("torch", options)
        self.server, port = await start_server(self.engine, f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.engine.stop()

    async def info(self) -> inference_pb2.ModelInfo:
        return (await self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).model_info

    async def greedy(self, max_tokens: int = 8) -> tuple[list[int], set[int]]:
        """A greedy reply to PROMPT: its tokens, and the policy versions they were sampled under."""
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        messages = [m async for m in self.stub.Generate(request)]
        return [t for m in messages for t in m.token_ids], {m.policy_version for m in messages if m.token_ids}

    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.engine.model.named_parameters())


def new_weights(server: TinyServer, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the server's parameter shapes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(spec.shape, generator=generator) * 0.5
        for name, spec in server.engine.parameter_specs().items()
    }
