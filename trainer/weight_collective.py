"""The trainer's side of the collective transports ("nccl", "gloo"): one update broadcast to every
server of a group at once, over a process group built for that update (polar/inference/collective.py).

    UpdateWeightsCollective on each server (a header naming the group and its rank)
      ->  every server marks itself joining in the trainer's store  ->  the group forms
      ->  per bucket: announced on every call, then broadcast from the trainer's buffer
      ->  the calls end; each server answers with the update staged

The tensors are packed into two buffers of `bucket_bytes` (trainer/weight_buckets.py): the trainer
fills one while the other is being broadcast, so its extra memory is two buckets whatever the
model's size.

Nothing waits forever. A server that dies, or refuses a bucket, closes its connections to the group,
so the trainer's broadcast fails at once; each call is also watched on a thread of its own, and a
server's error interrupts the trainer's broadcast where the backend allows (NCCL). The trainer then
closes the group (every other server's broadcast fails), cancels the other calls, and raises
GroupFailed naming the server that failed. A server that neither answers nor closes anything is
caught by the timeout of the joining, then of each broadcast. No server has applied anything: the
caller commits only after every transfer succeeded.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

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

    def __init__(self, address: str, stub, header: inference_pb2.CollectiveWeightsHeader, on_failure: Callable[[_Call], None], timeout_s: float) -> None:
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


class CollectiveSender:
    """Sends updates over collective groups; keeps its rendezvous store and its buffers between them."""

    def __init__(self, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S, rpc_timeout_s: float = 600.0) -> None:
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._store = None
        self._buffers: list[torch.Tensor] = []

    def _buffers_on(self, device: torch.device) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].device != device:
            self._buffers = []  # the old ones are let go first
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(_BUFFERS)]
        return self._buffers

    def send(
        self, backend: str, servers: Sequence[tuple[str, object]], weights: Iterable[tuple[str, torch.Tensor]], note: str, update_id: str
    ) -> list[inference_pb2.UpdateWeightsResponse]:
        """Stage `weights` on every server of `servers` ((address, stub) pairs) over one `backend`
        group; their answers, in order. Raises GroupFailed."""
        if self._store is None:
            self._store = collective.open_store(self.timeout_s)
        tensors = sized(weights)
        group_id = uuid.uuid4().hex
        world_size = len(servers) + 1
        host = rendezvous_host([address for address, _ in servers])
        rendezvous = f"[{host}]:{self._store.port}" if ":" in host else f"{host}:{self._store.port}"
        failures: list[_Call] = []
        lock = threading.Lock()
        group: Group | None = None

        def on_failure(call: _Call) -> None:
            with lock:
                failures.append(call)
                first = len(failures) == 1
            if first and group is not None:
                group.interrupt()  # a broadcast waiting on this server fails now, where the backend allows

        calls = []
        for rank, (address, stub) in enumerate(servers, start=1):
            header = inference_pb2.CollectiveWeightsHeader(
                tensor_count=len(tensors), note=note, update_id=update_id, backend=backend, rendezvous=rendezvous,
                group_id=group_id, world_size=world_size, rank=rank, bucket_bytes=self.bucket_bytes,
                buffer_count=_BUFFERS, timeout_seconds=self.timeout_s,
            )  # fmt: skip
            calls.append(_Call(address, stub, header, on_failure, self.rpc_timeout_s))

        def announce(bucket: inference_pb2.SharedBucket) -> None:
            if failures:
                raise CollectiveFailed("a server of the group failed")
            for call in calls:
                call.send(bucket)

        sent = False
        try:
            members = collective.group_store(self._store, group_id)
            self._wait_for_joining(members, world_size, failures)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == collective.NCCL else torch.device("cpu")
            group = Group(backend, members, 0, world_size, device, host, self.timeout_s)
            if failures:
                raise CollectiveFailed("a server of the group failed")
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                broadcast_buckets(tensors, group, self._buffers_on(device), announce)
            for call in calls:
                call.end()
            results = [call.outcome(self.rpc_timeout_s) for call in calls]
            sent = True
        except (CollectiveFailed, GroupFailed) as exc:
            if group is not None:
                group.close()  # the servers still in a broadcast fail now, and say so
            raise self._failed(backend, calls, failures, exc) from None
        finally:
            if group is not None:
                group.close()
            if not sent:
                for call in calls:
                    call.cancel()
        if failures:
            raise self._failed(backend, calls, failures, None)
        missing = [call.address for call, result in zip(calls, results) if result is None]
        if missing:
            raise GroupFailed(f"inference servers {', '.join(missing)} did not answer the {backend} update within {self.rpc_timeout_s:g} s")
        return results

    def _wait_for_joining(self, members, world_size: int, failures: list[_Call]) -> None:
        """Until every server accepted its header and is entering the group's rendezvous: a server
        that refuses it fails its call instead, which ends the wait at once."""
        deadline = time.monotonic() + self.timeout_s
        while not collective.joined(members, range(1, world_size)):
            if failures:
                raise CollectiveFailed("a server refused the update")
            if time.monotonic() > deadline:
                raise GroupFailed(f"not every inference server joined the weight group within {self.timeout_s:g} s")
            time.sleep(_JOIN_POLL_S)

    def _failed(self, backend: str, calls: list[_Call], failures: list[_Call], cause: BaseException | None) -> GroupFailed:
        """Cancel every call still open; the error, naming the server that failed where one did. A
        server answers ABORTED when the group broke under it, so the one to name is one that failed
        otherwise (refused, or gone); it may report a moment after the broadcast broke."""

        def culprit() -> _Call | None:
            return next((c for c in list(failures) if c.error.code() != grpc.StatusCode.ABORTED), None)

        deadline = time.monotonic() + _FAILURE_REPORT_S
        while culprit() is None and time.monotonic() < deadline and any(c.error is None and c.result is None for c in calls):
            time.sleep(0.01)
        named = culprit()
        for call in calls:
            call.cancel()
        if named is not None:
            return GroupFailed(named.described(backend))
        reasons = "; ".join(f"{c.address}: {c.error.details()}" for c in list(failures)) or str(cause)
        return GroupFailed(f"the {backend} weight broadcast to {', '.join(c.address for c in calls)} failed: {reasons}")
