"""The trainer as a service (`polar serve trainer`): the training loop in a worker thread, and the
TrainerService (protos/polar/v1/trainer.proto) answering status, policy version and checkpoint calls
while it runs.

The process ends by itself once the configured steps are done (exit 0: `polar train` then stops the
stack), or on SIGINT/SIGTERM, after the loop has stopped between two micro-batches and written the
checkpoint of its last completed step.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from polar.config import TrainerConfig
from polar.credentials import OPERATOR
from polar.grpc_server import bind, callers, new_server, set_serving, until_stop_signal
from polar.metrics import start_metrics, trainer_metrics
from polar.rollout.client import RolloutError
from polar.service_base import Ready, ServiceError, join_host_port
from polar.v1 import trainer_pb2, trainer_pb2_grpc
from trainer.backends.base import Backend, BackendError, shared_options
from trainer.batches import TraceTooLongError
from trainer.checkpoints import CheckpointError
from trainer.dataset import DatasetError
from trainer.loop import TrainingError, TrainingRun
from trainer.weight_sync import WeightSyncError

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
STOP_GRACE_SECONDS = 2.0


def create_backend(config: TrainerConfig, model: str) -> Backend:
    """The configured backend, holding `model` (the starting weights or a checkpoint's folder: with
    LoRA, an adapter folder over the [trainer] model)."""
    if config.backend == "megatron":
        # Rank 0 of a torchrun job (trainer.backends.megatron.launch); the other ranks follow it.
        from trainer.backends.megatron import MegatronBackend, options_from_config

        return MegatronBackend(options_from_config(config, model))
    if config.backend != "torch":
        raise BackendError(f"unknown trainer backend {config.backend!r} (known: torch, megatron)")
    from polar.lora import is_adapter_folder
    from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions

    adapter = model if config.lora_rank and is_adapter_folder(model) else ""
    return TorchBackend(
        TorchBackendOptions(
            model=config.model if adapter else model,
            adapter=adapter,
            lora_rank=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_targets=config.lora_targets,
            device=config.device,
            gradient_checkpointing=config.gradient_checkpointing,
            **shared_options(config),
        )
    )


@callers({"GetStatus": (OPERATOR,), "GetPolicyVersion": (OPERATOR,), "SaveCheckpoint": (OPERATOR,)})
class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """See TrainerService in trainer.proto for each rpc's contract."""

    def __init__(self, run: TrainingRun) -> None:
        self._run = run
        self._checkpointing = asyncio.Lock()

    # Unary.
    async def GetStatus(self, request, context) -> trainer_pb2.GetStatusResponse:
        run = self._run
        with run.status_lock:
            metrics = dict(run.last_metrics)
        state = run.state
        return trainer_pb2.GetStatusResponse(
            status=trainer_pb2.TrainerStatus(
                step=state.step,
                total_steps=run.config.steps,
                backend=run.backend.name,
                trajectories_consumed=state.trajectories_consumed,
                groups_consumed=state.groups_consumed,
                trained_tokens=state.trained_tokens,
                last_metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                results_cursor=state.cursor,
                wait_seconds=metrics.get("seconds_rollout_wait", 0.0),
                compute_seconds=metrics.get("seconds_train", 0.0),
                push_seconds=metrics.get("seconds_weight_sync", 0.0),
            )
        )

    # Unary.
    async def GetPolicyVersion(self, request, context) -> trainer_pb2.GetPolicyVersionResponse:
        state = self._run.state
        return trainer_pb2.GetPolicyVersionResponse(
            policy_version=trainer_pb2.PolicyVersion(version=state.policy_version, step=state.step)
        )

    # Unary.
    async def SaveCheckpoint(self, request, context) -> trainer_pb2.SaveCheckpointResponse:
        if self._checkpointing.locked():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another SaveCheckpoint call is writing one")
        async with self._checkpointing:
            folder = Path(request.path) if request.path else None
            try:
                checkpoint = await asyncio.to_thread(self._run.save_checkpoint, folder)
            except OSError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot write the checkpoint: {exc}")
        return trainer_pb2.SaveCheckpointResponse(
            checkpoint=trainer_pb2.Checkpoint(
                path=str(checkpoint.path), step=checkpoint.state.step, policy_version=checkpoint.state.policy_version
            )
        )


async def serve_trainer(config: TrainerConfig, ready: Ready, rollout_address: str, inference: Sequence[str]) -> None:
    """`polar serve trainer`: load the model (or the run's latest checkpoint), serve TrainerService,
    train until the configured steps are done or SIGINT/SIGTERM arrives."""
    try:
        run = await asyncio.to_thread(
            TrainingRun, config, Path(config.run_dir), rollout_address, list(inference), create_backend, sys.stdout
        )
    except (BackendError, CheckpointError, DatasetError) as exc:
        raise ServiceError(str(exc)) from None
    server, health = new_server(SERVICE_NAME, TrainerServicer.roles)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(run), server)
    port = bind(server, join_host_port(config.host, config.port), "the trainer")
    await set_serving(health, SERVICE_NAME)
    await server.start()
    metrics = await start_metrics(config.metrics_address, trainer_metrics(run)) if config.metrics_address else None
    try:
        ready(
            port,
            f"trainer: {run.backend.name} backend on {run.backend.model_description['model_type']} "
            f"({config.model}), run folder {config.run_dir}; TrainerService on {join_host_port(config.host, port)}"
            + (f"; metrics {metrics.url}" if metrics else ""),
        )
        training = asyncio.ensure_future(asyncio.to_thread(run.run))
        stopping = asyncio.ensure_future(until_stop_signal())
        await asyncio.wait({training, stopping}, return_when=asyncio.FIRST_COMPLETED)
        run.stop.set()
        stopping.cancel()
        try:
            await training
        except (TrainingError, RolloutError, WeightSyncError, TraceTooLongError) as exc:
            raise ServiceError(f"training stopped: {exc}") from None
    finally:
        if metrics is not None:
            await metrics.stop()
        await server.stop(STOP_GRACE_SECONDS)
