"""The rollout server's clients on the command line: `polar submit` and `polar results` (and what
`polar status` and `polar up --submit` ask), each a call or a stream over one channel. A failed call
is a `ClientError` whose message is one line for the user, naming the method and the address.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc

from polar import credentials
from polar.rollout.report import trajectory_lines
from polar.rollout.server import MAX_MESSAGE_BYTES
from polar.rollout.tasks import TaskFileError, parse_task_lines
from polar.v1 import rollout_pb2, rollout_pb2_grpc


class ClientError(Exception):
    """A call that failed, or input that cannot be sent; the message says why in one line."""


def channel(address: str) -> grpc.Channel:
    """A channel to the rollout server that takes messages as large as the server sends (results
    batches pass gRPC's default 4 MB), calling as the operator (polar.credentials.for_commands)."""
    return credentials.channel(
        address, credentials.OPERATOR, credentials.for_commands(), options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    )


def call(address: str, method: str, request):
    """One unary RolloutService call; gRPC failures become ClientErrors."""
    with channel(address) as open_channel:
        try:
            return getattr(rollout_pb2_grpc.RolloutServiceStub(open_channel), method)(request, timeout=30)
        except grpc.RpcError as exc:
            raise rpc_error(method, address, exc) from None


def rpc_error(method: str, address: str, exc: grpc.RpcError) -> ClientError:
    hint = " (is `polar up` or `polar serve rollout` running there?)" if exc.code() == grpc.StatusCode.UNAVAILABLE else ""
    return ClientError(f"{method} on {address}: {exc.code().name}: {exc.details()}{hint}")


def read_tasks(file: str) -> list[rollout_pb2.Task]:
    """Every task of a task file ("-": stdin), checked whole; ClientError naming FILE:LINE otherwise."""
    source = "<stdin>" if file == "-" else file
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise ClientError(f"cannot read task file {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ClientError(f"task file {source} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        tasks = parse_task_lines(text, source)
    except TaskFileError as exc:
        # One problem per line in the message; the error stays one line, nothing was submitted.
        raise ClientError(f"nothing submitted: {'; '.join(str(exc).splitlines())}") from None
    if not tasks:
        raise ClientError(f"nothing submitted: {source} holds no tasks (only blank or '#' lines)")
    return tasks


def submit(address: str, tasks: list[rollout_pb2.Task]) -> list[str]:
    """The tasks submitted, all or none; their ids."""
    return list(call(address, "SubmitTasks", rollout_pb2.SubmitTasksRequest(tasks=tasks)).task_ids)


def fetch_status(stub: rollout_pb2_grpc.RolloutServiceStub, address: str, task_ids: list[str]) -> tuple[list, list]:
    """(the live nodes, the tasks asked for: every task when task_ids is empty), over `stub`'s
    channel to `address`."""
    method = "ListNodes"
    try:
        nodes = stub.ListNodes(rollout_pb2.ListNodesRequest(), timeout=30).nodes
        method = "GetTaskStatus"
        tasks = stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=task_ids), timeout=30).tasks
    except grpc.RpcError as exc:
        raise rpc_error(method, address, exc) from None
    return list(nodes), list(tasks)


def fetch_upstreams(stub: rollout_pb2_grpc.RolloutServiceStub, address: str) -> rollout_pb2.ListUpstreamsResponse:
    """Envoy's upstreams and the Envoys of the control plane, with the versions they acknowledged."""
    try:
        return stub.ListUpstreams(rollout_pb2.ListUpstreamsRequest(), timeout=30)
    except grpc.RpcError as exc:
        raise rpc_error("ListUpstreams", address, exc) from None


def export_results(address: str, export: str, cursor: str = "", follow: bool = False) -> int:
    """`polar results`: released groups written to `export` ("-": stdout) as JSON Lines, one
    Trajectory each, starting after `cursor`; until caught up, or with `follow` until Ctrl-C or
    SIGTERM (then 128 + the signal's number, as a process it ended: 130, 143). Prints what was
    written and the cursor to resume from, also when the stream fails.

    A signal cancels the stream rather than raising where it lands: the batch in hand is written
    whole first, so the file ends exactly at the printed cursor and `--cursor` resumes without a
    group twice. A signal this process was started ignoring (`nohup`, `cmd &` in a script) stays
    ignored.
    """
    to_stdout = export == "-"
    report = sys.stderr if to_stdout else sys.stdout
    request = rollout_pb2.WatchResultsRequest(cursor=cursor, until_caught_up=not follow)
    groups = trajectories = 0
    stream: grpc.Call | None = None
    stopped_by: list[int] = []

    def summary() -> None:
        where = "stdout" if to_stdout else export
        print(f"exported {trajectories} trajectories of {groups} groups to {where}", file=report)
        # The file holds every group up to this cursor: `--cursor` with it resumes after them.
        print(f"cursor: {cursor}" if cursor else "cursor: none (nothing released yet)", file=report, flush=True)

    def stop(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        if stream is not None:
            stream.cancel()

    try:
        out = sys.stdout if to_stdout else open(export, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ClientError(f"cannot write {export}: {exc.strerror}") from None
    caught = [s for s in (signal.SIGINT, signal.SIGTERM) if follow and signal.getsignal(s) != signal.SIG_IGN]
    previous = {signum: signal.signal(signum, stop) for signum in caught}
    try:
        with channel(address) as open_channel:
            stream = rollout_pb2_grpc.RolloutServiceStub(open_channel).WatchResults(request)
            if stopped_by:
                stream.cancel()
            for batch in stream:
                lines = trajectory_lines(batch.zstd_trajectories)
                out.writelines(line + "\n" for line in lines)
                out.flush()
                trajectories += len(lines)
                cursor = batch.cursor
                groups += batch.group_count
    except grpc.RpcError as exc:
        summary()
        if stopped_by:
            return 128 + stopped_by[0]
        raise rpc_error("WatchResults", address, exc) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if not to_stdout:
            out.close()
    summary()
    return 0
