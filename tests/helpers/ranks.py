"""Start the ranks of a multi-process test job, as torch.multiprocessing.spawn does, but on a CPU
forked from a server that has imported torch, transformers and Megatron-Core once.

A freshly spawned rank spends most of its CPU time importing them again (about 8 s of a tiny job's
10 on a CPU), and the default test run starts about twenty. The fork server imports nothing else and
starts no thread or device, so each rank still begins with no process group, no model-parallel
state and no CUDA context.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing

PRELOADED = [
    "tests.helpers.trainer_backends",
    "tests.helpers.trace_forests",
    "trainer.backends.megatron.backend",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
]


def spawn_ranks(rank_main: Callable, args: tuple, world: int) -> None:
    """Run `rank_main(rank, *args)` in `world` new processes and wait for all of them; an exception in
    any rank fails the call, as torch.multiprocessing.spawn does."""
    if torch.cuda.is_available():
        # A module that asks the CUDA driver for its devices at import would leave the fork server's
        # children unable to use CUDA: on a GPU machine each rank starts fresh.
        torch.multiprocessing.start_processes(rank_main, args=args, nprocs=world, start_method="spawn")
        return
    # Takes effect when the fork server starts, at this process's first job; ignored afterwards.
    multiprocessing.set_forkserver_preload(PRELOADED)
    torch.multiprocessing.start_processes(rank_main, args=args, nprocs=world, start_method="forkserver")
