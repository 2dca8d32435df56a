"""The gateway's pipeline, the same for every dialect: session → render → generate → record.

`Gateway.call` authorizes the key, has the dialect read the body, renders the prompt, asks the engine
to sample, streams the reply through the dialect and appends one CallRecord to the session. The
pipeline step by step, its error mapping and its timeouts: docs/design/gateway-pipeline.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import grpc
from tokenizers import Tokenizer

from gateway.body_decoder import BodyDecoder
from gateway.chat_format import ChatFormat
from gateway.conversation import ToolChoice
from gateway.dialects.base import (
    CallInfo,
    ContextLengthError,
    Dialect,
    DialectRequest,
    DialectResult,
    ErrorKind,
    FinishKind,
    GatewayError,
    Route,
    Sampling,
    StreamRenderer,
    Usage,
    json_bytes,
)
from gateway.output_assembler import OutputAssembler
from gateway.parsers import OutputParser, ParseEvent, collect
from gateway.render import PriorCall, RenderedPrompt, render_request
from gateway.request_constraint import output_constraint
from gateway.sampling import Limit, effective_sampling
from gateway.sessions import RecordParts, Session, SessionError, SessionStore
from polar import credentials
from polar.batched_stream import ReadAhead, StreamIdle
from polar.codec import length_delimited_header
from polar.sampling_policy import NO_POLICY
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc

log = logging.getLogger("polar.gateway")

SESSION_METADATA = "x-polar-session"  # Envoy hashes on it: a session's calls reach the same server
# A whole generation, first token to last, may take this long before it is abandoned as hung.
DEFAULT_GENERATE_TIMEOUT_S = 900.0
# The engine may send nothing for this long (before the first token or between two) before the
# generation is abandoned as hung: long enough for a long prompt's prefill on a CPU, or a call held
# while a weight update pauses the server.
DEFAULT_TOKEN_TIMEOUT_S = 600.0
# Each message of a token stream costs the gateway (and the inference server) about the same CPU,
# 0.1-0.3 ms here (scripts/bench_token_stream.py), however many tokens it holds; an engine decoding a
# token per step would send one per token. A tenth of a second still streams text to a harness smoothly.
DEFAULT_MESSAGE_INTERVAL_S = 0.1
MAX_RECONNECT_BACKOFF_MS = 2000
# How soon a model-info call answered UNAVAILABLE (Envoy with no healthy server yet) is made again.
MODEL_INFO_RETRY_S = 0.2
GENERATE_METHOD = f"/{inference_pb2.DESCRIPTOR.services_by_name['InferenceService'].full_name}/Generate"

PROMPT_FIELD = inference_pb2.GenerateRequest.PROMPT_TOKEN_IDS_FIELD_NUMBER

_GRPC_ERRORS = {
    grpc.StatusCode.UNAVAILABLE: ErrorKind.OVERLOADED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.OVERLOADED,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_REQUEST,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
}
_ENGINE_FINISH = {
    common_pb2.FINISH_REASON_STOP: FinishKind.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishKind.LENGTH,
    common_pb2.FINISH_REASON_CONTEXT_LENGTH: FinishKind.CONTEXT_LENGTH,
    common_pb2.FINISH_REASON_ABORTED: FinishKind.ABORTED,
}


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


class Sink(Protocol):
    """Where a streamed response goes (the HTTP app's response)."""

    def connected(self) -> bool:
        """False once the client has gone away."""

    async def open(self, media_type: str) -> None:
        """Start a 200 stream; its status line and headers may wait for the first send or end."""

    async def send(self, chunks: Sequence[bytes]) -> None:
        """Send bytes now; raise ClientGone when the client has gone away."""

    async def end(self, chunks: Sequence[bytes]) -> None:
        """Send the last bytes and end the response, in one write; raise ClientGone like send."""


@dataclass(frozen=True)
class Reply:
    """A whole (non-streamed) response: status and JSON body, encoded once."""

    status: int
    body: bytes


@runtime_checkable
class TokenCounting(Protocol):
    """A dialect that also counts prompt tokens without generating (Anthropic's count_tokens)."""

    def parse_count_tokens(self, body: Any, route: Route) -> DialectRequest:
        """Like parse_request, for a body that asks only for a count."""

    def count_tokens_response(self, input_tokens: int) -> dict[str, Any]:
        """The count's response body."""


@dataclass(frozen=True)
class ModelSpec:
    """What the core needs to know about the served model."""

    name: str
    context_length: int
    # The engine honours SamplingParams.constraint (ModelInfo.constrained_decoding); otherwise a forced
    # tool call is only opened in the prompt and schemas are not enforced.
    constrained_decoding: bool = False


# ------------------------------------------------------------------------------------ inference


class InferenceClient:
    """One gRPC channel to the inference service (or Envoy in front of it), reused by every call."""

    def __init__(self, address: str) -> None:
        self.address = address
        # A call made while the channel waits to reconnect fails at once: gRPC's default wait grows
        # to two minutes, so an inference server back after an outage would stay unreachable (to
        # calls and to readiness) that long. Reconnecting on loopback or a LAN costs next to nothing.
        self._channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
        )
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        # Generate with the request already serialized (Gateway._generate_request): the prompt is
        # joined from packed pieces, never put into a message field id by id.
        self._generate = self._channel.unary_stream(
            GENERATE_METHOD, request_serializer=None, response_deserializer=inference_pb2.GenerateResponse.FromString
        )
        # The node's credential (polar.credentials), given per call: an interceptor on an aio channel
        # would wrap every streamed token in one more generator step.
        self._credential = credentials.metadata(credentials.NODE, credentials.of_process())

    async def model_info(self, timeout_s: float, *, wait_for_ready: bool = True) -> inference_pb2.ModelInfo:
        """The served model, waiting up to timeout_s for the server to come up (or, without
        wait_for_ready, failing at once with UNAVAILABLE when it cannot be reached).

        Waiting covers Envoy in front of the servers too: its channel is ready at once, but it answers
        UNAVAILABLE ("no healthy upstream") until a server passes its health check, so that answer is
        asked again until the time is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = await self._stub.GetModelInfo(
                    inference_pb2.GetModelInfoRequest(),
                    timeout=max(deadline - time.monotonic(), 0.001),
                    wait_for_ready=wait_for_ready,
                    metadata=self._credential,
                )
                return response.model_info
            except grpc.aio.AioRpcError as exc:
                retry_in = min(MODEL_INFO_RETRY_S, deadline - time.monotonic())
                if not wait_for_ready or exc.code() != grpc.StatusCode.UNAVAILABLE or retry_in <= 0:
                    raise
                await asyncio.sleep(retry_in)

    def generate(self, serialized_request: bytes, session_id: str, timeout_s: float) -> grpc.aio.UnaryStreamCall:
        """Generate for a serialized GenerateRequest."""
        # No wait_for_ready: a server that is down must fail the call now (OVERLOADED), not hang it.
        return self._generate(
            serialized_request, timeout=timeout_s, metadata=((SESSION_METADATA, session_id), *self._credential)
        )

    async def close(self) -> None:
        await self._channel.close()


def grpc_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    kind = _GRPC_ERRORS.get(exc.code(), ErrorKind.INTERNAL)
    if kind is ErrorKind.OVERLOADED:
        return GatewayError(kind, f"the inference server is unavailable ({exc.code().name.lower()}); retry later")
    return GatewayError(kind, f"the inference server refused the call: {exc.details()}")


# ------------------------------------------------------------------------------------ the calls


def error_reply(dialect: Dialect, error: GatewayError) -> Reply:
    status, body = dialect.error_response(error)
    return Reply(status, json_bytes(body))


def internal_error() -> GatewayError:
    return GatewayError(ErrorKind.INTERNAL, "internal error in the gateway; see its log")


def finish_kind(engine_finish: int, *, stop_sequence: str | None, context_bound: bool, tool_calls: bool) -> FinishKind:
    """Why the output ended, as the client is told."""
    if stop_sequence is not None:
        return FinishKind.STOP_SEQUENCE
    kind = _ENGINE_FINISH.get(engine_finish)
    if kind is None or kind is FinishKind.ABORTED:
        raise GatewayError(ErrorKind.OVERLOADED, "the inference server ended the generation early; retry later")
    if kind is FinishKind.LENGTH and context_bound:
        return FinishKind.CONTEXT_LENGTH
    if kind is FinishKind.STOP and tool_calls:
        return FinishKind.TOOL_CALLS
    return kind


def context_room(prompt_tokens: int, context_length: int) -> int:
    """Tokens the context leaves for the output after the prompt; ContextLengthError when none."""
    left = context_length - prompt_tokens
    if left < 1:
        raise ContextLengthError(prompt_tokens, context_length)
    return left


def max_tokens_for(requested: int | None, prompt_tokens: int, context_length: int) -> tuple[int, bool]:
    """(max_tokens to ask the engine for, whether reaching it means the context is full), for a call
    of a session without a sampling policy."""
    params, limit = effective_sampling(
        Sampling(max_tokens=requested), NO_POLICY, 0, context_room(prompt_tokens, context_length)
    )
    return params.max_tokens, limit is Limit.CONTEXT


@dataclass
class _Call:
    """One call on its way through the pipeline."""

    session: Session
    dialect: Dialect
    request: DialectRequest
    raw: bytes
    info: CallInfo
    record_id: str
    rendered: RenderedPrompt
    sampling: common_pb2.SamplingParams  # what the engine is asked for
    limit: Limit  # what set sampling.max_tokens
    output: OutputAssembler
    received_ns: int
    started: float  # perf_counter at arrival
    render_seconds: float
    sent: float = 0.0  # perf_counter when the prompt went to the engine
    first_token: float = 0.0
    policy_version: int | None = None
    last_policy_version: int = 0
    queue_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # of the prompt, tokens the engine took from its prefix cache
    engine_finish: int = 0
    result: DialectResult | None = None
    response_body: bytes = b""
    error: GatewayError | None = None
    aborted: bool = False

    def take(self, message: inference_pb2.GenerateResponse) -> list[ParseEvent]:
        if message.token_ids:
            self.session.count_sampled(len(message.token_ids))
            if self.policy_version is None:
                self.policy_version = message.policy_version
                self.first_token = time.perf_counter()
            self.last_policy_version = message.policy_version
        if message.finish_reason:
            self.engine_finish = message.finish_reason
            self.queue_seconds = message.queue_seconds
            self.cached_prompt_tokens = message.usage.cached_prompt_tokens
        return self.output.add(message.token_ids, message.logprobs)

    def finish(self) -> tuple[list[ParseEvent], DialectResult]:
        events = self.output.finish()
        parsed = collect(self.output.events)
        finish = finish_kind(
            self.engine_finish,
            stop_sequence=self.output.stop_sequence,
            context_bound=self.limit is Limit.CONTEXT,
            tool_calls=bool(parsed.tool_calls),
        )
        usage = Usage(self.rendered.token_count, len(self.output.token_ids))
        self.result = DialectResult(self.info, parsed, finish, usage, self.output.stop_sequence)
        return events, self.result

    def record(self) -> common_pb2.CallRecord:
        """The call's record, without its prompt ids and bodies: the session holds them apart (`prompt`,
        `raw`, `response_body`), as they are."""
        return common_pb2.CallRecord(
            call_id=self.record_id,
            session_id=self.session.session_id,
            dialect=self.dialect.record_dialect,
            model=self.request.model,
            sampled_token_ids=self.output.token_ids,
            sampled_logprobs=self.output.logprobs,
            finish_reason=self._record_finish(),
            policy_version=self.policy_version if self.policy_version is not None else self.last_policy_version,
            last_policy_version=self.last_policy_version,
            extends_call_id=self.rendered.extends_call_id,
            forced_token_count=self.rendered.forced_token_count,
            aborted=self.aborted,
            error=self.error.message if self.error is not None else "",
            timings=common_pb2.CallTimings(
                received_unix_ns=self.received_ns,
                render_seconds=self.render_seconds,
                time_to_first_token_seconds=self.first_token - self.sent if self.first_token else 0.0,
                total_seconds=time.perf_counter() - self.started,
                queue_seconds=self.queue_seconds,
            ),
            usage=common_pb2.Usage(
                prompt_tokens=self.rendered.token_count,
                completion_tokens=len(self.output.token_ids),
                cached_prompt_tokens=self.cached_prompt_tokens,
            ),
            stream=self.request.stream,
            sampling=self.sampling,
            truncated=self.truncated,
        )

    @property
    def prompt(self) -> bytes:
        """The prompt ids the engine was sent, packed (see Gateway._generate_request)."""
        return self.rendered.packed_ids

    @property
    def truncated(self) -> bool:
        """The generation ended without a stop because of a limit the harness did not ask for."""
        if self.aborted or self.error is not None or self.output.stopped:
            return False
        if self.engine_finish == common_pb2.FINISH_REASON_CONTEXT_LENGTH:
            return True
        if self.engine_finish == common_pb2.FINISH_REASON_LENGTH and self.sampling.HasField("constraint"):
            return True  # cut before its constraint was complete: no valid call or JSON
        return self.engine_finish == common_pb2.FINISH_REASON_LENGTH and self.limit.truncates

    def prior(self) -> PriorCall | None:
        """What later requests may extend: only a reply the client received whole."""
        if self.result is None or self.aborted or self.error is not None:
            return None
        return PriorCall(self.record_id, self.rendered, tuple(self.output.token_ids), self.result.output.message())

    def _record_finish(self) -> int:
        if self.aborted:
            return common_pb2.FINISH_REASON_ABORTED
        if self.error is not None:
            return common_pb2.FINISH_REASON_ERROR
        if self.result is not None and self.result.finish is FinishKind.CONTEXT_LENGTH:
            return common_pb2.FINISH_REASON_CONTEXT_LENGTH
        if self.output.stopped:
            return common_pb2.FINISH_REASON_STOP
        return self.engine_finish


@dataclass
class Gateway:
    """The pipeline over one inference service and one session store (see the module docstring)."""

    store: SessionStore
    inference: InferenceClient
    model: ModelSpec
    chat_format: ChatFormat
    parser: OutputParser
    tokenizer: Tokenizer  # the tokenizers backend of the model's tokenizer, for detokenisation
    generate_timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S
    token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S
    message_interval_s: float = DEFAULT_MESSAGE_INTERVAL_S  # GenerateRequest.message_interval_seconds
    # Request bodies, with the tools and system prompts harnesses repeat read once (gateway/body_decoder.py).
    bodies: BodyDecoder = field(default_factory=BodyDecoder)

    def authorize(self, key: str | None) -> Session:
        try:
            return self.store.authorize(key)
        except SessionError as exc:
            raise GatewayError(ErrorKind.AUTHENTICATION, f"invalid session key: {exc}") from exc

    async def call(self, dialect: Dialect, route: Route, raw: bytes, key: str | None, sink: Sink) -> Reply | None:
        """Serve one model call; a Reply to send, or None when the response was streamed to `sink`."""
        received_ns, started = time.time_ns(), time.perf_counter()
        try:
            session = self.authorize(key)
            request = dialect.parse_request(self.bodies.decode(raw, session.conversations), route)
            call = self._prepare(session, dialect, request, raw, received_ns, started)
        except GatewayError as exc:
            return self.error_reply(dialect, exc)
        except Exception:
            log.exception("gateway: request failed before generation")
            return self.error_reply(dialect, internal_error())
        return await self._generate(call, sink)

    def count_tokens(self, dialect: Dialect, route: Route, raw: bytes, key: str | None) -> Reply:
        """The prompt tokens the request would be rendered to now, in the dialect's count shape."""
        try:
            session = self.authorize(key)
            if not isinstance(dialect, TokenCounting):
                raise GatewayError(ErrorKind.NOT_FOUND, f"the {dialect.name} dialect does not count tokens")
            request = dialect.parse_count_tokens(self.bodies.decode(raw, session.conversations), route)
            rendered = render_request(
                self.chat_format, request.conversation, session.prior_calls, history=session.history
            )
            return Reply(200, json_bytes(dialect.count_tokens_response(rendered.token_count)))
        except GatewayError as exc:
            return self.error_reply(dialect, exc)
        except Exception:
            log.exception("gateway: counting tokens failed")
            return self.error_reply(dialect, internal_error())

    def error_reply(self, dialect: Dialect, error: GatewayError) -> Reply:
        try:
            return error_reply(dialect, error)
        except Exception:
            log.exception("gateway: the %s dialect could not render an error", dialect.name)
            return Reply(500, json_bytes({"error": {"type": "internal", "message": error.message}}))

    def _prepare(
        self, session: Session, dialect: Dialect, request: DialectRequest, raw: bytes, received_ns: int, started: float
    ) -> _Call:
        constraint = None
        conversation = request.conversation
        if self.model.constrained_decoding:
            constraint = output_constraint(conversation, request.output_schema, self.chat_format)
            if constraint is not None and constraint.kind == "tool_call":
                # The grammar opens the call, sampled: no tool-call opening is forced into the prompt.
                conversation = replace(conversation, tool_choice=ToolChoice.auto())
        rendered = render_request(self.chat_format, conversation, session.prior_calls, history=session.history)
        try:
            room = context_room(rendered.token_count, self.model.context_length)
        except ContextLengthError as exc:
            self._record_refused(session, dialect, request, raw, rendered, exc, received_ns, started)
            raise
        sampling, limit = effective_sampling(request.sampling, session.sampling, session.sampled_tokens, room)
        if constraint is not None:
            sampling.constraint.CopyFrom(constraint.to_proto(common_pb2.OutputConstraint))
        forced_text = ""
        if rendered.forced_token_count:
            forced_text = self.chat_format.forced_opening_text(request.conversation.tool_choice)
        call_id = uuid.uuid4().hex
        output = OutputAssembler(
            self.tokenizer,
            self.parser.stream(call_id=call_id),
            # A constrained reply is constrained whole, and its grammar alone says where it ends: a
            # client stop string would cut it into invalid JSON presented as complete.
            stops=request.sampling.stop if constraint is None else (),
            forced_text=forced_text,
            parse_tool_calls=request.parse_tool_calls,
        )
        return _Call(
            session=session,
            dialect=dialect,
            request=request,
            raw=raw,
            info=CallInfo(call_id, received_ns // 1_000_000_000, rendered.token_count),
            record_id=session.begin_call(),
            rendered=rendered,
            sampling=sampling,
            limit=limit,
            output=output,
            received_ns=received_ns,
            started=started,
            render_seconds=time.perf_counter() - started,
        )

    def _record_refused(
        self,
        session: Session,
        dialect: Dialect,
        request: DialectRequest,
        raw: bytes,
        rendered: RenderedPrompt,
        error: ContextLengthError,
        received_ns: int,
        started: float,
    ) -> None:
        """A prompt over the context is recorded though nothing was generated: the session then shows
        why the harness's next request (compacted, or its retry) follows, and a session that could not
        fit its first call says so (CallRecord.prompt_too_long)."""
        record = common_pb2.CallRecord(
            call_id=session.begin_call(),
            session_id=session.session_id,
            dialect=dialect.record_dialect,
            model=request.model,
            finish_reason=common_pb2.FINISH_REASON_ERROR,
            extends_call_id=rendered.extends_call_id,
            forced_token_count=rendered.forced_token_count,
            error=error.message,
            timings=common_pb2.CallTimings(
                received_unix_ns=received_ns,
                render_seconds=time.perf_counter() - started,
                total_seconds=time.perf_counter() - started,
            ),
            usage=common_pb2.Usage(prompt_tokens=rendered.token_count),
            stream=request.stream,
            prompt_too_long=True,
        )
        reply = self.error_reply(dialect, error)
        self.store.record(session, record, None, RecordParts(rendered.packed_ids, raw, reply.body))

    def _generate_request(self, call: _Call) -> bytes:
        """The serialized request for the engine.

        Ids enter a message field at tens of nanoseconds each (a 20k-token prompt: half a millisecond
        in, a tenth more out), so the prompt field is written from the rendered prompt's packed form,
        which is joined from cached pieces.
        """
        request = inference_pb2.GenerateRequest(
            request_id=call.info.call_id,
            sampling=call.sampling,
            session_id=call.session.session_id,
            message_interval_seconds=self.message_interval_s,
            adapter=call.session.adapter,
        )
        prompt = call.rendered.packed_ids
        return b"".join((request.SerializeToString(), length_delimited_header(PROMPT_FIELD, len(prompt)), prompt))

    async def _generate(self, call: _Call, sink: Sink) -> Reply | None:
        renderer = call.dialect.stream_renderer(call.request, call.info) if call.request.stream else None
        stream = _StreamWriter(sink, renderer)
        serialized = self._generate_request(call)
        call.sent = time.perf_counter()
        grpc_call = self.inference.generate(serialized, call.session.session_id, self.generate_timeout_s)
        reply: Reply | None = None
        messages = ReadAhead(grpc_call, idle_timeout_s=self.token_timeout_s)
        try:
            events: list[ParseEvent] = []
            async for batch in messages:
                for message in batch:
                    events += call.take(message)
                if not sink.connected():
                    raise ClientGone
                if call.output.stopped:
                    break
                if not call.engine_finish:  # else these events go out with the stream's end, in one write
                    await stream.send_events(events)
                    events = []
            last_events, result = call.finish()
            events += last_events
            if renderer is None:
                call.response_body = json_bytes(call.dialect.render_response(call.request, result))
                reply = Reply(200, call.response_body)
            else:
                # The stream ends before anything is recorded: the client is not kept waiting for
                # the record (the response as a whole body, the CallRecord).
                await stream.send_finish(events, result)
                call.response_body = _recorded_body(call, result)
        except ClientGone:
            call.aborted = True
        except BaseException as exc:
            call.error = _as_gateway_error(exc)
            if isinstance(exc, Exception):
                reply = await self._fail(call, stream, call.error)
            else:  # cancelled (the server is stopping): record, then let the cancellation go on
                call.aborted = True
                raise
        finally:
            messages.close()
            grpc_call.cancel()
            self.store.record(
                call.session, call.record(), call.prior(), RecordParts(call.prompt, call.raw, call.response_body)
            )
        return reply

    async def _fail(self, call: _Call, stream: _StreamWriter, error: GatewayError) -> Reply | None:
        """The error as the client gets it: a reply, or the stream's error event once it has started."""
        reply = self.error_reply(call.dialect, error)
        call.response_body = reply.body
        if not stream.opened:
            return reply
        try:
            await stream.send_error(error)
        except ClientGone:
            call.aborted = True
        except Exception:
            log.exception("gateway: the %s dialect could not end a stream with an error", call.dialect.name)
        return None


def _recorded_body(call: _Call, result: DialectResult) -> bytes:
    """A streamed call's response as the record keeps it: the body the unstreamed call would have
    had. The client already has the whole stream, so a dialect failing here only leaves it out."""
    try:
        return json_bytes(call.dialect.render_response(call.request, result))
    except Exception:
        log.exception("gateway: the %s dialect could not render the recorded response", call.dialect.name)
        return b""


def _as_gateway_error(exc: BaseException) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return GatewayError(
                ErrorKind.OVERLOADED,
                "the generation took longer than the gateway allows ([gateway] generate_timeout_s) and was abandoned; "
                "retry later",
            )
        return grpc_error(exc)
    if isinstance(exc, StreamIdle):
        return GatewayError(
            ErrorKind.OVERLOADED,
            f"the inference server sent no token for {exc.seconds:g} s ([gateway] token_timeout_s); the generation "
            "was abandoned as hung; retry later",
        )
    if isinstance(exc, Exception):
        log.error("gateway: call failed", exc_info=exc)
        return internal_error()
    return GatewayError(ErrorKind.INTERNAL, "the gateway stopped while the call was running")


class _StreamWriter:
    """Writes one streamed response to the client's sink: the dialect's StreamRenderer makes the bytes,
    this sends them. The response opens (headers, then the renderer's start events) with the first
    message from the engine, so that the renderer's hooks run in the contract's order: start, events,
    then finish or error."""

    def __init__(self, sink: Sink, renderer: StreamRenderer | None) -> None:
        self._sink = sink
        self.renderer = renderer
        self.opened = False

    async def send_events(self, events: list[ParseEvent]) -> None:
        if self.renderer is not None:
            opening = not self.opened
            chunks = await self._render(events)
            if chunks or opening:  # the opening send carries the headers even with no event yet
                await self._sink.send(chunks)

    async def send_finish(self, events: list[ParseEvent], result: DialectResult) -> None:
        """The last events and the renderer's finish, in one write that ends the response."""
        if self.renderer is not None:
            await self._sink.end([*await self._render(events), *self.renderer.finish(result)])

    async def _render(self, events: list[ParseEvent]) -> list[bytes]:
        chunks = await self._open()
        for event in events:
            chunks += self.renderer.events(event)
        return chunks

    async def send_error(self, error: GatewayError) -> None:
        """The renderer's error event and terminator; only for a stream already open."""
        if self.renderer is not None and self.opened:
            await self._sink.end(self.renderer.error(error))

    async def _open(self) -> list[bytes]:
        if self.opened:
            return []
        await self._sink.open(self.renderer.media_type)
        self.opened = True
        return self.renderer.start()
