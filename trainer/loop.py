"""The training loop: released groups in, GRPO steps, new weights out to the inference servers.

    restore the latest checkpoint (weights, optimizer, cursor, policy version), or start fresh
    make sure the inference servers serve the trainer's weights as its policy version
    for each step:
        submit dataset tasks so that groups_per_step + groups_ahead groups are in flight
        take groups_per_step groups from the results stream (stale ones dropped or kept), screen
            them (trainer/screening.py: traces too long to train on, forks, failed calls, counted)
        advantages per group, token weights per trace, packed micro-batches
        updates_per_step optimizer updates
        Pause -> UpdateWeights -> Resume on every inference server: the next policy version
        metrics line, progress, a checkpoint every checkpoint_every steps
    a checkpoint at the end, and on a stop request (the last completed step; a step cut short
    changes nothing)

Tasks are submitted ahead of the step that will train on them, so the rollouts of the next groups run
while this step trains; each trajectory records the policy versions its tokens were sampled with,
and a group sampled more than max_staleness versions ago is dropped or, with stale_groups = "keep",
trained on with the importance weights that correct for its older behaviour policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from polar import credentials
from polar.config import TrainerConfig
from polar.inference.constraints import ConstraintError, ConstraintViolation, OutputConstraint, TokenGrammar
from polar.inference.models import model_name
from polar.rollout.client import Group, GroupStream, RolloutClient
from polar.trajectory import BuiltTrace, verify, views_from_protos
from polar.v1 import common_pb2
from trainer import grpo
from trainer.backends.base import Backend, UpdateAborted
from trainer.batches import pack
from trainer.checkpoints import TrainerState, check_compatible, checkpoints_folder, latest_checkpoint, save_checkpoint
from trainer.dataset import Dataset
from trainer.metrics import PLOT_FILE, MetricsLog, Progress, plot_rewards, sharing_metrics
from trainer.screening import Screener
from trainer.sequences import TrainSequence
from trainer.weight_sync import InferencePool

log = logging.getLogger("polar.trainer")

GROUP_POLL_S = 0.5  # how often a wait for groups looks at the stop request


class TrainingError(RuntimeError):
    """The run cannot go on; the message names what (a group that is not token-faithful, a model
    the inference servers do not serve, ...)."""


class StopRequested(Exception):
    """The run was asked to stop while it waited or trained."""


@dataclass(frozen=True)
class StepBatch:
    """What one step trains on, and what it counted on the way."""

    groups: list[Group]
    consumed: int  # groups taken from the stream, dropped ones included
    cursor: str  # the cursor after the last group taken
    trajectories: int
    rewards: list[float]
    sequences_per_update: list[list[TrainSequence]]
    degenerate_groups: int
    stale_dropped: list[str]  # task ids of the groups dropped as too stale
    too_long_dropped: list[str]  # task ids of the groups left out for a trace too long to train on
    truncated_skipped: int
    max_staleness: int
    counts: dict[str, int]  # what screening counted (trainer/screening.py)


def stale_lag(group: Group, policy_version: int) -> int:
    """How many versions behind the trainer the oldest sampled token of the group is (0 when none)."""
    lags = [policy_version - t.min_policy_version for t in group.trajectories if any(tr.loss_mask for tr in t.traces)]
    return max(lags, default=0)


def too_stale(group: Group, policy_version: int, config: TrainerConfig) -> bool:
    """Whether the group is dropped: sampled more than max_staleness versions ago, with stale_groups
    = "drop" (with "keep" it is trained on, its importance weights correcting for the old policy)."""
    return config.stale_groups == "drop" and stale_lag(group, policy_version) > config.max_staleness


def check_faithful(group: Group) -> None:
    """TrainingError naming the session when a trace is not what the engine sampled."""
    for trajectory in group.trajectories:
        report = verify(views_from_protos(trajectory.calls), [BuiltTrace.from_proto(t) for t in trajectory.traces])
        if not report.ok:
            first = report.problems[0]
            raise TrainingError(
                f"session {trajectory.session_id} of task {trajectory.task_id}: its traces are not token-faithful "
                f"({len(report.problems)} problems; first: {first})"
            )


GrammarSource = Callable[[], TokenGrammar]


def constraint_masks(
    name: str, trace: common_pb2.Trace, grammar: GrammarSource | None
) -> tuple[tuple[int, np.ndarray], ...]:
    """(position, allowed tokens) of every token of the trace sampled under a constraint: its grammar
    replayed over the call's sampled ids, so the trainer masks the logits as the engine did."""
    masks: list[tuple[int, np.ndarray]] = []
    for segment in trace.segments:
        if segment.kind != common_pb2.TraceSegment.KIND_SAMPLED or not segment.sampling.HasField("constraint"):
            continue
        if grammar is None:
            raise TrainingError(f"trace {name} holds a constrained call, and no grammar was given to replay it")
        try:
            constraint = OutputConstraint.from_proto(segment.sampling.constraint)
            allowed = grammar().replay(constraint, trace.token_ids[segment.start : segment.end])
        except (ConstraintError, ConstraintViolation) as exc:
            raise TrainingError(f"trace {name}, call {segment.call_id}: {exc}") from exc
        masks += [(segment.start + offset, row) for offset, row in enumerate(allowed)]
    return tuple(masks)


def trace_sequence(
    trajectory: common_pb2.Trajectory,
    trace: common_pb2.Trace,
    advantage: float,
    weight: float,
    grammar: GrammarSource | None = None,
) -> TrainSequence:
    """One trace as the trainer packs it: tokens, mask, behaviour logprobs, and per token the sampling
    (temperature, top_p, top_k, and a constrained call's mask, replayed by `grammar`) its call was drawn with."""
    length = len(trace.token_ids)
    temperature = np.ones(length, dtype=np.float32)
    top_p = np.ones(length, dtype=np.float32)
    top_k = np.zeros(length, dtype=np.int32)
    for segment in trace.segments:
        if segment.kind == common_pb2.TraceSegment.KIND_SAMPLED and segment.HasField("sampling"):
            temperature[segment.start : segment.end] = segment.sampling.temperature
            top_p[segment.start : segment.end] = segment.sampling.top_p or 1.0
            top_k[segment.start : segment.end] = segment.sampling.top_k
    name = f"{trajectory.session_id}/{trace.trace_id}"
    return TrainSequence(
        name=name,
        token_ids=np.asarray(trace.token_ids, dtype=np.int64),
        loss_mask=np.asarray(trace.loss_mask, dtype=bool),
        behaviour_logprobs=np.asarray(trace.behaviour_logprobs, dtype=np.float32),
        advantage=advantage,
        token_weight=weight,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        constraint_masks=constraint_masks(name, trace, grammar),
    )


def group_sequences(
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    config: TrainerConfig,
    grammar: GrammarSource | None = None,
) -> tuple[list[TrainSequence], int]:
    """The traces of these groups with their advantages and step-normalised token weights; and how
    many truncated traces were left out (train_truncated = false)."""
    picked: list[tuple[common_pb2.Trajectory, common_pb2.Trace, float]] = []
    skipped = 0
    for group, group_advantages in zip(groups, advantages):
        for trajectory, advantage in zip(group.trajectories, group_advantages):
            for trace in trajectory.traces:
                if trace.truncated and not config.train_truncated:
                    skipped += 1
                    continue
                picked.append((trajectory, trace, float(advantage)))
    weightings = [
        grpo.TraceWeighting(
            session_id=trajectory.session_id,
            trace_weight=trace.weight,
            session_weight=trajectory.weight,
            trainable_tokens=int(sum(trace.loss_mask)),
        )
        for trajectory, trace, _ in picked
    ]
    weights = grpo.trace_token_weights(weightings, config.loss_aggregation)
    sequences = [
        trace_sequence(trajectory, trace, advantage, weight, grammar)
        for (trajectory, trace, advantage), weight in zip(picked, weights)
        if weight > 0
    ]
    return sequences, skipped


class TrainingRun:
    """One run of the loop in a run folder; `run()` trains until the configured steps or a stop."""

    def __init__(
        self,
        config: TrainerConfig,
        run_dir: Path,
        rollout_address: str,
        inference_addresses: Sequence[str],
        backend_factory: Callable[[TrainerConfig, str], Backend],
        out: TextIO,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.out = out
        self.stop = threading.Event()
        self.model_lock = threading.Lock()  # held while the weights change or are written out
        self.status_lock = threading.Lock()
        self.last_metrics: dict[str, float] = {}
        self.dataset = Dataset(
            config.dataset, seed=config.seed, prefix=config.task_prefix, group_size=config.group_size
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = latest_checkpoint(run_dir)
        self.backend = backend_factory(config, str(checkpoint.model_folder) if checkpoint else config.model)
        if checkpoint is not None:
            check_compatible(checkpoint, config.model, self.backend.model_description)
            self.backend.load_optimizer(checkpoint.optimizer_file)
            self.state = checkpoint.state
        else:
            self.state = TrainerState(base_model=config.model, model=self.backend.model_description)
        self.state.task_prefix, self.state.lora_adapter_name = config.task_prefix, config.lora_adapter_name
        self.model_name = model_name(config.model)
        self._grammar: TokenGrammar | None = None  # made when the first constrained call is trained on
        self.rollout = RolloutClient(rollout_address, credentials.TRAINER)
        self.inference = InferencePool(
            inference_addresses,
            transport=config.weight_sync,
            bucket_bytes=config.weight_sync_bucket_mb << 20,
            timeout_s=config.weight_sync_timeout_s,
            adapter=config.lora_adapter_name,
            device=self.backend.device,
        )
        self.started = time.monotonic()
        self.step_timings = {"wait": 0.0, "train": 0.0, "sync": 0.0}
        self.progress = Progress(config.steps, out)
        # Whether this run loaded its named adapter: one refused (its name is another run's) must
        # leave that run's adapter alone when it ends.
        self.adapter_loaded = False
        self.screener = Screener(self.backend.microbatch_tokens, config.too_long, self._warn)

    # -- the run -------------------------------------------------------------------------------------

    def run(self) -> TrainerState:
        """Train until `steps` steps are done or `stop` is set; returns the final state."""
        progress = self.progress
        metrics = MetricsLog(self.run_dir, self.state.step)
        stream = None
        try:
            self._align_inference(progress)
            existing = self.rollout.existing_task_ids()
            if self.state.step:
                progress.note(f"resuming after step {self.state.step} (policy version {self.state.policy_version})")
            stream = self.rollout.groups(self.state.cursor)
            dirty = False
            while not self.config.steps or self.state.step < self.config.steps:
                try:
                    row = self._step(stream, existing)
                except (StopRequested, UpdateAborted):
                    break
                dirty = True
                metrics.append(row)
                progress.step(row)
                if self.config.checkpoint_every and self.state.step % self.config.checkpoint_every == 0:
                    self.save_checkpoint()
                    dirty = False
            if dirty or not latest_checkpoint(self.run_dir):
                self.save_checkpoint()
            if metrics.rows:
                plot_rewards(metrics.rows, self.run_dir / PLOT_FILE)
            if self.stop.is_set():
                progress.note(f"stopped after step {self.state.step}; a rerun resumes from its checkpoint")
            else:
                progress.note(f"done: {self.state.step} steps; metrics in {self.run_dir / 'metrics.jsonl'}")
        finally:
            if stream is not None:
                stream.close()
            metrics.close()
            self.rollout.close()
            if self.adapter_loaded:
                self.inference.unload_adapter()  # a resumed run loads it again
            self.inference.close()
        return self.state

    def _warn(self, message: str) -> None:
        self.progress.note(f"warning: {message}")

    def _align_inference(self, progress: Progress) -> None:
        """Make every inference server serve the trainer's weights as the trainer's policy version."""
        infos = self.inference.model_infos()
        vocab = self.backend.model_description["vocab_size"]
        for address, info in zip(self.inference.addresses, infos):
            if info.vocab_size != vocab:
                raise TrainingError(
                    f"inference server {address} serves {info.name!r} with a vocabulary of {info.vocab_size}, "
                    f"the trainer's model has {vocab}: they must be the same model"
                )
        if self.config.lora_adapter_name:
            self._load_adapter(progress)
            return
        if all(info.policy_version == self.state.policy_version for info in infos):
            return
        progress.note("the inference servers do not serve the trainer's weights yet: pushing them")
        with self.model_lock:
            result = self.inference.push(self.backend.hf_weights, note=f"step {self.state.step}")
        self.state.policy_version = result.policy_version

    def _load_adapter(self, progress: Progress) -> None:
        """Load the run's named adapter on every server, as the trainer's policy version: zero, which a
        fresh run's adapter computes too (its B is zero); a resumed run then pushes its own. A fresh run
        whose name a server holds already fails there (another run of that name); a resumed run takes
        its name back."""
        config, resumed = self.config, self.state.step > 0
        self.inference.load_adapter(
            config.lora_rank, config.lora_alpha, config.lora_targets, self.state.policy_version, replace=resumed
        )
        self.adapter_loaded = True
        if resumed:
            progress.note(f"pushing the checkpoint's adapter to the servers as {config.lora_adapter_name!r}")
            with self.model_lock:
                result = self.inference.push(self.backend.hf_weights, note=f"step {self.state.step}")
            self.state.policy_version = result.policy_version

    def _top_up(self, existing: set[str], taken: int = 0) -> None:
        """Submit tasks until groups_per_step + groups_ahead groups are in flight (`taken`: groups
        this step already took from the stream)."""
        target = self.state.groups_consumed + taken + self.config.groups_per_step + self.config.groups_ahead
        tasks = []
        while self.state.tasks_submitted < target:
            task = self.dataset.task(self.state.tasks_submitted)
            task.adapter = self.config.lora_adapter_name  # its sessions sample from this run's adapter
            if task.task_id not in existing:
                tasks.append(task)
                existing.add(task.task_id)
            self.state.tasks_submitted += 1
        self.rollout.submit(tasks)

    def _collect(self, stream: GroupStream, existing: set[str]) -> StepBatch:
        """groups_per_step usable groups from the stream (stale ones handled per stale_groups)."""
        groups, dropped, lag_max, taken, cursor = [], [], 0, 0, self.state.cursor
        while len(groups) < self.config.groups_per_step:
            if self.stop.is_set():
                raise StopRequested
            group = stream.next(GROUP_POLL_S)
            if group is None:
                continue
            cursor = group.cursor
            if not self.dataset.owns(group.trajectories[0].task_id):
                continue  # another run's group on a shared rollout server: passed over, not consumed
            taken += 1
            if too_stale(group, self.state.policy_version, self.config):
                dropped.append(group.trajectories[0].task_id)
                # A dropped group is replaced by another submission, so the step still fills.
                self._top_up(existing, taken)
                continue
            check_faithful(group)
            lag_max = max(lag_max, stale_lag(group, self.state.policy_version))
            groups.append(group)
        screened = self.screener.screen(groups)
        groups = screened.groups
        rewards_per_group = [np.array([t.reward for t in g.trajectories], dtype=np.float64) for g in groups]
        advantages = [
            grpo.group_advantages(
                torch.as_tensor(r), scale=self.config.advantage_scale, leave_one_out=self.config.leave_one_out
            ).numpy()
            for r in rewards_per_group
        ]
        degenerate = sum(grpo.is_degenerate(torch.as_tensor(r)) for r in rewards_per_group)
        # Mini-batches of whole groups, one optimizer update each, token weights normalised per update.
        updates = max(1, min(self.config.updates_per_step, len(groups)))
        bounds = np.linspace(0, len(groups), updates + 1).astype(int)
        per_update, skipped = [], 0
        for a, b in zip(bounds[:-1], bounds[1:]):
            sequences, truncated = group_sequences(groups[a:b], advantages[a:b], self.config, self._token_grammar)
            per_update.append(sequences)
            skipped += truncated
        return StepBatch(
            groups=groups,
            consumed=taken,
            cursor=cursor,
            trajectories=sum(len(g.trajectories) for g in groups),
            rewards=[float(x) for r in rewards_per_group for x in r],
            sequences_per_update=per_update,
            degenerate_groups=int(degenerate),
            stale_dropped=dropped,
            too_long_dropped=screened.dropped,
            truncated_skipped=skipped,
            max_staleness=lag_max,
            counts=screened.counts,
        )

    def _step(self, stream: GroupStream, existing: set[str]) -> dict[str, float]:
        config = self.config
        self._top_up(existing)
        wait_started = time.perf_counter()
        batch = self._collect(stream, existing)
        seconds_wait = time.perf_counter() - wait_started

        train_started = time.perf_counter()
        loss_config = grpo.LossConfig(
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            importance_cap=config.importance_cap,
            kl_coef=config.kl_coef,
        )
        micro_batches = [
            pack(sequences, self.backend.microbatch_tokens, share_prefixes=config.share_prefixes)
            for sequences in batch.sequences_per_update
        ]
        results = []
        with self.model_lock:
            # The policy at the start of the step, for the clipped ratio of every update after the first.
            old = None
            if len(micro_batches) > 1:
                old = [self.backend.logprobs(mbs) for mbs in micro_batches]
            for index, mbs in enumerate(micro_batches):
                if not mbs:
                    continue
                results.append(
                    self.backend.update(
                        mbs, loss_config, old_logprobs=None if old is None else old[index], should_stop=self.stop.is_set
                    )
                )
            seconds_train = time.perf_counter() - train_started
            # The step is done: from here on a stop still finishes the sync and is saved as this step.
            self.state = replace(
                self.state,
                step=self.state.step + 1,
                cursor=batch.cursor,
                groups_consumed=self.state.groups_consumed + batch.consumed,
                trajectories_consumed=self.state.trajectories_consumed + batch.trajectories,
                trained_tokens=self.state.trained_tokens + sum(r.trainable_tokens for r in results),
            )
            sync = self.inference.push(self.backend.hf_weights, note=f"step {self.state.step}")
            self.state.policy_version = sync.policy_version
        elapsed = self.state.elapsed_s + (time.monotonic() - self.started)
        rewards = np.array(batch.rewards)
        stats = _mean_stats(results)
        row = {
            "step": self.state.step,
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "reward_std": float(rewards.std()) if len(rewards) else 0.0,
            "pass_rate": float((rewards >= config.pass_threshold).mean()) if len(rewards) else 0.0,
            "loss": float(sum(r.loss for r in results)),
            "clip_fraction": stats.get("clip_fraction", 0.0),
            "kl": stats.get("kl", 0.0),
            "is_weight_mean": stats.get("is_weight_mean", 1.0),
            "grad_norm": max((r.grad_norm for r in results), default=0.0),
            "policy_version": self.state.policy_version,
            "tokens": sum(r.tokens for r in results),
            "trainable_tokens": sum(r.trainable_tokens for r in results),
            **sharing_metrics(micro_batches),
            "groups": len(batch.groups),
            "groups_degenerate": batch.degenerate_groups,
            "groups_stale_dropped": len(batch.stale_dropped),
            "traces_truncated_skipped": batch.truncated_skipped,
            "staleness_max": batch.max_staleness,
            **batch.counts,
            "trajectories": batch.trajectories,
            "seconds_rollout_wait": seconds_wait,
            "seconds_train": seconds_train,
            "seconds_weight_sync": sync.seconds,
            "weight_sync_gbps": sync.gb_per_s,
            "weight_sync_bytes": sync.bytes_sent,
            "weight_sync_transport": sync.transport,  # "stream", "cuda_ipc", "nccl", "gloo", or several joined by "+"
            "weight_sync_servers": [
                server.metrics() for server in sync.servers
            ],  # each server's transport, seconds, GB/s
            "elapsed_s": elapsed,
            # Which groups the step took (trained on, then dropped), so a resumed run can be checked
            # to neither repeat nor skip one.
            "task_ids": [g.trajectories[0].task_id for g in batch.groups],
            "task_ids_dropped": batch.stale_dropped + batch.too_long_dropped,
        }
        with self.status_lock:
            self.last_metrics = row
        return row

    # -- checkpoints ---------------------------------------------------------------------------------

    def _token_grammar(self) -> TokenGrammar:
        if self._grammar is None:
            self._grammar = TokenGrammar.for_model(self.config.model, self.backend.model_description["vocab_size"])
        return self._grammar

    def save_checkpoint(self, folder: Path | None = None):
        """A checkpoint of the last completed step as folder/step-N (default: the run's checkpoints
        folder); waits for a step in progress to finish."""
        with self.model_lock:
            state = replace(self.state, elapsed_s=self.state.elapsed_s + (time.monotonic() - self.started))
            root = folder or checkpoints_folder(self.run_dir)
            return save_checkpoint(root, self.backend, state, self.model_name, self.config.keep_checkpoints)


def _mean_stats(results) -> dict[str, float]:
    if not results:
        return {}
    keys = set().union(*(r.stats for r in results))
    return {key: float(np.mean([r.stats[key] for r in results if key in r.stats])) for key in keys}
