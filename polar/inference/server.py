"""The gRPC InferenceService (protos/polar/v1/inference.proto) over one engine.

The servicer is thin: requests are checked by `validation`, weight streams assembled by `weights`,
admission during a pause is `AdmissionGate`, and sampling is the engine's. Typed exceptions from
those become gRPC status codes here, and only here:

    InvalidRequest     -> INVALID_ARGUMENT        UnknownModel -> NOT_FOUND
    WeightUpdateError  -> INVALID_ARGUMENT        engine failure during Generate -> INTERNAL
    WeightsFixed       -> FAILED_PRECONDITION     (an engine whose weights another server holds)

`serve_inference` is `polar serve inference`: the engine an `InferenceConfig` names, served until
SIGINT or SIGTERM. `start_server` also serves gRPC health checking and server reflection (so grpcurl can list and call
the service without the protos).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from polar.inference.engines.base import Engine, FinishReason, GenerationEnd, TokenChunk, WeightsFixed, WeightUpdateError
from polar.inference.validation import InvalidRequest, UnknownModel, validate_generate
from polar.inference.weights import WeightsAssembler
from polar.config import InferenceConfig
from polar.credentials import NODE, OPERATOR, TRAINER
from polar.grpc_server import bind, callers, new_server, serve_until_stopped, set_serving, status_codes
from polar.read_ahead import ReadAhead
from polar.service import Ready, ServiceError, join_host_port
from polar.v1 import inference_pb2, inference_pb2_grpc

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
# Weight chunks are sent whole in one message; 64 MiB leaves room for large chunks of big tensors.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How long `serve` lets running calls finish after a stop signal before cancelling them.
STOP_GRACE_SECONDS = 5.0


class AdmissionGate:
    """Counts Generate calls in flight and holds new ones while paused."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self.paused = False
        self.in_flight = 0  # calls admitted and not yet finished
        self.waiting = 0  # calls held by the pause

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Wait while paused, then count the caller in flight until it leaves."""
        async with self._changed:
            if self.paused:
                self.waiting += 1
                try:
                    await self._changed.wait_for(lambda: not self.paused)
                finally:
                    self.waiting -= 1
            self.in_flight += 1
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= 1
                self._changed.notify_all()

    async def pause(self) -> int:
        """Stop admitting, wait for the calls in flight; return how many were waited for."""
        async with self._changed:
            self.paused = True
            drained = self.in_flight
            # A Resume during the drain ends the wait: the pause it would complete is over.
            await self._changed.wait_for(lambda: self.in_flight == 0 or not self.paused)
            return drained

    async def resume(self) -> int:
        """Admit again; return how many held calls this releases."""
        async with self._changed:
            admitted = self.waiting if self.paused else 0
            self.paused = False
            self._changed.notify_all()
            return admitted


class EngineFailed(RuntimeError):
    """The engine failed during a generation (INTERNAL); the message says how."""


# Who may call what (polar.credentials): only the trainer and the operator change the weights or
# hold generation.
@callers(
    {
        "Generate": (NODE, TRAINER, OPERATOR),
        "GetModelInfo": (NODE, TRAINER, OPERATOR),
        "UpdateWeights": (TRAINER, OPERATOR),
        "Pause": (TRAINER, OPERATOR),
        "Resume": (TRAINER, OPERATOR),
    }
)
@status_codes(
    {
        UnknownModel: grpc.StatusCode.NOT_FOUND,
        InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
        WeightUpdateError: grpc.StatusCode.INVALID_ARGUMENT,
        WeightsFixed: grpc.StatusCode.FAILED_PRECONDITION,
        EngineFailed: grpc.StatusCode.INTERNAL,
    }
)
class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Serves one engine; see InferenceService in inference.proto for each rpc's contract."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._gate = AdmissionGate()

    # Server-streaming.
    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        generation = validate_generate(request, self._engine.description)
        async with self._gate.admitted():
            stream = self._engine.generate(generation)
            produced = ReadAhead(stream)
            try:
                last, error = await _relay(
                    produced, context, self._engine.policy_version, request.message_interval_seconds
                )
            finally:
                # A client that went away cancels this task; closing the stream frees its slot now.
                await produced.aclose()
                await _close(stream)
        if error is not None:
            raise EngineFailed(error)
        await context.write(last)

    # Client-streaming.
    async def UpdateWeights(
        self, request_iterator: AsyncIterator[inference_pb2.UpdateWeightsRequest], context: grpc.aio.ServicerContext
    ) -> inference_pb2.UpdateWeightsResponse:
        assembler = WeightsAssembler(self._engine.parameter_specs())
        problem: WeightUpdateError | WeightsFixed | None = None
        if self._engine.fixed_weights:
            problem = WeightsFixed(self._engine.fixed_weights)
        async for message in request_iterator:
            if problem is not None:
                # A status sent while the client is still writing reaches grpc clients as INTERNAL
                # ("Internal error from Core"), not as ours; so the rest of a bad stream is read
                # and dropped unchecked, and the status goes out once the client is done.
                continue
            try:
                assembler.add(message)
            except WeightUpdateError as exc:
                problem = exc
                assembler = WeightsAssembler({})  # frees the bytes received so far
        if problem is None:
            try:
                tensors = assembler.finish()
            except WeightUpdateError as exc:
                problem = exc
        if problem is not None:
            raise problem
        started = time.perf_counter()
        # The stream is complete, so the update must land whole even if the client now leaves.
        version = await asyncio.shield(self._engine.update_weights(tensors))
        return inference_pb2.UpdateWeightsResponse(
            policy_version=version,
            tensors_updated=len(tensors),
            bytes_received=assembler.bytes_received,
            apply_seconds=time.perf_counter() - started,
        )

    # Unary.
    async def Pause(self, request: inference_pb2.PauseRequest, context: grpc.aio.ServicerContext) -> inference_pb2.PauseResponse:
        return inference_pb2.PauseResponse(drained=await self._gate.pause())

    # Unary.
    async def Resume(
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ResumeResponse:
        return inference_pb2.ResumeResponse(admitted=await self._gate.resume())

    # Unary.
    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        d = self._engine.description
        return inference_pb2.GetModelInfoResponse(
            model_info=inference_pb2.ModelInfo(
                name=d.name,
                vocab_size=d.vocab_size,
                eos_token_ids=d.eos_token_ids,
                end_of_turn_token_id=d.end_of_turn_token_id,
                bos_token_id=d.bos_token_id,
                chat_template=d.chat_template,
                context_length=d.context_length,
                policy_version=self._engine.policy_version,
                engine=d.engine,
                dtype=d.dtype,
                device=d.device,
                parameter_count=d.parameter_count,
                paused=self._gate.paused,
                tokenizer_path=d.tokenizer_path,
            )
        )


async def _relay(
    produced: ReadAhead[TokenChunk | GenerationEnd],
    context: grpc.aio.ServicerContext,
    policy_version: int,
    interval_s: float = 0.0,
) -> tuple[inference_pb2.GenerateResponse, str | None]:
    """Write the engine's tokens to the client as they come; return the stream's last message (the
    end, with the tokens that came with it) for the caller to send, and the error text if the engine
    failed instead.

    Tokens the engine produced while the previous message was being sent go out together in the next
    one (per policy version, which a message states for all its tokens): an engine faster than its
    client costs one message per batch instead of one per token, and one that decodes a token at a
    time still streams each token as it comes. Nothing is held back for later tokens, unless the
    request asks for at most one message per interval: after a message, the next then waits out the
    interval or the generation's end, whichever comes first."""
    batches = aiter(produced)
    while True:
        try:
            batch = await anext(batches)
        except StopAsyncIteration:
            return inference_pb2.GenerateResponse(), "the engine's stream ended without a GenerationEnd"
        except Exception as exc:  # noqa: BLE001 - any engine failure becomes the call's INTERNAL status
            return inference_pb2.GenerateResponse(), f"engine failed: {type(exc).__name__}: {exc}"
        end = next((item for item in batch if isinstance(item, GenerationEnd)), None)
        messages = _token_messages(item for item in batch if isinstance(item, TokenChunk))
        if messages:
            policy_version = messages[-1].policy_version
        last = None
        if end is not None and end.finish_reason is not FinishReason.ERROR:
            # The end travels with the tokens that came with it.
            last = messages.pop() if messages else inference_pb2.GenerateResponse(policy_version=policy_version)
            last.finish_reason = end.finish_reason.value
            last.usage.prompt_tokens, last.usage.completion_tokens = end.prompt_tokens, end.completion_tokens
            last.queue_seconds = end.queue_seconds
        for message in messages:
            await context.write(message)
        if last is not None:
            return last, None
        if end is not None:
            return inference_pb2.GenerateResponse(), end.error or "the engine failed without a message"
        if interval_s and messages:
            await produced.until_ended(interval_s)


def _token_messages(chunks: Iterable[TokenChunk]) -> list[inference_pb2.GenerateResponse]:
    """Consecutive chunks as one message per run of the same policy version."""
    messages: list[inference_pb2.GenerateResponse] = []
    for chunk in chunks:
        if not messages or messages[-1].policy_version != chunk.policy_version:
            messages.append(inference_pb2.GenerateResponse(policy_version=chunk.policy_version))
        messages[-1].token_ids.extend(chunk.token_ids)
        messages[-1].logprobs.extend(chunk.logprobs)
    return messages


async def _close(stream: AsyncIterator[TokenChunk | GenerationEnd]) -> None:
    # Engines written as async generators have aclose(); other async iterators have nothing to close.
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def start_server(engine: Engine, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """Start the engine and a gRPC server for it on `address`; return the server and bound port."""
    server, health_servicer = new_server(SERVICE_NAME, InferenceServicer.roles, max_message_bytes=MAX_MESSAGE_BYTES)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(engine), server)
    port = bind(server, address, "the inference server")
    await engine.start()
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
    return server, port


async def serve(engine: Engine, address: str, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until cancelled or SIGINT/SIGTERM, then stop gracefully and stop the engine."""
    server, port = await start_server(engine, address)

    async def stop() -> None:
        await server.stop(STOP_GRACE_SECONDS)
        await engine.stop()

    await serve_until_stopped(port, stop, on_ready)


def upstream_settings(config: InferenceConfig) -> dict[str, str]:
    """The upstream engine's settings (polar.inference.engines.upstream) from [inference]."""
    return {
        "url": config.upstream_url,
        "api": config.upstream_api,
        "served_model": config.upstream_model,
        "timeout_s": str(config.upstream_timeout_s),
    }


async def serve_inference(config: InferenceConfig, ready: Ready) -> None:
    """`polar serve inference`: the engine config names, served on its host and port until
    SIGINT/SIGTERM."""
    from polar.inference.engines import EngineOptions, create_engine

    options = EngineOptions(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        script=config.script,
        policy_version=config.policy_version,
        extra=upstream_settings(config) if config.engine == "upstream" else {},
    )

    def on_ready(port: int) -> None:
        d = engine.description
        where = f", {d.device}" if d.device else ""
        ready(port, f"inference: serving {d.name} ({d.engine} engine{where}) on {join_host_port(config.host, port)}")

    from polar.inference.engines.upstream import UpstreamError

    try:
        engine = create_engine(config.engine, options)
        await serve(engine, join_host_port(config.host, config.port), on_ready)
    except UpstreamError as exc:
        raise ServiceError(str(exc)) from None
    except ModuleNotFoundError as exc:
        # Engines import their framework lazily (vLLM only when started); vLLM lives in its own
        # environment because its pins would constrain the main one.
        hint = "; scripts/setup_vllm.sh builds .venv-vllm, whose bin/polar has it" if config.engine == "vllm" else ""
        raise ServiceError(f"the {config.engine} engine needs the {exc.name!r} package, not installed here{hint}") from exc
