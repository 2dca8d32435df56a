"""Random forests of traces for the shared-prefix tests (trainer/prefix_tree.py), and what a backend
computes of them: per-token logprobs keyed by trace and position, the loss, every parameter's
gradient. Shared by the unit tests, the backends' integration tests and the GPU tier."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st

from tests.helpers.ranks import spawn_ranks
from tests.helpers.trainer_backends import free_port
from trainer.batches import MicroBatch, pack
from trainer.grpo import LossConfig, policy_loss
from trainer.sequences import TrainSequence

LOSS = LossConfig(clip_low=0.2, clip_high=0.28, importance_cap=2.0)


def forest(
    seed: int,
    vocab: int,
    system: int,
    groups: Sequence[tuple[int, int]],
    tail: tuple[int, int] = (2, 12),
    truncation: bool = True,
) -> list[TrainSequence]:
    """Traces that share a system prompt of ``system`` tokens (0: none), then per group (instruction
    length, members) an instruction shared by the group's members, then each member's own tokens
    (``tail`` lengths). The first trainable token lies anywhere after the first token: inside the
    shared part too, which then cannot be shared past it. Some members repeat another's first reply
    token for token. Advantages differ per trace (they key the logprobs)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, system)
    sequences = []
    for group, (instruction, members) in enumerate(groups):
        shared = np.concatenate([prompt, rng.integers(0, vocab, instruction)])
        first_reply = rng.integers(0, vocab, tail[1])
        for member in range(members):
            own = rng.integers(0, vocab, int(rng.integers(tail[0], tail[1] + 1)))
            if member % 3 == 2:  # the same first reply as another member: shared tokens that are trained
                own[: len(own) // 2] = first_reply[: len(own) // 2]
            ids = np.concatenate([shared, own]).astype(np.int64)
            length = len(ids)
            mask = rng.random(length) < 0.6
            mask[0] = False
            first = int(rng.integers(1, length))
            mask[1:first] = False
            mask[first] = True
            sampled = np.where(mask, rng.choice([1.0, 0.7, 0.0], length), 1.0).astype(np.float32)
            sequences.append(
                TrainSequence(
                    name=f"g{group}/m{member}",
                    token_ids=ids,
                    loss_mask=mask,
                    behaviour_logprobs=np.where(mask, -rng.uniform(0.5, 4.0, length), 0).astype(np.float32),
                    advantage=float(rng.normal()) + 1e-3 * len(sequences),
                    token_weight=float(rng.uniform(0.5, 1.5)) / (8 * length),
                    temperature=sampled,
                    # truncation mild enough that most sampled tokens stay inside it under a random model
                    top_p=np.where(mask & truncation, rng.choice([1.0, 0.98], length), 1.0).astype(np.float32),
                    top_k=np.where(mask & truncation, rng.choice([0, vocab - 40], length), 0).astype(np.int32),
                )
            )
    order = rng.permutation(len(sequences))
    return [sequences[i] for i in order]


def forests(vocab: int, max_system: int = 24, truncation: bool = True):
    """Hypothesis strategy: forests with shared prefixes of random lengths, nested or none."""
    groups = st.lists(st.tuples(st.integers(0, 10), st.integers(1, 4)), min_size=1, max_size=3)
    return st.builds(
        forest,
        st.integers(0, 2**32 - 1),
        st.just(vocab),
        st.integers(0, max_system),
        groups,
        truncation=st.just(truncation),
    )


def alone(sequences: Sequence[TrainSequence]) -> list[MicroBatch]:
    """Each trace in a micro-batch of its own: the traces run one by one."""
    return [batch for sequence in sequences for batch in pack([sequence], len(sequence))]


def keyed_logprobs(batches: Sequence[MicroBatch], logprobs: Sequence[torch.Tensor]) -> dict[tuple[float, int], float]:
    """Each trainable target's logprob by (its trace's advantage, the position predicting it)."""
    out = {}
    for batch, values in zip(batches, logprobs, strict=True):
        for row, index in batch.loss_mask.nonzero().tolist():
            key = (float(batch.advantages[row, index]), int(batch.position_ids[row, index]))
            assert key not in out, f"two targets at {key}"
            out[key] = float(values[row, index])
    return out


def loss_and_gradients(backend, batches: Sequence[MicroBatch]) -> tuple[float, dict[str, torch.Tensor]]:
    """The GRPO loss of one update over the micro-batches and the gradient it leaves on every
    parameter (the backend's weights untouched)."""
    backend._zero_grad()
    total = 0.0
    for batch in batches:
        values, flat = backend._target_logprobs(backend.model, batch)

        def at(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(values.device).reshape(-1)[flat].float()

        loss, _ = policy_loss(
            values, values.detach(), at(batch.behaviour_logprobs), at(batch.advantages), at(batch.token_weights), LOSS
        )
        loss.backward()
        total += float(loss.detach())
    gradients = {
        name: parameter.grad.detach().cpu().clone()
        for name, parameter in backend.model.named_parameters()
        if parameter.grad is not None
    }
    backend._zero_grad()
    return total, gradients


def assert_same_computation(
    backend,
    sequences: Sequence[TrainSequence],
    max_tokens: int,
    min_saving: int,
    atol: float = 1e-5,
    grad_rtol: float = 1e-4,
    grad_atol: float = 1e-6,
) -> list[MicroBatch]:
    """Logprobs, loss and every parameter's gradient of the traces packed with shared prefixes equal
    those of the traces run one by one; the shared micro-batches."""
    shared = pack(sequences, max_tokens, share_prefixes=True, min_saving=min_saving)
    separate = alone(sequences)
    # _score: what `logprobs` computes, called on every rank of a job alike (no leader announcing it).
    ours = keyed_logprobs(shared, backend._score(backend.model, shared))
    theirs = keyed_logprobs(separate, backend._score(backend.model, separate))
    assert ours.keys() == theirs.keys()
    assert sum(np.isfinite(value) for value in theirs.values()) >= len(theirs) // 2  # mostly inside the support
    for key, value in theirs.items():
        assert ours[key] == value or abs(ours[key] - value) <= atol, (key, ours[key], value)
    loss, gradients = loss_and_gradients(backend, shared)
    reference_loss, reference_gradients = loss_and_gradients(backend, separate)
    assert abs(loss - reference_loss) <= atol * max(1.0, abs(reference_loss))
    assert gradients.keys() == reference_gradients.keys()
    for name, gradient in reference_gradients.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=grad_rtol, atol=grad_atol, msg=name)
    return shared


def _tree_rank(rank: int, world: int, port: int, folder: str, out: str, seed: int) -> None:
    """One rank of a tensor-parallel job: every rank runs the same forwards and backwards (their
    collectives pair up) and checks its own shard's gradients."""
    from trainer.backends.megatron import MegatronBackend, MegatronBackendOptions, leave_job

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    backend = MegatronBackend(MegatronBackendOptions(model=folder, tp_size=world, dtype="float32"))
    sequences = forest(seed, 300, 30, [(6, 3), (0, 2), (4, 2)], truncation=False)
    batches = assert_same_computation(backend, sequences, max_tokens=150, min_saving=1)
    leave_job()
    Path(out, f"rank{rank}.done").write_text(str(sum(batch.shared_tokens for batch in batches)))


def run_tree_job(world: int, folder: Path, out: Path, seed: int = 0) -> list[int]:
    """A `world`-rank tensor-parallel job over a forest of traces (an assertion on any rank fails
    the spawn); the tokens each rank's trees shared."""
    spawn_ranks(_tree_rank, (world, free_port(), str(folder), str(out), seed), world)
    return [int(Path(out, f"rank{rank}.done").read_text()) for rank in range(world)]
