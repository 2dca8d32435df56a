"""Shared-prefix packing through the torch backend: a tree computes what the traces compute one by one.

Random forests of traces (a system prompt of random length shared by all or absent, instructions
shared by groups, samples that repeat each other's first reply, trained tokens inside the common
prompt) on a tiny random Qwen3 (fp32): every trained token's logprob, the loss and the gradient of
every parameter equal those of the traces run separately. Then a GRPO step on the recorded Pi session
(tests/fixtures/sessions) and seven more sessions starting with its recorded prompt, on the `tiny`
model: with and without sharing, the same weights after the update.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.helpers.trace_forests import LOSS, assert_same_computation, forests
from tests.helpers.trainer_backends import LR, WEIGHT_MAX_STEPS, WEIGHT_MEAN_STEPS, save_tiny_model
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import pack
from trainer.sequences import TrainSequence

SESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3", tied=False)
    return TorchBackend(TorchBackendOptions(model=str(folder), device="cpu", dtype="float32", cpu_threads=1))


# Derandomized: under top-p and top-k a token whose probability ties the nucleus boundary to within
# fp32's rounding may fall inside it in one computation and outside in the other, which moves the
# normaliser by that token's mass (4.5e-4 nats seen once under a near-uniform random model); a fixed
# set of examples keeps CI from drawing such a tie.
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequences=forests(vocab=300, max_system=40))
def test_a_tree_computes_what_the_traces_compute_alone(tiny_qwen3, sequences):
    batches = assert_same_computation(tiny_qwen3, sequences, max_tokens=120, min_saving=1)
    assert sum(b.tokens for b in batches) <= sum(len(s) for s in sequences)


def recorded_group(name: str, sessions: int = 8, seed: int = 0) -> list[TrainSequence]:
    """The recorded session's traces (prefix-merged, and one per request: nested, each call's prompt
    holding the calls before it) and ``sessions - 1`` more sessions that begin with its recorded
    prompt (the CLI's system prompt, tools and the task), their replies drawn afresh."""
    from polar.trajectory import build, read_session

    calls, _ = read_session(SESSIONS / f"{name}.json.zst")
    traces = [*build("prefix_merging", calls).traces, *build("per_request", calls).traces]
    rng = np.random.default_rng(seed)
    first = traces[0]
    prompt = np.asarray(first.token_ids[: int(np.flatnonzero(first.loss_mask)[0])], dtype=np.int64)
    parts = [
        (np.asarray(t.token_ids, np.int64), np.asarray(t.loss_mask, bool), np.asarray(t.logprobs, np.float32))
        for t in traces
    ]
    for _ in range(sessions - 1):
        reply = rng.integers(100, 49000, int(rng.integers(20, 200)))
        mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(reply), bool)])
        parts.append((np.concatenate([prompt, reply]), mask, np.where(mask, -1.5, 0).astype(np.float32)))
    trainable = sum(int(mask.sum()) for _, mask, _ in parts)
    return [
        TrainSequence(
            name=f"{name}/{index}",
            token_ids=ids,
            loss_mask=mask,
            behaviour_logprobs=logprobs,
            advantage=float(rng.normal()),
            token_weight=1.0 / trainable,
            temperature=np.ones(len(ids), np.float32),
            top_p=np.ones(len(ids), np.float32),
            top_k=np.zeros(len(ids), np.int32),
        )
        for index, (ids, mask, logprobs) in enumerate(parts)
    ]


def test_a_step_on_recorded_cli_traces_gives_the_same_weights_with_and_without_sharing():
    sequences = recorded_group("pi")
    budget = 4 * max(len(s) for s in sequences)
    plain = pack(sequences, budget)
    shared = pack(sequences, budget, share_prefixes=True)
    assert sum(b.tokens for b in shared) < 0.4 * sum(b.tokens for b in plain)  # the 1.5k prompt, nearly once
    results, weights = [], []
    for batches in (plain, shared):
        backend = TorchBackend(TorchBackendOptions(model="tiny", device="cpu", dtype="float32", lr=LR, cpu_threads=1))
        results.append(backend.update(batches, LOSS))
        weights.append({name: t.clone() for name, t in backend.hf_weights()})
    assert results[1].loss == pytest.approx(results[0].loss, abs=1e-6)
    assert results[1].grad_norm == pytest.approx(results[0].grad_norm, rel=1e-4)
    assert results[1].trainable_tokens == results[0].trainable_tokens
    for name, tensor in weights[0].items():
        difference = (weights[1][name] - tensor).abs()
        assert float(difference.max()) <= WEIGHT_MAX_STEPS * LR, name
        assert float(difference.mean()) <= WEIGHT_MEAN_STEPS * LR, name
    moved = sum(float((weights[0][name] - t).abs().max()) > 0.5 * LR for name, t in _initial("tiny").items())
    assert moved > 0  # the step changed the weights


def _initial(model: str) -> dict[str, torch.Tensor]:
    backend = TorchBackend(TorchBackendOptions(model=model, device="cpu", dtype="float32", cpu_threads=1))
    return {name: t.clone() for name, t in backend.hf_weights()}
