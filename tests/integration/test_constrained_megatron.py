"""The megatron backend trains on constrained calls as the torch backend does: it masks the logits
of each constrained token with the grammar's replayed mask (each tensor-parallel rank its own slice
of the vocabulary) before the softmax over the whole vocabulary, so its logprobs equal the engine's
recorded ones and the torch backend's (fp32, CPU, gloo; TP=1 in this process, TP=2 spawned), its
update equals the torch backend's, and without the masks the logprobs differ."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'polar[megatron]')")

from polar.inference.constraints import TokenGrammar
from tests.helpers import constrained_samples
from tests.helpers.constrained_samples import ANSWER, ATOL, TOOL_CALL, constrained_trajectory, sample_constrained
from tests.helpers.trainer_backends import LOSS, LR, assert_matches, score_tensor_parallel
from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions
from trainer.backends.torch_backend import TorchBackend, TorchBackendOptions
from trainer.batches import pack
from trainer.loop import trace_sequence

pytestmark = pytest.mark.slow

# Temperature only: the megatron backend refuses top-k / top-p truncation over a split vocabulary.
SAMPLINGS = [
    (TOOL_CALL, dict(temperature=1.0, top_p=1.0, top_k=0)),
    (ANSWER, dict(temperature=0.7, top_p=1.0, top_k=0)),
]
# The constrained samples' prompt, with the tiny model's pad token (2, its <|im_end|>) in it: both backends train
# its embedding like any other token's.
PROMPT = constrained_samples.PROMPT
assert 2 in PROMPT


@pytest.fixture(scope="module")
def calls():
    """(micro-batches with the constraints' masks, the same without them): both calls packed into one
    row, as the loop packs them; their behaviour logprobs are the engine's recorded ones."""
    grammar = TokenGrammar.for_model("tiny", 49152)
    masked, unmasked = [], []
    for constraint, sampling, tokens, logprobs in sample_constrained(SAMPLINGS, PROMPT):
        weight = 1.0 / (len(SAMPLINGS) * len(tokens))
        for recorded_constraint, into in ((True, masked), (False, unmasked)):
            trajectory, trace = constrained_trajectory(
                constraint, sampling, tokens, logprobs, recorded_constraint=recorded_constraint, prompt=PROMPT
            )
            into.append(trace_sequence(trajectory, trace, advantage=1.0, weight=weight, grammar=lambda: grammar))
    masked_batches, unmasked_batches = pack(masked, max_tokens=1024), pack(unmasked, max_tokens=1024)
    assert len(masked_batches) == 1 and len(masked_batches[0].sequence_lengths[0]) == 2  # one row, two calls
    assert unmasked_batches[0].constraint_index is None
    return masked_batches, unmasked_batches


@pytest.fixture(scope="module")
def torch_reference(calls):
    """The torch backend's logprobs of the constrained calls, its update on them and the weights after."""
    masked, _ = calls
    backend = TorchBackend(TorchBackendOptions(model="tiny", device="cpu", dtype="float32", lr=LR))
    logprobs = backend.logprobs(masked)
    result = backend.update(masked, LOSS)
    return logprobs, result, {name: t.clone() for name, t in backend.hf_weights()}


def sampled(logprobs, batches) -> np.ndarray:
    """Per-target logprobs [R, L] of each micro-batch at its trainable targets, in order."""
    return np.concatenate([values[batch.loss_mask].numpy() for values, batch in zip(logprobs, batches)])


def check(masked_logprobs, unmasked_logprobs, calls, torch_reference) -> None:
    masked, unmasked = calls
    recorded = sampled([batch.behaviour_logprobs for batch in masked], masked)
    ours = sampled(masked_logprobs, masked)
    np.testing.assert_allclose(ours, recorded, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ours, sampled(torch_reference[0], masked), atol=ATOL, rtol=0)
    assert (recorded == 0).sum() >= 10  # tokens the grammar forced, certain under the mask
    # Without the masks: forced tokens are far from certain for the random model.
    assert np.abs(sampled(unmasked_logprobs, unmasked) - recorded).max() > 1.0


def test_tp1_scores_and_learns_from_constrained_calls_as_the_engine_drew_them(calls, torch_reference):
    masked, unmasked = calls
    backend = MegatronBackend(MegatronBackendOptions(model="tiny", dtype="float32", lr=LR))
    logprobs = backend.logprobs(masked)
    check(logprobs, backend.logprobs(unmasked), calls, torch_reference)
    result = backend.update(masked, LOSS)
    assert_matches(torch_reference, logprobs, result, {name: t.clone() for name, t in backend.hf_weights()})


def test_tp2_on_gloo_masks_each_vocabulary_slice(calls, torch_reference, tmp_path):
    masked, unmasked = calls
    ours = score_tensor_parallel(2, "tiny", tmp_path, [masked, unmasked], masked)
    check(ours["logprobs"][0], ours["logprobs"][1], calls, torch_reference)
    assert_matches(torch_reference, ours["logprobs"][0], ours["result"], ours["weights"])
