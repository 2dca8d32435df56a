"""The gRPC InferenceService (protos/polar/v1/inference.proto) over one engine.

The servicer is thin: requests are checked by `validation`, weight streams assembled by `weights`,
admission during a pause is `AdmissionGate`, and sampling is the engine's. Typed exceptions from
those become gRPC status codes here, and only here:

    InvalidRequest     -> INVALID_ARGUMENT        UnknownModel -> NOT_FOUND
    WeightUpdateError  -> INVALID_ARGUMENT        engine failure during Generate -> INTERNAL
    NothingStaged, SharingUnavailable -> FAILED_PRECONDITION
    TransportUnavailable -> FAILED_PRECONDITION   CollectiveFailed -> ABORTED (a peer of the group failed)
    GroupNotHeld       -> NOT_FOUND               (a kept weight group this server does not hold)
    WeightsFixed       -> FAILED_PRECONDITION     (an engine whose weights another server holds)

UpdateWeights takes its messages serialized (no request deserializer): `weights` reads each chunk's
bytes straight out of the received message into the staged tensor, which protobuf's parse would
first copy. UpdateWeightsShared reads the tensors from GPU or shared host buffers the trainer shares (`sharing`);
UpdateWeightsCollective receives them by broadcast over the trainer's group, kept between updates
while its members stay the same (`collective`).

`serve_inference` is `polar serve inference`: the engine an `InferenceConfig` names, served until
SIGINT or SIGTERM. `start_server` also serves gRPC health checking and server reflection (so grpcurl can list and call
the service without the protos).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import grpc
import torch

from polar.batched_stream import ReadAhead
from polar.config import InferenceConfig
from polar.credentials import NODE, OPERATOR, TRAINER
from polar.grpc_server import bind, callers, new_server, serve_until_stopped, set_serving, status_codes
from polar.inference import collective, sharing
from polar.inference.engines.base import (
    AdapterExists,
    AdapterInfo,
    AdapterLoad,
    AdaptersFull,
    AdaptersUnsupported,
    Engine,
    FinishReason,
    GenerationEnd,
    TokenChunk,
    UnknownAdapter,
    WeightsFixed,
    WeightUpdateError,
)
from polar.inference.validation import InvalidRequest, UnknownModel, validate_generate
from polar.inference.weights import Header, Staging, WeightsReceiver
from polar.lora import LoraError
from polar.metrics import inference_metrics, start_metrics
from polar.service_base import Ready, ServiceError, advertised, join_host_port
from polar.v1 import inference_pb2, inference_pb2_grpc
from polar.xds.member import UpstreamMember
from polar.xds.snapshot import INFERENCE_CLUSTER

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
# Weight chunks are sent whole in one message; 64 MiB leaves room for large chunks of big tensors.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How long `serve` lets running calls finish after a stop signal before cancelling them.
STOP_GRACE_SECONDS = 5.0


@dataclass
class CallCounts:
    """What the server's Generate calls did, for /metrics."""

    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0

    def finished(self, last: inference_pb2.GenerateResponse) -> None:
        self.completed += 1
        self.prompt_tokens += last.usage.prompt_tokens
        self.completion_tokens += last.usage.completion_tokens
        self.queue_seconds += last.queue_seconds


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


class NothingStaged(RuntimeError):
    """CommitWeights named an update that is not staged (FAILED_PRECONDITION)."""


# Who may call what (polar.credentials): only the trainer and the operator change the weights or
# hold generation.
@callers(
    {
        "Generate": (NODE, TRAINER, OPERATOR),
        "GetModelInfo": (NODE, TRAINER, OPERATOR),
        "UpdateWeights": (TRAINER, OPERATOR),
        "UpdateWeightsShared": (TRAINER, OPERATOR),
        "UpdateWeightsCollective": (TRAINER, OPERATOR),
        "CommitWeights": (TRAINER, OPERATOR),
        "LoadAdapter": (TRAINER, OPERATOR),
        "UnloadAdapter": (TRAINER, OPERATOR),
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
        NothingStaged: grpc.StatusCode.FAILED_PRECONDITION,
        UnknownAdapter: grpc.StatusCode.NOT_FOUND,
        AdaptersUnsupported: grpc.StatusCode.FAILED_PRECONDITION,
        AdapterExists: grpc.StatusCode.ALREADY_EXISTS,
        AdaptersFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
        LoraError: grpc.StatusCode.INVALID_ARGUMENT,
        sharing.SharingUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
        collective.TransportUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
        collective.CollectiveFailed: grpc.StatusCode.ABORTED,
        collective.GroupNotHeld: grpc.StatusCode.NOT_FOUND,
    }
)
class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Serves one engine; see InferenceService in inference.proto for each rpc's contract."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._gate = AdmissionGate()
        self.counts = CallCounts()  # for /metrics (polar.metrics)
        # Updates are received one at a time, into tensors kept between them: the stream's in host
        # memory, the shared GPU buffers' on the engine's device.
        self._receiving = asyncio.Lock()
        # Staged per adapter ("" = the engine's own parameters) and device ("cpu" or the engine's GPU):
        # two runs' updates of one server never write into each other's staged tensors.
        self._stagings: dict[tuple[str, str], Staging] = {}
        self._host_maps = sharing.HostMaps()  # "shm": the trainer's blocks, mapped once
        # adapter -> its update staged under an id: the id, the tensors, their staging, bytes received
        self._staged: dict[str, tuple[str, dict, Staging, int]] = {}
        self._collective_buffers: list = []  # UpdateWeightsCollective's, kept between updates
        self._membership: collective.Membership | None = None  # the trainer's group, kept between updates

    # Server-streaming.
    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        generation = validate_generate(request, self._engine.description)
        version = self._engine.adapter_version(generation.adapter)  # UnknownAdapter before anything starts
        async with self._gate.admitted():
            stream = self._engine.generate(generation)
            produced = ReadAhead(stream)
            try:
                last, error = await _relay(
                    produced,
                    context,
                    version,
                    request.message_interval_seconds,
                )
            finally:
                # A client that went away cancels this task; closing the stream frees its slot now.
                await produced.aclose()
                await _close(stream)
        if error is not None:
            self.counts.failed += 1
            raise EngineFailed(error)
        self.counts.finished(last)
        await context.write(last)

    @property
    def gate(self) -> AdmissionGate:
        return self._gate

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version

    # Client-streaming.
    async def UpdateWeights(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> inference_pb2.UpdateWeightsResponse:
        async with self._receiving:
            receiver = WeightsReceiver(self._specs_of, lambda adapter: self._staging_for(adapter, "cpu"))
            problem: WeightUpdateError | WeightsFixed | UnknownAdapter | None = None
            if self._engine.fixed_weights:
                problem = WeightsFixed(self._engine.fixed_weights)
            async for raw in request_iterator:
                if problem is not None:
                    # A status sent while the client is still writing reaches grpc clients as INTERNAL
                    # ("Internal error from Core"), not as ours; so the rest of a bad stream is read
                    # and dropped unchecked, and the status goes out once the client is done.
                    continue
                try:
                    receiver.add(raw)
                except (WeightUpdateError, UnknownAdapter) as exc:
                    problem = exc
            if problem is None:
                try:
                    tensors = receiver.finish()
                except WeightUpdateError as exc:
                    problem = exc
            if problem is not None:
                raise problem
            return await self._staged_or_applied(receiver, tensors)

    # Bidirectional-streaming.
    async def UpdateWeightsShared(
        self,
        request_iterator: AsyncIterator[inference_pb2.UpdateWeightsSharedRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[inference_pb2.UpdateWeightsSharedResponse]:
        device = torch.device(self._engine.description.device or "cpu")
        async with self._receiving:
            receiver = WeightsReceiver(self._specs_of, lambda adapter: self._staging_for(adapter, str(device)))
            buffers = None
            try:
                async for message in request_iterator:
                    if buffers is None:
                        buffers = sharing.open_header(message, receiver, device, self._host_maps)
                        continue
                    released = sharing.copy_bucket(message, receiver, buffers)
                    yield inference_pb2.UpdateWeightsSharedResponse(buffer_released=released)
                if buffers is None:
                    raise WeightUpdateError("the stream ended without a header")
                tensors = receiver.finish()
            finally:
                del buffers  # the trainer's GPU memory is let go before the call ends
            result = await self._staged_or_applied(receiver, tensors)
        yield inference_pb2.UpdateWeightsSharedResponse(result=result)

    # Bidirectional-streaming.
    async def UpdateWeightsCollective(
        self,
        request_iterator: AsyncIterator[inference_pb2.UpdateWeightsCollectiveRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[inference_pb2.UpdateWeightsCollectiveResponse]:
        device = self._engine.description.device or "cpu"
        async with self._receiving:
            messages = aiter(request_iterator)
            first = await anext(messages, None)
            if first is None or first.WhichOneof("payload") != "header":
                raise WeightUpdateError("the first message of the stream must be a header")
            header = first.header
            collective.check_header(header, weight_transports(device))
            if self._engine.fixed_weights:
                raise WeightsFixed(self._engine.fixed_weights)
            staged_on = device if device.startswith("cuda") else "cpu"
            receiver = WeightsReceiver(self._specs_of, lambda adapter: self._staging_for(adapter, staged_on))
            receiver.header(Header(header.tensor_count, header.note, header.update_id, header.adapter))
            buffers = self._buffers_for(header, collective.buffer_device(header.backend, device))
            membership = self._membership_for(header)
            loop = asyncio.get_running_loop()
            kept = False
            try:
                if membership.group is None:
                    await loop.run_in_executor(membership.thread, membership.join, header, buffers[0].device)
                else:
                    await loop.run_in_executor(membership.thread, membership.ready, header)
                async for message in messages:
                    if message.WhichOneof("payload") != "bucket":
                        raise WeightUpdateError(
                            "only the first message of the stream may be a header; every later one is a bucket"
                        )
                    await loop.run_in_executor(
                        membership.thread,
                        collective.receive_bucket,
                        membership.group,
                        message.bucket,
                        receiver,
                        buffers,
                    )
                tensors = await loop.run_in_executor(membership.thread, _finished, receiver)
                membership.syncs += 1
                kept = True
            finally:
                if not kept:  # a failed update leaves the group: the trainer builds a new one
                    membership.close()
                    self._membership = None
            result = await self._staged_or_applied(receiver, tensors)
        yield inference_pb2.UpdateWeightsCollectiveResponse(result=result)

    def _specs_of(self, adapter: str):
        """What an update naming `adapter` may replace (UnknownAdapter for one not held)."""
        return self._engine.adapter_specs(adapter) if adapter else self._engine.parameter_specs()

    def _staging_for(self, adapter: str, device: str) -> Staging:
        """Where an update of `adapter` is staged on `device` ("cpu" or a GPU). An update of it that
        was staged and not committed is dropped: its tensors are the buffers this one is written into."""
        self._staged.pop(adapter, None)
        staging = self._stagings.get((adapter, device))
        if staging is None:
            staging = self._stagings[(adapter, device)] = Staging(device)
        return staging

    def _membership_for(self, header: inference_pb2.CollectiveWeightsHeader) -> collective.Membership:
        """The group `header` names: the one held, kept; or for a new group a fresh membership, not
        yet joined (the one held is left)."""
        held = self._membership
        if held is not None and held.holds(header):
            return held
        if header.group_sync > 0:
            raise collective.GroupNotHeld(
                f"this server does not hold weight group {header.group_id} after {header.group_sync} updates "
                f"(it holds {'none' if held is None else f'{held.identity[1]} after {held.syncs}'})"
            )
        if held is not None:
            held.close()
        self._membership = collective.Membership(header)
        return self._membership

    def _buffers_for(self, header: inference_pb2.CollectiveWeightsHeader, device: torch.device) -> list[torch.Tensor]:
        """The buffers broadcasts land in: the last update's, where they fit this one."""
        kept = self._collective_buffers
        if len(kept) != header.buffer_count or kept[0].numel() != header.bucket_bytes or kept[0].device != device:
            self._collective_buffers = []  # the old ones are let go first
            self._collective_buffers = [
                torch.empty(header.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(header.buffer_count)
            ]
        return self._collective_buffers

    async def _staged_or_applied(self, receiver: WeightsReceiver, tensors: dict) -> inference_pb2.UpdateWeightsResponse:
        staging = receiver.staging
        if receiver.update_id:
            self._staged[receiver.adapter] = (receiver.update_id, tensors, staging, receiver.bytes_received)
            return inference_pb2.UpdateWeightsResponse(
                policy_version=self._engine.adapter_version(receiver.adapter),
                bytes_received=receiver.bytes_received,
                staged=True,
            )
        return await self._apply(receiver.adapter, tensors, staging, receiver.bytes_received)

    async def _apply(
        self, adapter: str, tensors: dict, staging: Staging, bytes_received: int
    ) -> inference_pb2.UpdateWeightsResponse:
        started = time.perf_counter()
        count = len(tensors)
        # The update is complete, so it must land whole even if the client now leaves.
        applying = self._engine.apply_adapter(adapter, tensors) if adapter else self._engine.apply_staged(tensors)
        version = await asyncio.shield(applying)
        staging.put_back(tensors)
        return inference_pb2.UpdateWeightsResponse(
            policy_version=version,
            tensors_updated=count,
            bytes_received=bytes_received,
            apply_seconds=time.perf_counter() - started,
        )

    # Unary.
    async def CommitWeights(
        self, request: inference_pb2.CommitWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CommitWeightsResponse:
        async with self._receiving:
            adapter = next((a for a, staged in self._staged.items() if staged[0] == request.update_id), None)
            if adapter is None or not request.update_id:
                ids = [repr(staged[0]) for staged in self._staged.values()]
                held = f"update {', '.join(ids)} {'is' if len(ids) == 1 else 'are'}" if ids else "no update is"
                raise NothingStaged(f"no complete update {request.update_id!r} is staged here ({held} staged)")
            _, tensors, staging, bytes_received = self._staged.pop(adapter)
            result = await self._apply(adapter, tensors, staging, bytes_received)
            return inference_pb2.CommitWeightsResponse(result=result)

    # Unary.
    async def LoadAdapter(
        self, request: inference_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.LoadAdapterResponse:
        if not request.name:
            raise InvalidRequest("name", "an adapter needs a name (the run's)")
        if request.policy_version < 0:
            raise InvalidRequest("policy_version", f"policy_version = {request.policy_version} must be >= 0")
        load = AdapterLoad(
            name=request.name,
            path=request.path,
            rank=request.rank,
            alpha=request.alpha,
            targets=request.targets,
            policy_version=request.policy_version,
            replace=request.replace,
        )
        return inference_pb2.LoadAdapterResponse(adapter=_adapter_message(await self._engine.load_adapter(load)))

    # Unary.
    async def UnloadAdapter(
        self, request: inference_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.UnloadAdapterResponse:
        ended = await self._engine.unload_adapter(request.name)
        async with self._receiving:  # its staged update and staging buffers go with it
            self._staged.pop(request.name, None)
            for key in [key for key in self._stagings if key[0] == request.name]:
                del self._stagings[key]
        return inference_pb2.UnloadAdapterResponse(ended_generations=ended)

    # Unary.
    async def Pause(
        self, request: inference_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.PauseResponse:
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
                weight_transports=weight_transports(d.device),
                host_id=sharing.host_id(),
                constrained_decoding=d.constrained_decoding,
                adapters=[_adapter_message(a) for a in self._engine.adapters()],
                max_adapters=self._engine.max_adapters,
            )
        )


def _adapter_message(adapter: AdapterInfo) -> inference_pb2.AdapterInfo:
    return inference_pb2.AdapterInfo(
        name=adapter.name,
        rank=adapter.rank,
        alpha=adapter.alpha,
        targets=adapter.targets,
        policy_version=adapter.policy_version,
    )


def weight_transports(device: str) -> list[str]:
    """How a server whose engine runs on `device` receives weights, fastest first: on a GPU, CUDA
    IPC (same machine), NCCL, the stream; on a CPU, shared memory (same machine), the stream, then
    gloo (measured no faster than the stream over loopback: scripts/bench_weight_sync.py)."""
    shared = [t for t in sharing.transports(device) if t != sharing.STREAM]
    if device.startswith("cuda"):
        return shared + collective.transports(device) + [sharing.STREAM]
    return shared + [sharing.STREAM] + collective.transports(device)


def _finished(receiver: WeightsReceiver) -> dict[str, torch.Tensor]:
    """The received update, staged; on a GPU, once every copy into it is done."""
    tensors = receiver.finish()
    for device in {t.device for t in tensors.values() if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    return tensors


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
        except Exception as exc:
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
            last.usage.cached_prompt_tokens = end.cached_prompt_tokens
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


class _RawUpdateWeights:
    """A server as the generated add_InferenceServiceServicer_to_server sees it: UpdateWeights
    hands its servicer each message as the bytes received."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_RawUpdateWeightsHandler(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self._server.add_registered_method_handlers(
            service, {name: _raw_if_update(name, h) for name, h in handlers.items()}
        )


class _RawUpdateWeightsHandler(grpc.GenericRpcHandler):
    def __init__(self, handler: grpc.GenericRpcHandler) -> None:
        self._handler = handler

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._handler.service(handler_call_details)
        return None if handler is None else _raw_if_update(handler_call_details.method.rsplit("/", 1)[-1], handler)


def _raw_if_update(name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return handler._replace(request_deserializer=None) if name == "UpdateWeights" else handler


async def start_server(
    engine: Engine, address: str = "127.0.0.1:0", servicer: InferenceServicer | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start the engine and a gRPC server for it on `address` (serving `servicer`, default a new
    one over `engine`); return the server and bound port."""
    server, health_servicer = new_server(SERVICE_NAME, InferenceServicer.roles, max_message_bytes=MAX_MESSAGE_BYTES)
    servicer = servicer if servicer is not None else InferenceServicer(engine)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, _RawUpdateWeights(server))
    port = bind(server, address, "the inference server")
    await engine.start()
    await set_serving(health_servicer, SERVICE_NAME)
    await server.start()
    return server, port


async def serve(
    engine: Engine,
    address: str,
    on_ready: Callable[[int], None] | None = None,
    join: Callable[[int], UpstreamMember] | None = None,
    metrics_address: str = "",
    on_metrics: Callable[[str], None] | None = None,
) -> None:
    """Serve until cancelled or SIGINT/SIGTERM, then stop gracefully and stop the engine. With `join`
    (the bound port -> its membership), the server joins Envoy's control plane once it serves, and
    leaves it gracefully: draining until every Envoy acknowledged, its streams finishing, then gone.
    With `metrics_address`, Prometheus /metrics is served there too (its URL told to `on_metrics`)."""
    servicer = InferenceServicer(engine)
    server, port = await start_server(engine, address, servicer)
    metrics = await start_metrics(metrics_address, inference_metrics(servicer)) if metrics_address else None
    if metrics is not None and on_metrics is not None:
        on_metrics(metrics.url)
    member = join(port) if join is not None else None
    if member is not None:
        await member.start()

    async def stop() -> None:
        if metrics is not None:
            await metrics.stop()
        if member is not None:
            await member.drain()
        await server.stop(STOP_GRACE_SECONDS)
        if member is not None:
            await member.leave()
        await engine.stop()

    await serve_until_stopped(port, stop, on_ready)


def upstream_settings(config: InferenceConfig) -> dict[str, str]:
    """The upstream engine's settings (polar.inference.engines.upstream) from [inference]."""
    return {
        "url": config.upstream_url,
        "api": config.upstream_api,
        "served_model": config.upstream_model,
        "timeout_s": str(config.upstream_timeout_s),
        "adapter_dir": config.upstream_adapter_dir,
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
        prefix_cache_mib=config.prefix_cache_mib,
        release_idle_memory=config.release_idle_memory,
        script=config.script,
        policy_version=config.policy_version,
        adapter=config.adapter,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_targets=config.lora_targets,
        max_adapters=config.max_adapters,
        extra=(
            {"forced_replies": config.forced_replies}
            if config.forced_replies
            else upstream_settings(config)
            if config.engine == "upstream"
            else {}
        ),
    )
    if config.forced_replies and config.engine != "torch":
        raise ServiceError(f"forced_replies needs the torch engine, not {config.engine!r}")
    if (config.adapter or config.lora_rank or config.max_adapters) and config.engine == "scripted":
        raise ServiceError(
            "LoRA adapters (adapter, lora_rank, max_adapters) are served by the torch, vllm and upstream engines, "
            "not the scripted one"
        )

    metrics_url = []

    def on_ready(port: int) -> None:
        d = engine.description
        where = f", {d.device}" if d.device else ""
        metrics = f"; metrics {metrics_url[0]}" if metrics_url else ""
        ready(
            port,
            f"inference: serving {d.name} ({d.engine} engine{where}) on {join_host_port(config.host, port)}{metrics}",
        )

    def join(port: int) -> UpstreamMember:
        return UpstreamMember(
            config.rollout_address,
            INFERENCE_CLUSTER,
            advertised(config.host, port, config.advertise_address),
            tls_ca=config.rollout_tls_ca,
        )

    refusals: tuple[type[Exception], ...] = (LoraError,)
    if config.engine == "upstream":
        # Only there: its module imports aiohttp, about 0.3 s of CPU at every other engine's start.
        from polar.inference.engines.upstream_http import UpstreamError

        refusals = (UpstreamError, LoraError)
    try:
        engine = create_engine(config.engine, options)
        await serve(
            engine,
            join_host_port(config.host, config.port),
            on_ready,
            join if config.rollout_address else None,
            metrics_address=config.metrics_address,
            on_metrics=metrics_url.append,
        )
    except refusals as exc:
        raise ServiceError(str(exc)) from None
    except ModuleNotFoundError as exc:
        # Engines import their framework lazily (vLLM only when started); vLLM lives in its own
        # environment because its pins would constrain the main one.
        hint = "; scripts/setup_vllm.sh builds .venv-vllm, whose bin/polar has it" if config.engine == "vllm" else ""
        raise ServiceError(
            f"the {config.engine} engine needs the {exc.name!r} package, not installed here{hint}"
        ) from exc
