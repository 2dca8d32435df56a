"""Polar as a NeMo Gym agent server: each row runs as a Polar task, through a real harness CLI.

`POST /run` takes a row (`responses_create_params` plus `polar_task`, a Polar Task in the protobuf
JSON mapping, over the YAML's `task`), submits it to Polar's rollout server as a task of one session
(Gym repeats rows itself), waits for the session's result on the rollout server's results stream,
and answers Polar's reward with the session's main trace as Responses-API items whose last item of
each model call carries the prompt and generated token ids and the logprobs the engine sampled
(polar/gym_items.py says which trace, and why every row is contiguous).

A row Polar refuses, a session that fails or runs past its time, and a rollout server that cannot
be reached come back as Gym failures (`_ng_failure_class`, `error_message`, reward 0), which
`ng_collect_rollouts` writes to its `_failures` file: never a hang, never a made-up reward.

Runs in NeMo Gym's Python: it imports from Polar only what needs no torch (the polar.v1 stubs,
polar.codec, polar.credentials, polar.gym_items), found through PYTHONPATH (a Polar checkout).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
from fastapi import HTTPException
from google.protobuf import json_format
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from pydantic import ConfigDict, PrivateAttr

from polar import codec, credentials
from polar.gym_items import gym_response, main_trace, response_object
from polar.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

# Results batches are as large as the rollout server sends (polar.rollout.server's limit).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
RECONNECT_S = 1.0
# Beyond the task's own harness timeout: the runtime's preparation, the evaluator, the rebuild.
WAIT_MARGIN_S = 900.0
DEFAULT_TASK_TIMEOUT_S = 1800.0  # rollout.proto: Task.timeout_seconds 0 means this

# ng_collect_rollouts writes a result carrying this key to its failures file (nemo_gym.rollout_collection).
FAILURE_CLASS_KEY = "_ng_failure_class"
FAILURE_TERMINAL_KEY = "_ng_failure_terminal"  # a row that would fail the same way again: not retried


class PolarAgentConfig(BaseResponsesAPIAgentConfig):
    # The rollout server (`polar up` serves it on 127.0.0.1:50070).
    rollout_address: str = "127.0.0.1:50070"
    # Folder holding the operator credential; "" = $POLAR_CREDENTIALS, else `polar up`'s state folder,
    # else none (a stack started without credentials, as the tests' is).
    credentials_folder: str = ""
    # Task fields (protobuf JSON mapping of polar.v1.Task) that every row's `polar_task` goes over.
    task: dict[str, Any] = {}
    # Seconds to wait for a session's result; 0 = its task's timeout plus WAIT_MARGIN_S.
    wait_timeout_s: float = 0.0


class PolarRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")
    polar_task: dict[str, Any] = {}


class PolarVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class RowFailure(Exception):
    """A row that produced no trainable rollout; `failure_class` is Gym's name for why."""

    def __init__(self, message: str, failure_class: str, terminal: bool) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.terminal = terminal


class ResultWatch:
    """One results stream of the rollout server, read from its start, handing each released
    session to the /run that waits for its task. Waiters register before their task is submitted,
    so no result can pass unseen; a stream that breaks fails the waiting rows and reconnects from
    the last cursor."""

    def __init__(self, stub: rollout_pb2_grpc.RolloutServiceStub, metadata: tuple) -> None:
        self._stub = stub
        self._metadata = metadata
        self._waiting: dict[str, asyncio.Future] = {}
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def expect(self, task_id: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = future
        return future

    def forget(self, task_id: str) -> None:
        self._waiting.pop(task_id, None)

    async def _watch(self) -> None:
        cursor = ""
        while True:
            call = self._stub.WatchResults(rollout_pb2.WatchResultsRequest(cursor=cursor), metadata=self._metadata)
            try:
                async for batch in call:
                    for trajectory in codec.read_trajectory_batch(batch.zstd_trajectories):
                        future = self._waiting.pop(trajectory.task_id, None)
                        if future is not None and not future.done():
                            future.set_result(trajectory)
                    cursor = batch.cursor
            except (grpc.aio.AioRpcError, codec.CodecError) as exc:
                reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                message = f"the rollout server's results stream failed: {reason}"
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(RowFailure(message, "transient", False))
                self._waiting.clear()
            await asyncio.sleep(RECONNECT_S)


class PolarAgent(SimpleResponsesAPIAgent):
    config: PolarAgentConfig
    _stub: Any = PrivateAttr(default=None)
    _metadata: tuple = PrivateAttr(default=())
    _watch: Any = PrivateAttr(default=None)

    async def responses(self, body: NeMoGymResponseCreateParamsNonStreaming) -> NeMoGymResponse:
        """The YAML's task on this request's input: the session's main trace as a response."""
        try:
            trajectory = await self._rollout(body, {})
        except RowFailure as exc:
            raise HTTPException(status_code=400 if exc.terminal else 503, detail=str(exc)) from None
        return NeMoGymResponse.model_validate(gym_response(trajectory).response)

    async def run(self, body: PolarRunRequest) -> PolarVerifyResponse:
        row = body.model_dump(mode="json", exclude_unset=True)
        try:
            trajectory = await self._rollout(body.responses_create_params, body.polar_task)
        except RowFailure as exc:
            failed = response_object(f"resp_failed_{uuid.uuid4().hex}", "", [])
            return PolarVerifyResponse.model_validate(
                row
                | {
                    "response": failed,
                    "reward": 0.0,
                    "error_message": str(exc),
                    FAILURE_CLASS_KEY: exc.failure_class,
                    FAILURE_TERMINAL_KEY: exc.terminal,
                }
            )
        answer = gym_response(trajectory)
        return PolarVerifyResponse.model_validate(
            row
            | {
                "response": answer.response,
                "reward": trajectory.reward,
                "polar_task_id": trajectory.task_id,
                "polar_session_id": trajectory.session_id,
                "polar_trace_id": answer.trace_id,
                "polar_other_traces": answer.other_traces,
            }
        )

    async def _rollout(
        self, params: NeMoGymResponseCreateParamsNonStreaming, polar_task: dict[str, Any]
    ) -> common_pb2.Trajectory:
        """Run the row as a task of one session; its trajectory, or RowFailure."""
        task = _task_of(params, self.config.task, polar_task)
        watch = self._results()
        future = watch.expect(task.task_id)
        try:
            try:
                await self._stub.SubmitTasks(
                    rollout_pb2.SubmitTasksRequest(tasks=[task]), metadata=self._metadata, timeout=30
                )
            except grpc.aio.AioRpcError as exc:
                terminal = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                raise RowFailure(
                    f"Polar refused the task: {exc.details()}" if terminal else _rpc_text("SubmitTasks", exc),
                    "skipped" if terminal else "transient",
                    terminal,
                ) from None
            timeout_s = self.config.wait_timeout_s or (task.timeout_seconds or DEFAULT_TASK_TIMEOUT_S) + WAIT_MARGIN_S
            try:
                trajectory = await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except TimeoutError:
                await self._cancel(task.task_id)
                raise RowFailure(
                    f"no result for task {task.task_id} after {timeout_s:g} s", "timeout_exceeded", True
                ) from None
        finally:
            watch.forget(task.task_id)
        if trajectory.outcome == common_pb2.SESSION_OUTCOME_COMPLETED:
            if main_trace(trajectory) is None:
                # Nothing for NeMo RL to train on: a row without one generated token is no rollout.
                raise RowFailure(f"session {trajectory.session_id} sampled no token", "legitimate", False)
            return trajectory
        outcome = common_pb2.SessionOutcome.Name(trajectory.outcome)
        failure = "timeout_exceeded" if trajectory.outcome == common_pb2.SESSION_OUTCOME_TIMED_OUT else "legitimate"
        raise RowFailure(
            f"session {trajectory.session_id} ended {outcome}: {trajectory.error or 'no error given'}", failure, False
        )

    def _results(self) -> ResultWatch:
        """The rollout server's client and results stream, made in the server's event loop on first use;
        RowFailure when the configured credential cannot be read."""
        if self._watch is None:
            try:
                found = (
                    credentials.load(self.config.credentials_folder)
                    if self.config.credentials_folder
                    else credentials.for_commands()
                )
            except credentials.CredentialsError as exc:
                raise RowFailure(f"no operator credential for the rollout server: {exc}", "skipped", True) from None
            self._metadata = credentials.metadata(credentials.OPERATOR, found)
            channel = grpc.aio.insecure_channel(
                self.config.rollout_address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            )
            self._stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            self._watch = ResultWatch(self._stub, self._metadata)
        return self._watch

    async def _cancel(self, task_id: str) -> None:
        try:
            await self._stub.Cancel(rollout_pb2.CancelRequest(task_ids=[task_id]), metadata=self._metadata, timeout=10)
        except grpc.aio.AioRpcError:
            pass  # the row already fails with its timeout; a task that is gone needs no cancelling


def _task_of(
    params: NeMoGymResponseCreateParamsNonStreaming, defaults: dict[str, Any], polar_task: dict[str, Any]
) -> rollout_pb2.Task:
    """The Polar task of one row: `polar_task` over the YAML's defaults, one session, a fresh id, the
    instruction from the row's input when the task gives none, and the sampling NeMo RL set on the row
    (temperature, top_p, and max_output_tokens as the cap of every model call)."""
    task = rollout_pb2.Task()
    try:
        json_format.ParseDict(_merged(defaults, polar_task), task)
    except json_format.ParseError as exc:
        raise RowFailure(f"polar_task is not a Polar task: {exc}", "skipped", True) from None
    task.task_id = f"gym-{uuid.uuid4().hex}"
    task.group_size = 1
    if not task.instruction:
        task.instruction = _instruction(params.input)
    if not task.instruction:
        raise RowFailure("the row has no instruction (polar_task.instruction or a user input)", "skipped", True)
    if params.temperature is not None:
        task.sampling.temperature = params.temperature
    if params.top_p is not None:
        task.sampling.top_p = params.top_p
    if params.max_output_tokens:
        task.sampling.max_tokens_per_call = params.max_output_tokens
    return task


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _instruction(given: Any) -> str:
    """The text of the row's last user message (or the input itself, when it is a string)."""
    if isinstance(given, str):
        return given
    for item in reversed(given):
        message = item if isinstance(item, dict) else item.model_dump()
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))
    return ""


def _rpc_text(method: str, exc: grpc.aio.AioRpcError) -> str:
    return f"{method} failed: {exc.code().name}: {exc.details()}"


if __name__ == "__main__":
    PolarAgent.run_webserver()
