"""The trainer's side of the collective transports ("nccl", "gloo"): one update broadcast to every
server of a group at once (polar/inference/collective.py).

A group is kept between updates while the same servers take part, and nothing waits forever: a failed
server closes the group and names itself. The protocol and the failure rules:
docs/design/weight-sync.md.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from polar.inference import collective
from polar.inference.collective import CollectiveFailed, Group
from polar.v1 import inference_pb2
from trainer.weight_buckets import bucket_messages, sized

DEFAULT_TIMEOUT_S = 120.0
_BUFFERS = 2
_JOIN_POLL_S = 0.005
_FAILURE_REPORT_S = 5.0  # how long a broken broadcast waits for the server's own account of why


class GroupFailed(RuntimeError):
    """The update could not reach every server of the group; the message names the one that failed
    where it is known."""


class _Call:
    """One server's UpdateWeightsCollective call: its outgoing messages and its outcome."""

    def __init__(
        self,
        address: str,
        stub,
        header: inference_pb2.CollectiveWeightsHeader,
        on_failure: Callable[[_Call], None],
        timeout_s: float,
    ) -> None:
        self.address = address
        self.result: inference_pb2.UpdateWeightsResponse | None = None
        self.error: grpc.RpcError | None = None
        self._outbox: queue.Queue = queue.Queue()
        self._call = stub.UpdateWeightsCollective(self._requests(header), timeout=timeout_s)
        self._watcher = threading.Thread(target=self._watch, args=(on_failure,), daemon=True)
        self._watcher.start()

    def _requests(self, header) -> Iterator[inference_pb2.UpdateWeightsCollectiveRequest]:
        yield inference_pb2.UpdateWeightsCollectiveRequest(header=header)
        while (bucket := self._outbox.get()) is not None:
            yield inference_pb2.UpdateWeightsCollectiveRequest(bucket=bucket)

    def _watch(self, on_failure: Callable[[_Call], None]) -> None:
        try:
            for response in self._call:
                self.result = response.result
        except grpc.RpcError as exc:
            self.error = exc
            on_failure(self)

    def send(self, bucket: inference_pb2.SharedBucket) -> None:
        self._outbox.put(bucket)

    def end(self) -> None:
        self._outbox.put(None)

    def cancel(self) -> None:
        self.end()
        self._call.cancel()

    def outcome(self, timeout_s: float) -> inference_pb2.UpdateWeightsResponse | None:
        self._watcher.join(timeout_s)
        return self.result

    def described(self, backend: str) -> str:
        """The failure, worded as the other transports word theirs."""
        error = self.error
        return (
            f"inference server {self.address} failed while receiving the weights ({backend}): "
            f"{error.code().name}: {error.details()}"
        )


def rendezvous_host(addresses: Sequence[str]) -> str:
    """The trainer's address the servers are told to reach it at: the one on the route to a server
    on another machine where there is one (reachable from every server), else loopback."""
    hosts = [collective.split_host_port(a)[0] for a in addresses]
    remote = [h for h in hosts if collective.address_toward(h) not in ("127.0.0.1", "::1")]
    return collective.address_toward(remote[0]) if remote else collective.address_toward(hosts[0])


def broadcast_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    group: Group,
    buffers: Sequence[torch.Tensor],
    announce: Callable[[inference_pb2.SharedBucket], None],
) -> None:
    """Pack `tensors` into `buffers` in turn; announce each bucket, then broadcast it. A buffer is
    filled again only once its last broadcast is done here."""
    free: queue.Queue = queue.Queue()
    for index in range(len(buffers)):
        free.put(index)
    pending: dict[int, object] = {}
    for message in bucket_messages(tensors, buffers, free):
        index = message.bucket.buffer
        announce(message.bucket)
        pending[index] = group.broadcast(buffers[index])
        oldest = (index + 1) % len(buffers)  # the buffer the next bucket goes into
        if oldest in pending:
            group.wait(pending.pop(oldest))
            free.put(oldest)
    for work in pending.values():
        group.wait(work)


@dataclass
class _KeptGroup:
    """A group the trainer built, with the servers and device it was built for."""

    backend: str
    members: tuple[str, ...]  # the servers' addresses, in rank order from 1
    device: torch.device
    host: str  # the trainer's address the servers reach its store at
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    group: Group | None = None  # None until the first update over it builds it
    syncs: int = 0  # updates it carried


class _GroupLost(Exception):
    """A server answered that it does not hold the kept group (it restarted)."""


@dataclass(frozen=True)
class Sent:
    """One update over a group: every server's answer, in order, and whether the group was built
    for it (False: a kept group carried it)."""

    results: list[inference_pb2.UpdateWeightsResponse]
    new_group: bool


class CollectiveSender:
    """Sends updates over collective groups; keeps its rendezvous store, its buffers and, per
    backend, its last group between them. `groups_built` counts the groups it built. `adapter`: the
    named LoRA adapter its updates replace ("" = the servers' own parameters). `gpu`: where NCCL's
    buffers go (the trainer's GPU); None: the current CUDA device."""

    def __init__(
        self,
        bucket_bytes: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        rpc_timeout_s: float = 600.0,
        adapter: str = "",
        gpu: torch.device | None = None,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.gpu = gpu
        self.adapter = adapter
        self.timeout_s = timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.groups_built = 0
        self._store = None
        self._buffers: list[torch.Tensor] = []
        self._kept: dict[str, _KeptGroup] = {}

    def _buffers_on(self, device: torch.device) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].device != device:
            self._buffers = []  # the old ones are let go first
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(_BUFFERS)]
        return self._buffers

    def close(self) -> None:
        """Leave every kept group (the servers leave theirs when the next header names another)."""
        for backend in list(self._kept):
            self._drop(backend)

    def _drop(self, backend: str) -> None:
        kept = self._kept.pop(backend, None)
        if kept is not None and kept.group is not None:
            kept.group.close()

    def send(
        self,
        backend: str,
        servers: Sequence[tuple[str, object]],
        weights: Iterable[tuple[str, torch.Tensor]],
        note: str,
        update_id: str,
    ) -> Sent:
        """Stage `weights` on every server of `servers` ((address, stub) pairs) over one `backend`
        group: the group kept from the last update when it was built for the same servers, else a
        new one. Raises GroupFailed."""
        if self._store is None:
            self._store = collective.open_store(self.timeout_s)
        tensors = sized(weights)
        addresses = tuple(address for address, _ in servers)
        if backend == collective.NCCL:
            device = self.gpu or torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        kept = self._kept.get(backend)
        if kept is not None and (kept.members, kept.device) == (addresses, device):
            try:
                return Sent(self._over(kept, servers, tensors, note, update_id), new_group=False)
            except _GroupLost:
                pass  # _over dropped it; nothing was broadcast, so the update goes over a new group
        self._drop(backend)  # a server joined or left: the old group goes
        kept = _KeptGroup(backend, addresses, device, rendezvous_host(addresses))
        self._kept[backend] = kept
        self.groups_built += 1
        return Sent(self._over(kept, servers, tensors, note, update_id), new_group=True)

    def _over(
        self, kept: _KeptGroup, servers: Sequence[tuple[str, object]], tensors, note: str, update_id: str
    ) -> list[inference_pb2.UpdateWeightsResponse]:
        """One update over `kept` (built here on its first); any failure drops the group."""
        backend = kept.backend
        world_size = len(servers) + 1
        host = kept.host
        rendezvous = f"[{host}]:{self._store.port}" if ":" in host else f"{host}:{self._store.port}"
        failures: list[_Call] = []
        lock = threading.Lock()

        def on_failure(call: _Call) -> None:
            with lock:
                failures.append(call)
                first = len(failures) == 1
            if first and kept.group is not None:
                kept.group.interrupt()  # a broadcast waiting on this server fails now, where the backend allows

        calls = []
        for rank, (address, stub) in enumerate(servers, start=1):
            header = inference_pb2.CollectiveWeightsHeader(
                tensor_count=len(tensors),
                note=note,
                update_id=update_id,
                adapter=self.adapter,
                backend=backend,
                rendezvous=rendezvous,
                group_id=kept.group_id,
                world_size=world_size,
                rank=rank,
                bucket_bytes=self.bucket_bytes,
                buffer_count=_BUFFERS,
                timeout_seconds=self.timeout_s,
                group_sync=kept.syncs,
            )
            calls.append(_Call(address, stub, header, on_failure, self.rpc_timeout_s))

        def announce(bucket: inference_pb2.SharedBucket) -> None:
            if failures:
                raise CollectiveFailed("a server of the group failed")
            for call in calls:
                call.send(bucket)

        sent = False
        try:
            members = collective.group_store(self._store, kept.group_id)
            self._wait_for_ready(members, world_size, kept, failures)
            if kept.group is None:
                kept.group = Group(backend, members, 0, world_size, kept.device, host, self.timeout_s)
            if failures:
                raise CollectiveFailed("a server of the group failed")
            device = kept.device
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                broadcast_buckets(tensors, kept.group, self._buffers_on(device), announce)
            for call in calls:
                call.end()
            results = [call.outcome(self.rpc_timeout_s) for call in calls]
            sent = True
        except (CollectiveFailed, GroupFailed) as exc:
            self._drop(backend)  # the servers still in a broadcast fail now, and say so
            raise self._failed(backend, calls, failures, exc) from None
        finally:
            if not sent:
                self._drop(backend)
                for call in calls:
                    call.cancel()
        if failures:
            self._drop(backend)
            raise self._failed(backend, calls, failures, None)
        missing = [call.address for call, result in zip(calls, results) if result is None]
        if missing:
            self._drop(backend)
            raise GroupFailed(
                f"inference servers {', '.join(missing)} did not answer the {backend} update within {self.rpc_timeout_s:g} s"
            )
        kept.syncs += 1
        return results

    def _wait_for_ready(self, members, world_size: int, kept: _KeptGroup, failures: list[_Call]) -> None:
        """Until every server accepted its header (and, for a new group, is entering its
        rendezvous): a server that refuses it fails its call instead, which ends the wait at once."""
        deadline = time.monotonic() + self.timeout_s
        while not collective.ready(members, range(1, world_size), kept.syncs):
            if failures:
                lost = kept.group is not None and any(
                    c.error.code() == grpc.StatusCode.NOT_FOUND for c in list(failures)
                )
                raise _GroupLost() if lost else CollectiveFailed("a server refused the update")
            if time.monotonic() > deadline:
                raise GroupFailed(f"not every inference server joined the weight group within {self.timeout_s:g} s")
            time.sleep(_JOIN_POLL_S)

    def _failed(
        self, backend: str, calls: list[_Call], failures: list[_Call], cause: BaseException | None
    ) -> GroupFailed:
        """Cancel every call still open; the error, naming the server that failed where one did. A
        server answers ABORTED when the group broke under it, so the one to name is one that failed
        otherwise (refused, or gone); it may report a moment after the broadcast broke."""

        def culprit() -> _Call | None:
            return next((c for c in list(failures) if c.error.code() != grpc.StatusCode.ABORTED), None)

        deadline = time.monotonic() + _FAILURE_REPORT_S
        while (
            culprit() is None
            and time.monotonic() < deadline
            and any(c.error is None and c.result is None for c in calls)
        ):
            time.sleep(0.01)
        named = culprit()
        for call in calls:
            call.cancel()
        if named is not None:
            return GroupFailed(named.described(backend))
        reasons = "; ".join(f"{c.address}: {c.error.details()}" for c in list(failures)) or str(cause)
        return GroupFailed(f"the {backend} weight broadcast to {', '.join(c.address for c in calls)} failed: {reasons}")
