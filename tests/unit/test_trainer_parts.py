"""The trainer's bookkeeping around the math: the dataset order, staleness, the traces a step trains
on and their weights, pass@k, metrics files and checkpoints of a run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar.config import TrainerConfig
from polar.rollout.client import Group
from polar.v1 import common_pb2
from trainer.backends.base import BackendError, activation_bytes, recompute_activations
from trainer.checkpoints import CheckpointError, TrainerState, check_compatible, latest_checkpoint, save_checkpoint
from trainer.dataset import Dataset, DatasetError
from trainer.evaluation import pass_at_k
from trainer.loop import group_sequences, stale_lag, too_stale, trace_sequence
from trainer.metrics import STEP_KEYS, MetricsLog, read_metrics

TASK_LINE = (
    '{{"taskId": "{id}", "instruction": "say {id}", "groupSize": 2, '
    '"harness": {{"preset": "command", "command": ["true"]}}}}\n'
)


def write_dataset(path: Path, count: int) -> Path:
    path.write_text("# a comment line\n" + "".join(TASK_LINE.format(id=f"t{i}") for i in range(count)))
    return path


def test_dataset_order_is_fixed_by_index_alone(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "tasks.jsonl", 5)
    a = Dataset(str(path), seed=3, prefix="run")
    b = Dataset(str(path), seed=3, prefix="run")
    first = [a.task(n).metadata["dataset_task"] for n in range(10)]
    assert first == [b.task(n).metadata["dataset_task"] for n in reversed(range(10))][::-1]
    # Every epoch holds every task once, in its own order.
    assert sorted(first[:5]) == sorted(first[5:]) == [f"t{i}" for i in range(5)]
    assert a.task(7).task_id == "run-000007"
    assert Dataset(str(path), seed=3, prefix="run", group_size=6).task(0).group_size == 6
    assert a.task(0).group_size == 2


def test_dataset_errors_name_the_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no dataset"):
        Dataset("", seed=0, prefix="p")
    with pytest.raises(DatasetError, match="cannot read dataset .*missing.jsonl"):
        Dataset(str(tmp_path / "missing.jsonl"), seed=0, prefix="p")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(TASK_LINE.format(id="ok") + '{"instruction": "x", "groupSize": 0}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: .*group_size"):
        Dataset(str(bad), seed=0, prefix="p")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("# nothing\n")
    with pytest.raises(DatasetError, match="holds no tasks"):
        Dataset(str(empty), seed=0, prefix="p")


def trajectory(
    session: str, reward: float, versions: tuple[int, int], traces: list[common_pb2.Trace]
) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        session_id=session,
        trajectory_id=session,
        reward=reward,
        weight=1.0,
        min_policy_version=versions[0],
        max_policy_version=versions[1],
        traces=traces,
    )


def trace(
    trace_id: str, mask: list[int], weight: float, *, truncated: bool = False, temperature: float = 0.7
) -> common_pb2.Trace:
    prompt = mask.index(1) if 1 in mask else len(mask)
    segments = [common_pb2.TraceSegment(kind=common_pb2.TraceSegment.KIND_PROMPT, start=0, end=prompt)]
    if prompt < len(mask):
        segments.append(
            common_pb2.TraceSegment(
                kind=common_pb2.TraceSegment.KIND_SAMPLED,
                start=prompt,
                end=len(mask),
                sampling=common_pb2.SamplingParams(temperature=temperature, top_p=0.9, top_k=5),
            )
        )
    return common_pb2.Trace(
        trace_id=trace_id,
        token_ids=list(range(len(mask))),
        loss_mask=mask,
        behaviour_logprobs=[-0.5 * m for m in mask],
        segments=segments,
        weight=weight,
        truncated=truncated,
    )


def test_stale_lag_is_the_oldest_sampled_token() -> None:
    group = Group(
        "c1",
        [
            trajectory("s0", 1.0, (4, 5), [trace("a", [0, 1], 1.0)]),
            trajectory("s1", 0.0, (2, 5), [trace("a", [0, 1], 1.0)]),
            # Nothing sampled: its versions say nothing about staleness.
            trajectory("s2", 0.0, (0, 0), []),
        ],
    )
    assert stale_lag(group, 5) == 3
    assert stale_lag(Group("c", [trajectory("s", 0.0, (0, 0), [])]), 9) == 0


def test_the_staleness_bound_drops_or_keeps_old_groups() -> None:
    fresh = Group("c1", [trajectory("s0", 1.0, (4, 5), [trace("a", [0, 1], 1.0)])])
    old = Group("c2", [trajectory("s1", 1.0, (2, 5), [trace("a", [0, 1], 1.0)])])
    drop = TrainerConfig(max_staleness=1, stale_groups="drop")
    assert not too_stale(fresh, 5, drop) and too_stale(old, 5, drop)
    assert not too_stale(old, 3, drop)  # lag 1 at version 3
    assert not too_stale(old, 5, TrainerConfig(max_staleness=1, stale_groups="keep"))
    assert not too_stale(old, 5, TrainerConfig(max_staleness=3))


def test_trace_sequence_carries_each_tokens_sampling() -> None:
    t = trace("a", [0, 0, 1, 1], 1.0, temperature=0.6)
    seq = trace_sequence(trajectory("s", 1.0, (0, 0), [t]), t, advantage=0.5, weight=0.25)
    assert seq.name == "s/a"
    np.testing.assert_allclose(seq.temperature, [1.0, 1.0, 0.6, 0.6], rtol=1e-6)
    np.testing.assert_allclose(seq.top_p, [1.0, 1.0, 0.9, 0.9], rtol=1e-6)
    assert list(seq.top_k) == [0, 0, 5, 5]
    assert seq.advantage == 0.5 and seq.token_weight == 0.25


def test_group_sequences_skips_truncated_traces_when_asked() -> None:
    group = Group(
        "c",
        [
            trajectory("s0", 1.0, (0, 0), [trace("a", [0, 1, 1], 0.5), trace("b", [0, 1, 1], 0.5, truncated=True)]),
            trajectory("s1", 0.0, (0, 0), [trace("a", [0, 1, 1, 1, 1], 1.0)]),
        ],
    )
    advantages = [np.array([1.0, -1.0])]
    kept, skipped = group_sequences([group], advantages, TrainerConfig(train_truncated=True))
    assert (len(kept), skipped) == (3, 0)
    # Token-level aggregation: all 8 trainable tokens weigh the same, and together 1.
    weights = {s.name: s.token_weight for s in kept}
    assert weights == pytest.approx({"s0/a": 1 / 8, "s0/b": 1 / 8, "s1/a": 1 / 8})
    kept, skipped = group_sequences([group], advantages, TrainerConfig(train_truncated=False))
    assert ([s.name for s in kept], skipped) == (["s0/a", "s1/a"], 1)
    assert {s.name: s.advantage for s in kept} == {"s0/a": 1.0, "s1/a": -1.0}


@given(n=st.integers(1, 30), data=st.data())
def test_pass_at_k_matches_the_definition(n: int, data) -> None:
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(n, n, k) == 1.0 and pass_at_k(n, 0, k) == 0.0
    if k == n:
        assert pass_at_k(n, c, k) == (1.0 if c else 0.0)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def metrics_row(step: int) -> dict:
    return {key: float(step) for key in STEP_KEYS} | {"step": step}


def test_metrics_log_keeps_each_step_once_across_a_resume(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        log.append(metrics_row(step))
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward_mean"')  # a line torn by a kill
    # The run is resumed from the checkpoint of step 2: steps 3 and later will be trained again.
    log = MetricsLog(tmp_path, resume_step=2)
    log.append(metrics_row(3))
    log.close()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert any((tmp_path / "tensorboard").iterdir())
    with pytest.raises(ValueError, match="lack"):
        MetricsLog(tmp_path, resume_step=3).append({"step": 4})


class FakeBackend:
    """Writes marker files where a backend writes its model and optimizer."""

    name = "fake"
    model_description = {"model_type": "llama", "vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 1}

    def save(self, model_folder: Path, optimizer_file: Path) -> None:
        model_folder.mkdir()
        (model_folder / "config.json").write_text("{}")
        optimizer_file.write_bytes(b"state")


def test_checkpoints_are_complete_latest_and_pruned(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        state = TrainerState(
            step=step, cursor=f"c{step}", policy_version=step, base_model="tiny", model=FakeBackend.model_description
        )
        save_checkpoint(tmp_path / "checkpoints", FakeBackend(), state, "tiny", keep=2)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.state.step == 3 and latest.state.cursor == "c3"
    assert latest.model_folder.name == "tiny" and latest.optimizer_file.read_bytes() == b"state"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000002", "step-000003"]
    check_compatible(latest, "tiny", FakeBackend.model_description)
    with pytest.raises(CheckpointError, match="continues model 'tiny'"):
        check_compatible(latest, "smollm2-135m", FakeBackend.model_description)
    with pytest.raises(CheckpointError, match="vocab_size 10, the model has 11"):
        check_compatible(latest, "tiny", {**FakeBackend.model_description, "vocab_size": 11})
    (latest.path / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        latest_checkpoint(tmp_path)
    json.loads((tmp_path / "checkpoints" / "step-000002" / "state.json").read_text())


def test_a_group_whose_traces_are_not_what_the_engine_sampled_stops_the_run() -> None:
    from polar.testing.trajectories import SessionShape, tool_session
    from polar.trajectory import build, session_trajectory
    from trainer.loop import TrainingError, check_faithful

    shape = SessionShape(system_tokens=20, task_tokens=(5, 10), tool_tokens=(5, 10), sample_tokens=(3, 8))
    calls = tool_session(turns=3, seed=1, shape=shape)
    trajectory = session_trajectory(calls, build("prefix_merging", calls), session_id="task.0")
    trajectory.task_id = "task"
    check_faithful(Group("c1", [trajectory]))  # as built: faithful
    trace = trajectory.traces[0]
    sampled = next(i for i, m in enumerate(trace.loss_mask) if m)
    trace.token_ids[sampled] += 1  # a trainable token the engine never sampled
    with pytest.raises(TrainingError, match=r"session task\.0 of task task: its traces are not token-faithful"):
        check_faithful(Group("c1", [trajectory]))


@given(
    tokens=st.integers(1, 1 << 17),
    more=st.integers(1, 1 << 17),
    memory=st.integers(1 << 20, 1 << 40),
    layers=st.integers(1, 80),
    hidden=st.integers(16, 8192),
)
def test_auto_recomputes_from_some_micro_batch_size_on_and_never_below_it(tokens, more, memory, layers, hidden) -> None:
    def wanted(setting: str, count: int) -> bool:
        size = activation_bytes(tokens=count, layers=layers, hidden=hidden, intermediate=4 * hidden, element_bytes=4)
        return recompute_activations(setting, activations=size, device_memory=memory)

    # More tokens never turn recomputation off; "on" and "off" are obeyed whatever the size.
    assert wanted("auto", tokens + more) or not wanted("auto", tokens)
    assert wanted("on", tokens) and not wanted("off", tokens)


def test_auto_recomputes_smollm2_on_a_24_gb_cpu_at_its_context_but_not_the_tiny_model() -> None:
    # SmolLM2-135M's shape at its 8192-token context, fp32: the micro-batch a CPU trainer was killed
    # for memory on; the tiny test model at its 32768 tokens fits.
    smollm2 = activation_bytes(tokens=8192, layers=30, hidden=576, intermediate=1536, element_bytes=4)
    tiny = activation_bytes(tokens=32768, layers=2, hidden=64, intermediate=192, element_bytes=4)
    assert recompute_activations("auto", activations=smollm2, device_memory=24 << 30)
    assert not recompute_activations("auto", activations=tiny, device_memory=24 << 30)
    with pytest.raises(BackendError, match="auto, on or off"):
        recompute_activations("yes", activations=tiny, device_memory=24 << 30)
