"""Weights broadcast over a collective group: NCCL between GPUs, gloo between CPUs, any machines.

The group is built from torch.distributed's parts, without its global default group (the trainer
and a server are unrelated processes, and the trainer may run a torch.distributed world of its
own): the trainer opens a TCPStore (`open_store`) and tells every server of the update, on its
UpdateWeightsCollective stream, the store's address, the group's id (a key prefix in the store,
fresh for each group), the group's size, the server's rank, and how many updates the group carried
before (`group_sync`); for a new group every member builds the backend's process group directly
over that prefix (`Group`). A group is kept for the next update while its members stay the same:
building one costs a rendezvous and, for NCCL, its communicators' set-up, a large part of a small
update. A server holds the group it joined (`Membership`) until a header names another, or an
update over it fails; the trainer builds a new one when a server joins or leaves, or an update
failed. Before each update every server marks itself ready in the store (`mark_ready`), so the
trainer broadcasts only once each accepted its header over the group it holds.

Each bucket of tensors travels by one broadcast from the trainer's buffer (rank 0) into the
servers' buffer of the same index; a server then copies the bucket's pieces into its staged
tensors (`unpack_bucket`, as the CUDA IPC transport does).

Nothing may hang: joining (the store's and the backend's rendezvous) and every broadcast are bounded
by the update's timeout, after which the member gives up (CollectiveFailed). A member that fails or
gives up closes its group (`Group.close`, on the thread that runs its broadcasts: gloo allows no
other), so the peers still waiting on it fail at once instead of waiting out their own timeouts.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from polar.inference.engines.base import WeightUpdateError
from polar.inference.weights import WeightsReceiver, unpack_bucket
from polar.v1 import inference_pb2

NCCL = "nccl"
GLOO = "gloo"
BACKENDS = (NCCL, GLOO)
# Every member's keys live under this prefix of the trainer's store, then the group's id.
_STORE_PREFIX = "polar-weights"
_READY = "ready"  # set by a server once it accepted a header: "ready/<group_sync>/<rank>"


class CollectiveFailed(RuntimeError):
    """Joining the group or a broadcast failed or took longer than its timeout (ABORTED): another
    member failed."""


def transports(device: str) -> list[str]:
    """The collective transports a server whose engine runs on `device` offers."""
    if not dist.is_available():
        return []
    if device.startswith("cuda"):
        return [NCCL] if dist.is_nccl_available() else []
    return [GLOO] if dist.is_gloo_available() else []


def buffer_device(backend: str, device: str) -> torch.device:
    """Where a member's buffers live: the GPU for NCCL, host memory for gloo."""
    return torch.device(device if backend == NCCL else "cpu")


# ----------------------------------------------------------------------------- addresses


def split_host_port(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): the one a peer there can
    reach this process at."""
    family = socket.AF_INET6 if _is_v6(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def open_store(timeout_s: float) -> dist.TCPStore:
    """The trainer's rendezvous: a TCPStore on a free port of every interface (its `.port`)."""
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=_seconds(timeout_s))


def group_store(store: dist.Store, group_id: str) -> dist.Store:
    return dist.PrefixStore(f"{_STORE_PREFIX}/{group_id}/", store)


def mark_ready(store: dist.Store, rank: int, group_sync: int) -> None:
    """A server tells the trainer it accepted the header of the group's update number `group_sync`:
    it is entering the rendezvous (a new group) or waiting for the first broadcast (a kept one)."""
    store.set(f"{_READY}/{group_sync}/{rank}", b"1")


def ready(store: dist.Store, ranks: range, group_sync: int) -> bool:
    """Whether every rank of `ranks` has marked itself ready for update `group_sync` (never blocks)."""
    return store.check([f"{_READY}/{group_sync}/{rank}" for rank in ranks])


def _seconds(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


# ----------------------------------------------------------------------------- the group


# The NCCL process group reads its failure handling from the environment when it is built. Its
# defaults end the whole process when a peer fails; these make a failed or late broadcast an error
# of the waiting call instead (blocking wait), after which the group's communicators are aborted.
_NCCL_ENVIRONMENT = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_environment_lock = threading.Lock()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    with _environment_lock:
        previous = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


class Group:
    """One update's process group, this process being `rank` of `world_size`; rank 0 (the trainer)
    broadcasts. Built over `store` (the group's prefix of the trainer's store): for gloo this waits
    until every member is there, for NCCL the communicators connect at the first broadcast."""

    def __init__(
        self,
        backend: str,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        host: str,
        timeout_s: float,
    ) -> None:
        self.backend = backend
        self.rank = rank
        self.device = device
        self.timeout = _seconds(timeout_s)
        try:
            if backend == GLOO:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = self.timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                self._group = dist.ProcessGroupGloo(store, rank, world_size, options)
            elif backend == NCCL:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                with _environment(_NCCL_ENVIRONMENT):
                    self._group = dist.ProcessGroupNCCL(store, rank, world_size, options)
            else:
                raise ValueError(f"collective backend {backend!r} is not one of {', '.join(BACKENDS)}")
        except RuntimeError as exc:
            raise CollectiveFailed(
                f"could not join the {backend} group as rank {rank} of {world_size}: {exc}"
            ) from None

    def broadcast(self, buffer: torch.Tensor) -> dist.Work:
        """Start the broadcast of the trainer's `buffer` into every member's (its own included)."""
        group = self._group
        if group is None:
            raise CollectiveFailed(f"the {self.backend} group was closed: a member failed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        try:
            return group.broadcast([buffer], options)
        except RuntimeError as exc:
            raise CollectiveFailed(f"the {self.backend} broadcast failed: {exc}") from None

    def wait(self, work: dist.Work) -> None:
        """Block until a broadcast is done here, at most the group's timeout."""
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise CollectiveFailed(
                f"the {self.backend} broadcast failed or took over {self.timeout.total_seconds():g} s: {exc}"
            ) from None

    def close(self) -> None:
        """End the group here, from the thread that runs its broadcasts, none of them running: the
        peers' broadcasts with this member fail at once (its connections close)."""
        group, self._group = self._group, None
        if group is None:
            return
        # gloo's abort leaves its connections open; shutdown (or, in a torch without it, the
        # group's destruction as the last reference goes) closes them.
        end = getattr(group, "shutdown", None) if self.backend == GLOO else group.abort
        if end is not None:
            with contextlib.suppress(RuntimeError):
                end()

    def interrupt(self) -> None:
        """From another thread, while a broadcast of this member's waits: NCCL aborts its
        communicators, so that wait fails now. A gloo wait cannot be cut short from outside (a
        shutdown then races the running operation); it ends when a peer closes or at the timeout."""
        group = self._group
        if group is not None and self.backend == NCCL:
            with contextlib.suppress(RuntimeError):
                group.abort()


# ----------------------------------------------------------------------------- the server's side


def check_header(header: inference_pb2.CollectiveWeightsHeader, offered: list[str]) -> None:
    """A header's fields, before the server joins anything (WeightUpdateError names the field)."""
    if header.backend not in BACKENDS:
        raise WeightUpdateError(f"header.backend = {header.backend!r} is not one of {', '.join(BACKENDS)}")
    if header.backend not in offered:
        raise TransportUnavailable(
            f"this server does not offer the {header.backend} transport (it offers {', '.join(offered) or 'none'})"
        )
    try:
        split_host_port(header.rendezvous)
    except ValueError:
        raise WeightUpdateError(f"header.rendezvous = {header.rendezvous!r} is not host:port") from None
    if not header.group_id:
        raise WeightUpdateError("header.group_id must not be empty")
    if header.world_size < 2 or not 1 <= header.rank < header.world_size:
        raise WeightUpdateError(f"header.rank = {header.rank} must be in [1, world_size = {header.world_size})")
    if header.bucket_bytes <= 0 or header.buffer_count < 1:
        raise WeightUpdateError(
            f"header.bucket_bytes = {header.bucket_bytes} and buffer_count = {header.buffer_count} must be > 0"
        )
    if not header.timeout_seconds > 0:
        raise WeightUpdateError(f"header.timeout_seconds = {header.timeout_seconds} must be > 0")
    if header.group_sync < 0:
        raise WeightUpdateError(f"header.group_sync = {header.group_sync} must be >= 0")


class TransportUnavailable(RuntimeError):
    """The server cannot take part with this backend (FAILED_PRECONDITION)."""


class GroupNotHeld(LookupError):
    """A header names a kept group this server does not hold (NOT_FOUND): the trainer builds a new one."""


def _identity(header: inference_pb2.CollectiveWeightsHeader) -> tuple:
    return (header.rendezvous, header.group_id, header.backend, header.rank, header.world_size)


class Membership:
    """A server's place in the trainer's group, kept between updates: the group, its store, and the
    one thread that runs it from joining to closing (gloo allows no other)."""

    def __init__(self, header: inference_pb2.CollectiveWeightsHeader) -> None:
        self.identity = _identity(header)
        self.syncs = 0  # updates received over the group
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polar-weight-group")
        self.group: Group | None = None
        self._store: dist.Store | None = None

    def holds(self, header: inference_pb2.CollectiveWeightsHeader) -> bool:
        """Whether `header` continues this group: the same group, and its next update."""
        return self.group is not None and _identity(header) == self.identity and header.group_sync == self.syncs

    def join(self, header: inference_pb2.CollectiveWeightsHeader, device: torch.device) -> None:
        """Join the new group `header` names (on the group's thread; blocking, at most
        header.timeout_seconds)."""
        host, port = split_host_port(header.rendezvous)
        timeout = _seconds(header.timeout_seconds)
        try:
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
        except RuntimeError as exc:
            raise CollectiveFailed(f"could not reach the trainer's rendezvous {header.rendezvous}: {exc}") from None
        self._store = group_store(store, header.group_id)
        mark_ready(self._store, header.rank, 0)
        self.group = Group(
            header.backend,
            self._store,
            header.rank,
            header.world_size,
            device,
            address_toward(host),
            header.timeout_seconds,
        )

    def ready(self, header: inference_pb2.CollectiveWeightsHeader) -> None:
        """Tell the trainer this kept group is ready for the update `header` announces."""
        try:
            mark_ready(self._store, header.rank, header.group_sync)
        except RuntimeError as exc:
            raise CollectiveFailed(f"could not reach the trainer's rendezvous {header.rendezvous}: {exc}") from None

    def close(self) -> None:
        """Leave the group. The close is queued behind a broadcast still blocked on the thread (a
        cancelled call) and never awaited."""
        if self.group is not None:
            self.thread.submit(self.group.close)
        self.thread.shutdown(wait=False)


def receive_bucket(
    group: Group, bucket: inference_pb2.SharedBucket, receiver: WeightsReceiver, buffers: list[torch.Tensor]
) -> None:
    """One bucket: its broadcast into its buffer, then its pieces into the staged tensors (copies
    on the GPU are ordered before the next broadcast into that buffer by the group's stream)."""
    if not 0 <= bucket.buffer < len(buffers):
        raise WeightUpdateError(f"bucket names buffer {bucket.buffer}; the header asked for {len(buffers)}")
    buffer = buffers[bucket.buffer]
    group.wait(group.broadcast(buffer))
    unpack_bucket(bucket, receiver, buffer)
