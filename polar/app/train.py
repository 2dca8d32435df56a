"""`polar train` and `polar eval`: the stack on the embedded defaults (or a TOML file) with a job on top;
`polar merge`: a LoRA checkpoint as a plain model folder.

    polar train CONFIG [--run-dir DIR]      the stack plus the trainer (`polar serve trainer`) as a job:
                                            the stack stops, with success, once the trainer is done
    polar train CONFIG --join HOST:PORT     the trainer alone, a LoRA run on a running stack (`polar up`,
                                            its rollout server at HOST:PORT) that other runs share
    polar eval CONFIG [--checkpoint DIR]    the stack serving a checkpoint (or the base model; a LoRA
                                            checkpoint's base plus its adapter), the held-out tasks run
                                            through it, a table and a JSON file
    polar eval CONFIG --run-dir DIR         the base model and the run's latest checkpoint, each once:
                                            reports in DIR/eval/, a before/after table, DIR/eval.png
    polar merge CHECKPOINT OUT              a LoRA checkpoint's adapter merged into its base model (docs/lora.md)

A run folder holds everything a run needs to carry on after a stop: its rollout store (tasks
submitted, results released), checkpoints, metrics.jsonl, TensorBoard events and reward.png. Run
again with the same folder, `polar train` serves the latest checkpoint's weights as that checkpoint's
policy version and the trainer resumes from its step and results cursor. What can be checked before
a service starts is checked first: the config, the dataset's every line, the model, the checkpoint.
A run that joins a stack finds its inference servers on the stack's control plane and checks there,
before its trainer starts, that they have room for its adapter (docs/lora.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from polar import credentials
from polar.app.stack import request_stop, run_stack, supervise
from polar.config import InferenceConfig, StackConfig, TrainerConfig
from polar.inference.models import model_name, resolve_model
from polar.service_base import ServiceSpec
from polar.service_table import TRAINER

if TYPE_CHECKING:
    from trainer.checkpoints import TrainerState

# Long enough to finish the micro-batch in progress and write a checkpoint of a small model on a CPU.
TRAINER_STOP_TIMEOUT_S = 300.0
ROLLOUT_STORE = "rollout.db"
ENVOY_ACCESS_LOG = "envoy-access.log"
# What a run's folder name keeps in the adapter name and task prefix of a run that joins a stack: the
# characters a task id may hold (polar.rollout.tasks.TASK_ID), the random suffix's 7 aside.
NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
NAME_LENGTH = 48


class JoinError(ValueError):
    """A run that cannot join the stack it names; the message says why and what to change."""


def train_plan(config: StackConfig, run_dir: Path) -> tuple[StackConfig, ServiceSpec]:
    """The stack a run folder's `polar train` starts, and its trainer job.

    The inference server serves the trainer's model, or the run's latest checkpoint as its policy
    version; the rollout store and Envoy's access log (when it would go to stdout, between the
    progress lines) live in the run folder."""
    from trainer.checkpoints import check_compatible, latest_checkpoint

    trainer = dataclasses.replace(config.trainer, run_dir=str(run_dir))
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        check_compatible(checkpoint, trainer.model, {})
    inference = dataclasses.replace(
        config.inference,
        model=str(checkpoint.model_folder) if checkpoint else trainer.model,
        policy_version=checkpoint.state.policy_version if checkpoint else 0,
        release_idle_memory=config.inference.release_idle_memory or shares_a_gpu(trainer, config.inference),
    )
    if trainer.lora_rank:
        # The server holds the base model and an adapter of the trainer's shape (zero until the first
        # push, or the checkpoint's); the trainer pushes the adapter alone.
        inference = dataclasses.replace(
            inference,
            model=trainer.model,
            adapter=str(checkpoint.model_folder) if checkpoint else "",
            lora_rank=trainer.lora_rank,
            lora_alpha=trainer.lora_alpha,
            lora_targets=trainer.lora_targets,
            # A named adapter needs room beside the default one (the run's own server: one is enough).
            max_adapters=max(inference.max_adapters, 1 if trainer.lora_adapter_name else 0),
        )
    envoy = config.envoy
    if envoy.access_log == "-":
        envoy = dataclasses.replace(envoy, access_log=str(run_dir / ENVOY_ACCESS_LOG))
    stack = dataclasses.replace(
        config,
        inference=inference,
        rollout=dataclasses.replace(config.rollout, store=str(run_dir / ROLLOUT_STORE)),
        envoy=envoy,
        trainer=trainer,
    )
    return stack, trainer_job(trainer, "{rollout}", ["{inference}"])


def shares_a_gpu(trainer: TrainerConfig, inference: InferenceConfig) -> bool:
    """Whether the trainer steps on the inference server's GPU ("auto" and "cuda" mean cuda:0; a
    job of N GPUs holds cuda:0 to cuda:N-1), so that the server must give its cache back when idle."""

    def gpu(spec: str) -> str:
        return "cuda:0" if spec in ("auto", "cuda") else spec

    server = gpu(inference.device)
    held = {f"cuda:{rank}" for rank in range(trainer.gpus)} if trainer.gpus > 1 else {gpu(trainer.device)}
    return server.startswith("cuda:") and server in held


def trainer_job(trainer: TrainerConfig, rollout: str, inference: list[str]) -> ServiceSpec:
    """`polar serve trainer` (a torchrun job of it with gpus > 1) as a job of the supervisor: done
    once its steps are, given time to write its checkpoint when stopped."""
    detail = f"{trainer.backend} backend, {trainer.steps or 'unbounded'} steps of {trainer.groups_per_step} groups; run {trainer.run_dir}"
    spec = TRAINER.spec(trainer, detail=detail, rollout_address=rollout, inference=inference)
    if trainer.gpus > 1:
        spec = dataclasses.replace(spec, argv=torchrun_argv(spec.argv, trainer.gpus))
    return dataclasses.replace(spec, finishes=True, stop_timeout_s=TRAINER_STOP_TIMEOUT_S)


def torchrun_argv(serve_argv: tuple[str, ...], processes: int) -> tuple[str, ...]:
    """`polar serve trainer`'s command line as a one-machine torchrun job of the megatron backend:
    its flags go to every rank (trainer.backends.megatron.launch); rank 0 serves, the others follow."""
    python, flags = serve_argv[0], serve_argv[len((sys.executable, "-m", "polar", "serve", TRAINER.name)) :]
    return (
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "trainer.backends.megatron.launch",
        *flags,
    )


def check_before_start(trainer: TrainerConfig, *, dataset: str) -> None:
    """What a run needs that can be checked before any service starts; raises with a clear message."""
    from trainer.dataset import Dataset

    if trainer.gpus > 1 and trainer.backend != "megatron":
        raise ValueError(
            f'[trainer] gpus = {trainer.gpus} needs backend = "megatron" (the {trainer.backend} backend runs in one process)'
        )
    if trainer.lora_adapter_name and not trainer.lora_rank:
        raise ValueError("[trainer] lora_adapter_name names a LoRA adapter: it needs lora_rank > 0")
    Dataset(dataset, seed=trainer.seed, prefix=trainer.task_prefix)
    resolve_model(trainer.model)


def train(config: StackConfig, run_dir: Path, join: str = "") -> int:
    """`polar train`: the stack and the trainer until the trainer is done (0) or Ctrl-C (130); with
    `join` (a running stack's rollout server), the trainer alone on that stack."""
    from trainer.checkpoints import latest_checkpoint

    if join:
        return train_joined(config, run_dir, join)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None and checkpoint.state.lora_adapter_name and not config.trainer.lora_adapter_name:
        # Named by `--join` (the config names none): its results cursor is the shared stack's.
        raise JoinError(
            f"{run_dir} holds a run that trained as adapter {checkpoint.state.lora_adapter_name!r} on a shared"
            " stack: resume it with --join"
        )
    check_before_start(config.trainer, dataset=config.trainer.dataset)
    run_dir.mkdir(parents=True, exist_ok=True)
    stack, trainer = train_plan(config, run_dir)
    run_stack(stack, jobs=[trainer])
    return run_outcome(run_dir, config.trainer.steps)


def run_outcome(run_dir: Path, steps: int) -> int:
    """Where the run's files are, and its exit status: 0 when its steps are done."""
    from trainer.checkpoints import latest_checkpoint

    print(f"polar train: run folder {run_dir} (metrics.jsonl, reward.png, checkpoints/, tensorboard/)", flush=True)
    checkpoint = latest_checkpoint(run_dir)
    # The supervision also ends without error on Ctrl-C: then the run is not done, and says so like
    # any interrupted command. Run again, it resumes.
    return 0 if steps and checkpoint is not None and checkpoint.state.step >= steps else 130


def train_joined(config: StackConfig, run_dir: Path, address: str) -> int:
    """`polar train --join`: the trainer alone, a LoRA run on the running stack whose rollout server
    is at `address`, until it is done (0) or Ctrl-C (130). Its adapter, tasks and TrainerService
    port are its own (`joined_trainer`); the stack's inference servers come from its control plane
    and must have room for the adapter (`joinable_servers`), all checked before the trainer starts.
    The trainer calls with the stack's credentials, which the `polar` commands use."""
    from trainer.checkpoints import latest_checkpoint

    if not config.trainer.lora_rank:
        raise JoinError(
            "--join trains a LoRA adapter beside the other runs of a shared stack: set [trainer] lora_rank"
            " (a full-weight run would overwrite the base model the stack serves to every run)"
        )
    resumed = latest_checkpoint(run_dir)
    trainer = joined_trainer(config.trainer, run_dir, resumed.state if resumed else None)
    check_before_start(trainer, dataset=trainer.dataset)
    found = credentials.for_commands()
    if found is not None and credentials.TRAINER not in found.tokens:
        raise JoinError(
            f"the credentials in {found.folder} hold no trainer token: a run joins a stack with the stack's own"
            " credentials (its machine's state folder, or $POLAR_CREDENTIALS naming a copy of it)"
        )
    inference = joinable_servers(trainer, address, found, resumed=resumed is not None)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"polar train: joining the stack at {address} as adapter {trainer.lora_adapter_name!r}, tasks"
        f" {trainer.task_prefix}-NNNNNN; inference {', '.join(inference)}",
        flush=True,
    )
    with credentials.handed_to_children(found):
        supervise(
            [trainer_job(trainer, address, inference)],
            startup_timeout_s=config.startup_timeout_s,
            stop_timeout_s=config.stop_timeout_s,
            command="polar train",
        )
    return run_outcome(run_dir, trainer.steps)


def joined_trainer(trainer: TrainerConfig, run_dir: Path, resumed: TrainerState | None) -> TrainerConfig:
    """The trainer of a run joining a stack. Its adapter name and task prefix, where the config
    leaves them at their defaults, are those its checkpoint recorded, else the run folder's name with
    a random suffix: two runs of one config in two folders, or a folder used again after an earlier
    run, share neither tasks nor an adapter. Its TrainerService takes a free port unless the config
    moves it off the default, so that runs side by side do not fight over one."""
    if resumed is not None and not resumed.lora_adapter_name:
        raise JoinError(
            f"{run_dir} holds a run that trained on a stack of its own (step {resumed.step}):"
            " resume it without --join, or join with a new run folder"
        )
    if resumed is not None:
        name = trainer.lora_adapter_name or resumed.lora_adapter_name
    else:
        folder = NAME_CHARS.sub("-", run_dir.resolve().name).strip("-._")[:NAME_LENGTH] or "run"
        name = trainer.lora_adapter_name or f"{folder}-{secrets.token_hex(3)}"
    prefix = trainer.task_prefix
    if prefix == TrainerConfig.task_prefix:
        prefix = resumed.task_prefix if resumed is not None and resumed.task_prefix else name
    return dataclasses.replace(
        trainer,
        run_dir=str(run_dir),
        lora_adapter_name=name,
        task_prefix=prefix,
        port=0 if trainer.port == TrainerConfig.port else trainer.port,
    )


def joinable_servers(
    trainer: TrainerConfig, address: str, found: credentials.Credentials | None, *, resumed: bool
) -> list[str]:
    """The inference servers of the stack whose rollout server is at `address` (those its control
    plane lists, draining ones left out), each checked to serve the trainer's model with room for its
    adapter; and, for a fresh run, no task of its prefix on the stack. JoinError saying what is wrong."""
    import grpc

    from polar.rollout.client import RolloutClient, RolloutError
    from polar.v1 import inference_pb2, inference_pb2_grpc
    from polar.xds.snapshot import INFERENCE_CLUSTER
    from trainer.dataset import Dataset

    try:
        with RolloutClient(address) as rollout:
            upstreams = rollout.upstreams().upstreams
            held = set() if resumed else rollout.existing_task_ids()
    except RolloutError as exc:
        raise JoinError(f"cannot join the stack at {address}: {exc}") from None
    servers = [u.address for u in upstreams if u.cluster == INFERENCE_CLUSTER and not u.draining]
    if not servers:
        raise JoinError(
            f"the stack at {address} lists no inference server (is its control plane a `polar serve xds` apart?"
            " then name that stack's rollout server)"
        )
    dataset = Dataset(trainer.dataset, seed=trainer.seed, prefix=trainer.task_prefix)
    clash = sorted(task_id for task_id in held if dataset.owns(task_id))
    if clash:
        raise JoinError(
            f"the stack at {address} holds tasks of prefix {trainer.task_prefix!r} already ({clash[0]}, ...:"
            " an earlier run's): set another [trainer] task_prefix, or leave it unset for one of the run's own"
        )
    name, targets = trainer.lora_adapter_name, {t.strip() for t in trainer.lora_targets.split(",") if t.strip()}
    for server in servers:
        with credentials.channel(server, credentials.TRAINER, found) as channel:
            try:
                info = (
                    inference_pb2_grpc.InferenceServiceStub(channel)
                    .GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30)
                    .model_info
                )
            except grpc.RpcError as exc:
                raise JoinError(
                    f"the stack's inference server {server}: GetModelInfo failed: {exc.code().name}: {exc.details()}"
                ) from None
        where = f"the inference server {server} of the stack at {address}"
        if not info.max_adapters:
            raise JoinError(
                f"{where} has no room for adapters: start the stack with [inference] lora_rank and"
                " max_adapters (how many runs share it)"
            )
        if info.name != model_name(trainer.model):
            raise JoinError(
                f"{where} serves {info.name!r}, the run's [trainer] model is {trainer.model!r}: a run's"
                " adapter trains over the base model the stack serves"
            )
        named = [adapter.name for adapter in info.adapters if adapter.name]
        if name in named and not resumed:
            raise JoinError(
                f"{where} holds an adapter named {name!r} already (another run's): set another [trainer]"
                " lora_adapter_name, or leave it unset for one of the run's own"
            )
        if name not in named and len(named) >= info.max_adapters:
            raise JoinError(
                f"{where} holds {len(named)} adapters, its max_adapters: no room for another run until one"
                f" ends ({', '.join(named)})"
            )
        default = next((adapter for adapter in info.adapters if not adapter.name), None)
        if default is not None and trainer.lora_rank > default.rank:
            raise JoinError(f"[trainer] lora_rank {trainer.lora_rank} is above {where}'s lora_rank {default.rank}")
        if default is not None and targets - set(default.targets):
            raise JoinError(
                f"[trainer] lora_targets {', '.join(sorted(targets - set(default.targets)))}: not among {where}'s"
                f" lora_targets ({', '.join(default.targets)})"
            )
    return servers


def evaluate(config: StackConfig, checkpoint: Path | None, out: Path) -> int:
    """`polar eval`: the held-out tasks through the stack serving `checkpoint` (a checkpoint folder or
    a Hugging Face folder; None: the [trainer] model); the table, and the report as JSON at `out`."""
    from polar.lora import is_adapter_folder, read_adapter
    from trainer.checkpoints import STATE_FILE, Checkpoint, TrainerState
    from trainer.evaluation import EvaluationStopped, write_report
    from trainer.evaluation import evaluate as run_evaluation

    trainer = config.trainer
    if not trainer.heldout:
        raise ValueError("no held-out tasks: set [trainer] heldout to a task file (the `polar submit` format)")
    check_before_start(trainer, dataset=trainer.heldout)
    model, adapter = trainer.model, ""
    if checkpoint is not None:
        if (checkpoint / STATE_FILE).is_file():
            model = str(Checkpoint(checkpoint, TrainerState()).model_folder)
        elif not is_adapter_folder(checkpoint):
            model = str(resolve_model(str(checkpoint)))
        if is_adapter_folder(model) or is_adapter_folder(checkpoint):
            # A LoRA checkpoint (or a PEFT folder): the model its config names, plus the adapter.
            adapter = model if is_adapter_folder(model) else str(checkpoint)
            model = read_adapter(adapter).base_model or trainer.model
            resolve_model(model)
    done = threading.Event()
    ending = threading.Lock()  # the stop signal is sent only while the stack still supervises
    outcome: dict[str, object] = {}

    def run(addresses: dict[str, str]) -> None:
        try:
            report = run_evaluation(trainer, addresses["rollout"], adapter or model, done, sys.stdout)
            write_report(report, out)
            outcome["report"] = report
        except EvaluationStopped:
            pass
        except Exception as exc:
            outcome["error"] = exc
        finally:
            with ending:
                if not done.is_set():
                    request_stop()  # ends the supervision: the stack stops

    with tempfile.TemporaryDirectory(prefix="polar-eval-") as scratch:
        stack = dataclasses.replace(
            config,
            inference=dataclasses.replace(config.inference, model=model, adapter=adapter),
            rollout=dataclasses.replace(config.rollout, store=str(Path(scratch) / ROLLOUT_STORE)),
            envoy=config.envoy
            if config.envoy.access_log != "-"
            else dataclasses.replace(config.envoy, access_log=os.devnull),
        )
        try:
            run_stack(
                stack, on_ready=lambda addresses: threading.Thread(target=run, args=(addresses,), daemon=True).start()
            )
        finally:
            with ending:
                done.set()
    if "error" in outcome:
        error = outcome["error"]
        raise error if isinstance(error, (OSError, ValueError, LookupError)) else RuntimeError(str(error))
    if "report" not in outcome:
        return 130
    print(outcome["report"].table())
    print(f"polar eval: report in {out}")
    return 0


def evaluate_run(config: StackConfig, run_dir: Path) -> int:
    """`polar eval --run-dir`: the base model (before training) and the run's latest checkpoint (after),
    each evaluated once into RUN/eval/LABEL.json (a report already there is kept), then the
    comparison of every report in the folder and RUN/eval.png."""
    from trainer.checkpoints import latest_checkpoint
    from trainer.evaluation import BASE_LABEL, EVAL_FOLDER, EVAL_PLOT, comparison_table, read_reports
    from trainer.metrics import plot_evaluations

    folder = run_dir / EVAL_FOLDER
    wanted: list[tuple[str, Path | None]] = [(BASE_LABEL, None)]
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        wanted.append((f"step-{checkpoint.state.step}", checkpoint.path))
    for label, path in wanted:
        out = folder / f"{label}.json"
        if out.is_file():
            print(f"polar eval: {label}: already evaluated ({out})", flush=True)
            continue
        print(f"polar eval: {label}: evaluating {path or config.trainer.model}", flush=True)
        code = evaluate(config, path, out)
        if code:
            return code
    reports = read_reports(folder)
    plot_evaluations(reports, run_dir / EVAL_PLOT)
    print(comparison_table(reports))
    print(f"polar eval: reports in {folder}, plot {run_dir / EVAL_PLOT}")
    return 0


def merge_checkpoint(checkpoint: Path, out: Path, base_model: str = "") -> Path:
    """`polar merge`: a LoRA checkpoint (a run's step folder, or a PEFT adapter folder) merged into
    its base model, written to `out` as a Hugging Face folder; the base model's folder."""
    from polar.lora import LoraError, is_adapter_folder, write_merged_model
    from trainer.checkpoints import STATE_FILE, Checkpoint, TrainerState

    adapter = Checkpoint(checkpoint, TrainerState()).model_folder if (checkpoint / STATE_FILE).is_file() else checkpoint
    if not is_adapter_folder(adapter):
        raise LoraError(f"{checkpoint} is no LoRA checkpoint (no adapter_config.json in {adapter})")
    return write_merged_model(adapter, out, base_model)
