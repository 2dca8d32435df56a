"""Process groups and devices for the Megatron backend: one rank per GPU under torchrun, or one CPU
process (or several, spawned by tests) on gloo.

Megatron-Core asks `torch.cuda.current_device()` for the device of the tensors it allocates. On a
machine without CUDA that call raises, so `prepare_cpu` points it at the CPU before megatron.core is
imported: with `use_cpu_initialization` and the layers Polar's spec uses, nothing else in the model
needs CUDA (the fused kernels, TransformerEngine and Megatron's own dropout RNG tracker stay unused).
Megatron's DistributedOptimizer does: it sorts parameters by their CUDA type name
("torch.cuda.BFloat16Tensor") and allocates a few scalars on device "cuda" by name. On a CPU its calls
run under `cuda_names_on_cpu`, which answers those questions for CPU tensors.

The ranks form a grid of tensor-parallel groups (consecutive ranks) and data-parallel replicas:
world = tp_size * dp_size, Megatron's layout.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class MegatronUnavailable(ImportError):
    """megatron-core is not installed (pip install 'polar[megatron]')."""


@dataclass(frozen=True)
class Parallel:
    """Where this process sits: its rank, its tensor-parallel group and data-parallel replica, and
    its device."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    dp_size: int  # replicas of the model, each learning from its share of the micro-batches
    dp_rank: int
    device: torch.device

    @property
    def is_leader(self) -> bool:
        """Rank 0 talks to the rest of Polar; the other ranks follow it."""
        return self.rank == 0


def prepare_cpu() -> None:
    """Let Megatron run on a machine without CUDA (see the module docstring); idempotent."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")


class _CudaNamesOnCpu(TorchFunctionMode):
    """`Tensor.type()` answers with the CUDA type name, and factories asked for device "cuda" get the
    CPU: what Megatron's optimizer code needs to run unchanged on CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return torch.Tensor.type(args[0]).replace("torch.", "torch.cuda.", 1)
        if str(kwargs.get("device")) == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_names_on_cpu() -> Iterator[None]:
    """Around calls into Megatron's optimizer: nothing on a GPU; on a CPU, see `_CudaNamesOnCpu`."""
    if torch.cuda.is_available():
        yield
        return
    with _CudaNamesOnCpu():
        yield


def import_megatron():
    """megatron.core, ready for this machine; MegatronUnavailable when it is not installed."""
    prepare_cpu()
    try:
        import megatron.core  # noqa: F401
        from megatron.core import parallel_state
    except ImportError as exc:
        raise MegatronUnavailable(
            f"the megatron backend needs megatron-core (pip install 'polar[megatron]'): {exc}"
        ) from None
    return parallel_state


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_parallel(tp_size: int = 0) -> Parallel:
    """Join (or start) the process group and build Megatron's tensor- and data-parallel groups.

    Under torchrun the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) says who is who; without it
    this is a single process. `tp_size` 0 means every rank (no data parallelism); otherwise it must
    divide the number of ranks, and the quotient is the number of data-parallel replicas.
    """
    parallel_state = import_megatron()
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" in os.environ:
            init = "env://"
        else:
            init = f"tcp://127.0.0.1:{_free_port()}"
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    world = dist.get_world_size()
    tp_size = tp_size or world
    if tp_size < 0 or world % tp_size:
        raise ValueError(
            f"the tensor-parallel size ({tp_size}) must divide the number of ranks ({world}): each "
            "data-parallel replica is one whole tensor-parallel group"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    elif parallel_state.get_tensor_model_parallel_world_size() != tp_size:
        raise ValueError("Megatron's model-parallel groups already exist with another tensor-parallel size")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Parallel(
        rank=dist.get_rank(),
        world_size=world,
        tp_size=tp_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
    )


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()
