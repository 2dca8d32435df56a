"""Training on constrained calls: the trainer replays each call's grammar over its sampled ids and
scores the tokens under the same masks, so its logprobs equal the engine's recorded ones (fp32, CPU)
and the importance ratio of an unchanged policy is 1; scored without the masks they differ. `polar
verify --model` re-checks that each constrained call's mask admitted every sampled token."""

from __future__ import annotations

import numpy as np
import pytest

from polar.app.cli import main
from polar.inference.constraints import ConstraintViolation, TokenGrammar
from polar.trajectory import build
from polar.trajectory.records import CallView, SamplingParams
from polar.trajectory.session_file import session_trajectory, write_session
from polar.v1 import common_pb2
from tests.helpers.constrained_samples import (
    ANSWER,
    ATOL,
    PROMPT,
    TOOL_CALL,
    constrained_trajectory,
    sample_constrained,
)
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import pack
from trainer.loop import TrainingError, trace_sequence

pytestmark = pytest.mark.slow

SAMPLINGS = [
    (TOOL_CALL, dict(temperature=1.0, top_p=1.0, top_k=0)),
    (ANSWER, dict(temperature=0.7, top_p=0.9, top_k=50)),
]


@pytest.fixture(scope="module")
def samples():
    """Per sampling: (constraint, sampling, sampled ids, recorded logprobs), from the torch engine."""
    return sample_constrained(SAMPLINGS)


@pytest.fixture(scope="module")
def grammar():
    backend_vocab = 49152
    return TokenGrammar.for_model("tiny", backend_vocab)


@pytest.fixture(scope="module")
def backend():
    return TorchBackend(TorchBackendOptions(model="tiny", device="cpu"))


def scored(backend, sequences):
    """The trainer's logprobs of each sequence's sampled tokens, in the sequences' order."""
    batches = [batch for sequence in sequences for batch in pack([sequence], max_tokens=1024)]
    values = backend.logprobs(batches)
    return np.concatenate([v[b.loss_mask].numpy() for v, b in zip(values, batches)])


def test_the_trainer_scores_constrained_tokens_as_the_engine_drew_them(samples, grammar, backend):
    sequences, recorded = [], []
    for constraint, sampling, tokens, logprobs in samples:
        traj, trace = constrained_trajectory(constraint, sampling, tokens, logprobs)
        sequences.append(trace_sequence(traj, trace, advantage=1.0, weight=1.0 / len(tokens), grammar=lambda: grammar))
        recorded += logprobs
    trainer = scored(backend, sequences)
    recorded = np.asarray(recorded, dtype=np.float32)
    np.testing.assert_allclose(trainer, recorded, atol=ATOL, rtol=0)
    # An unchanged policy: every importance ratio is 1.
    np.testing.assert_allclose(np.exp(trainer - recorded), 1.0, atol=ATOL, rtol=0)
    # Many tokens were the only ones the grammar allowed: recorded with logprob 0 exactly.
    assert (recorded == 0).sum() >= 10


def test_without_the_masks_the_logprobs_differ(samples, backend):
    sequences, recorded = [], []
    for constraint, sampling, tokens, logprobs in samples:
        traj, trace = constrained_trajectory(constraint, sampling, tokens, logprobs, recorded_constraint=False)
        sequences.append(trace_sequence(traj, trace, advantage=1.0, weight=1.0 / len(tokens)))
        recorded += logprobs
    unmasked = scored(backend, sequences)
    gap = np.abs(unmasked - np.asarray(recorded, dtype=np.float32))
    assert gap.max() > 1.0  # forced tokens (recorded 0) are far from certain for the random model


def test_a_token_the_mask_refused_stops_training_with_the_trace_named(samples, grammar):
    constraint, sampling, tokens, logprobs = samples[0]
    forged = tokens[:3] + [tokens[3] + 1] + tokens[4:]
    traj, trace = constrained_trajectory(constraint, sampling, forged, logprobs)
    with pytest.raises(TrainingError, match="s/t0.*not admitted"):
        trace_sequence(traj, trace, advantage=1.0, weight=1.0, grammar=lambda: grammar)
    with pytest.raises(ConstraintViolation):
        grammar.replay(constraint, forged)


def test_polar_verify_rechecks_the_mask_of_constrained_calls(samples, tmp_path, capsys):
    constraint, sampling, tokens, logprobs = samples[0]
    records = common_pb2.SamplingParams(max_tokens=40, **sampling)
    records.constraint.CopyFrom(constraint.to_proto(common_pb2.OutputConstraint))

    def session(sampled: list[int], name: str) -> str:
        call = CallView(
            "c1",
            np.array(PROMPT),
            np.array(sampled),
            np.array(logprobs, dtype=np.float32),
            sampling=SamplingParams.from_proto(records),
        )
        path = tmp_path / name
        write_session(path, session_trajectory([call], build("prefix_merging", [call]), session_id="s1"))
        return str(path)

    faithful = session(tokens, "faithful.json")
    forged = session(tokens[:3] + [tokens[3] + 1] + tokens[4:], "forged.json")
    assert main(["verify", "--model", "tiny", faithful]) == 0
    assert main(["verify", "--model", "tiny", forged]) == 1
    assert "position 3, call c1: sampled token 3" in capsys.readouterr().out
    assert main(["verify", faithful]) == 1  # a constrained call is not taken on trust
    assert "give --model" in capsys.readouterr().out
