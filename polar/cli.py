"""The `polar` command line: one row of `COMMANDS` per job, each a thin call into the package.

    polar serve inference   an InferenceService server over one engine (torch, vllm, scripted)
    polar serve envoy       Envoy in front of the gateway and the inference servers (polar.envoy)
    polar serve gateway     the API dialects (HTTP) and GatewayService (gRPC) over an inference service
    polar serve rollout     the RolloutService: tasks in, sessions out to nodes, GRPO groups released
    polar serve node        a gateway plus the pools that run sessions for a rollout server
    polar session open|show|close   recording sessions on a gateway (keys, call records)
    polar submit            tasks from a JSON Lines file, all or none
    polar status            the tasks' sessions per state, rewards, released groups (--watch: live)
    polar results           released groups exported as JSON Lines, resumable from a cursor
    polar up                the whole stack, on the embedded defaults or a TOML config (--submit: and a task file)
    polar version           the installed version

A failure is one line on stderr (`polar: error: ...`) and a non-zero exit, never a traceback:
usage mistakes exit 2, everything else 1, an interrupt 130.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import polar
from polar import envoy
from polar.config import GatewayConfig, InferenceConfig, NodeConfig, RolloutConfig, load_config
from polar.grpc_server import run_service
from polar.stack import StackError, join_host_port, report_ready, run_stack


class CliError(Exception):
    """A failure the command line explains itself."""


# Failures of the user's input or environment; their messages are written for the user as they are.
# Anything else is a bug, still reported in one line but with its exception type.
USER_ERRORS = (CliError, LookupError, ValueError, OSError, StackError)


@dataclass(frozen=True)
class Command:
    """A subcommand: its words after `polar`, its arguments and what it runs."""

    words: tuple[str, ...]  # e.g. ("serve", "inference"); the leading words group commands
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse's default prints the whole usage block first; one line points to --help instead.
        self.exit(2, f"polar: error: {message} (see: {self.prog} --help)\n")


# ---------------------------------------------------------------------------------------- serve


def _inference_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = InferenceConfig()
    parser.add_argument("--engine", default=defaults.engine, help="torch, vllm or scripted (default: %(default)s)")
    parser.add_argument(
        "--model", default=defaults.model, help="tiny, smollm2-135m or a Hugging Face model folder (default: %(default)s)"
    )
    parser.add_argument("--host", default=defaults.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=defaults.port, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--device", default=defaults.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", default=defaults.dtype, help="auto, float32, bfloat16 or float16 (default: %(default)s)")
    parser.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=defaults.max_batch_size,
        help="most sequences decoded in one step (default: %(default)s)",
    )
    parser.add_argument("--script", default=defaults.script, help="scripted engine: its JSON script file")
    # `polar up` passes a pipe's write end here and reads the bound port from it (see polar.stack).
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _serve_inference(args: argparse.Namespace) -> int:
    try:
        _run_inference_server(args)
    except ModuleNotFoundError as exc:
        # Engines import their framework lazily (vLLM only when started); vLLM lives in its own
        # environment because its pins would constrain the main one.
        hint = "; scripts/setup_vllm.sh builds .venv-vllm, whose bin/polar has it" if args.engine == "vllm" else ""
        raise CliError(f"the {args.engine} engine needs the {exc.name!r} package, not installed here{hint}") from exc
    return 0


def _run_inference_server(args: argparse.Namespace) -> None:
    from polar.inference.engines import EngineOptions, create_engine
    from polar.inference.server import serve

    options = EngineOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        script=args.script,
    )
    engine = create_engine(args.engine, options)

    def on_ready(port: int) -> None:
        d = engine.description
        where = f", {d.device}" if d.device else ""
        print(f"inference: serving {d.name} ({d.engine} engine{where}) on {join_host_port(args.host, port)}", flush=True)
        report_ready(args.ready_fd, port)

    run_service(serve(engine, join_host_port(args.host, args.port), on_ready))


def _gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """`polar serve gateway` options; `polar serve node` takes the same."""
    defaults = GatewayConfig()
    parser.add_argument("--inference", required=True, metavar="HOST:PORT", help="gRPC address of the inference service")
    parser.add_argument("--host", default=defaults.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=defaults.port, help="HTTP port of the API dialects (default: %(default)s)")
    parser.add_argument("--grpc-port", type=_port, default=defaults.grpc_port, help="GatewayService port (default: %(default)s)")
    parser.add_argument("--chat-format", default=defaults.chat_format, help="prompt rendering: hermes or smollm2 (default: %(default)s)")
    parser.add_argument("--parser", default=defaults.parser, help="output parser (default: %(default)s)")
    parser.add_argument(
        "--history", choices=("faithful", "template"), default=defaults.history, help="default history policy of new sessions"
    )
    parser.add_argument("--tokenizer", default=defaults.tokenizer, help="tokenizer folder (default: the one inference names)")
    parser.add_argument(
        "--generate-timeout", type=_positive_float, default=defaults.generate_timeout_s, metavar="S",
        help="seconds one generation may take before it is abandoned as hung (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--base-url", default="", metavar="URL",
        help="the URL harnesses are given (Envoy's harness listener; default: the gateway's own)",
    )  # fmt: skip
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    # `polar up` binds the HTTP port before Envoy, which forwards to it, and passes the socket here.
    parser.add_argument("--http-fd", type=int, help=argparse.SUPPRESS)


def _serve_gateway(args: argparse.Namespace) -> int:
    from gateway.server import GatewayStartError, serve_gateway

    def on_ready(running) -> None:
        print(f"gateway: {_gateway_line(running, args)}", flush=True)
        report_ready(args.ready_fd, running.grpc_port)

    try:
        run_service(
            serve_gateway(
                args.inference, args.host, args.port, args.grpc_port, args.chat_format, args.parser, args.history,
                on_ready, http_socket=_inherited_socket(args.http_fd), tokenizer_path=args.tokenizer,
                base_url=args.base_url, generate_timeout_s=args.generate_timeout,
            )
        )  # fmt: skip
    except GatewayStartError as exc:
        raise CliError(str(exc)) from None
    return 0


def _gateway_line(running, args: argparse.Namespace) -> str:
    """What a started gateway (gateway.server.RunningGateway) serves, in one line."""
    from gateway.dialects import available_dialects

    dialects = ", ".join(available_dialects()) or "none"
    return (
        f"{running.gateway.model.name} at {running.http_url} ({dialects}); harness base URL {running.base_url}; "
        f"GatewayService on {join_host_port(args.host, running.grpc_port)}; inference {args.inference}"
    )


def _inherited_socket(fd: int | None) -> socket.socket | None:
    """The listening socket a parent passed as --http-fd."""
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise CliError(f"--http-fd {fd} is not an open socket: {exc.strerror}") from None
    sock.set_inheritable(False)  # the harnesses and evaluators a node starts get no copy
    return sock


def _rollout_server_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RolloutConfig()
    parser.add_argument("--host", default=defaults.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=defaults.port, help="0 picks a free port (default: %(default)s)")
    parser.add_argument(
        "--store", default=defaults.store, metavar="FILE",
        help="SQLite file of tasks, sessions and results; reopened as it is on restart (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-interval", type=_positive_float, default=defaults.heartbeat_interval_s, metavar="SECONDS",
        help="longest a node's heartbeat waits for work (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--node-timeout", type=_positive_float, default=defaults.node_timeout_s, metavar="SECONDS",
        help="a node silent this long is dead and its sessions are dispatched again (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-attempts", type=_positive_int, default=defaults.max_attempts,
        help="dispatches of one session before it is marked failed (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _serve_rollout(args: argparse.Namespace) -> int:
    from polar.rollout.server import serve_rollout
    from polar.rollout.store import StoreError

    def on_ready(running) -> None:
        print(f"rollout: RolloutService on {join_host_port(args.host, running.port)}; store {args.store}", flush=True)
        report_ready(args.ready_fd, running.port)

    try:
        run_service(
            serve_rollout(
                args.store,
                join_host_port(args.host, args.port),
                heartbeat_interval_s=args.heartbeat_interval,
                node_timeout_s=args.node_timeout,
                max_attempts=args.max_attempts,
                on_ready=on_ready,
            )
        )
    except StoreError as exc:
        raise CliError(str(exc)) from None
    return 0


def _node_arguments(parser: argparse.ArgumentParser) -> None:
    _gateway_arguments(parser)
    defaults = NodeConfig()
    _rollout_option(parser, "the rollout server to work for")
    parser.add_argument(
        "--init-workers", type=_positive_int, default=defaults.init_workers,
        help="runtimes prepared at once (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--ready-slots", type=_non_negative_int, default=defaults.ready_slots,
        help="prepared runtimes kept waiting for a harness (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--running-slots", type=_positive_int, default=defaults.running_slots,
        help="harnesses run at once (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--postrun-workers", type=_positive_int, default=defaults.postrun_workers,
        help="sessions evaluated, rebuilt and reported at once (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-prewarm", dest="prewarm", action="store_false", help="prepare a runtime only when a session needs it"
    )
    parser.add_argument(
        "--work-root", default=defaults.work_root, metavar="DIR",
        help="folder for session workspaces (default: a temporary folder, removed at exit)",
    )  # fmt: skip
    parser.add_argument(
        "--harness-path", default=defaults.harness_path, metavar="DIRS",
        help=f"folders searched for harness CLIs before PATH ({os.pathsep!r}-separated), e.g. node_modules/.bin",
    )  # fmt: skip
    parser.add_argument(
        "--harness-output-limit", type=_positive_int, default=defaults.harness_output_limit, metavar="BYTES",
        help="harness and evaluator output kept per session (default: %(default)s)",
    )  # fmt: skip


def _serve_node(args: argparse.Namespace) -> int:
    from gateway.server import GatewayStartError
    from polar.rollout.node import serve_node

    node = NodeConfig(
        rollout_address=args.rollout,
        init_workers=args.init_workers,
        ready_slots=args.ready_slots,
        running_slots=args.running_slots,
        postrun_workers=args.postrun_workers,
        prewarm=args.prewarm,
        work_root=args.work_root,
        harness_path=args.harness_path,
        harness_output_limit=args.harness_output_limit,
    )
    gateway = GatewayConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        chat_format=args.chat_format,
        parser=args.parser,
        history=args.history,
        inference_address=args.inference,
        tokenizer=args.tokenizer,
        generate_timeout_s=args.generate_timeout,
    )

    def on_ready(running) -> None:
        pools = ", ".join(f"{p.name} {p.capacity}" for p in running.node.pool_status())
        print(
            f"node {running.node.node_id}: {_gateway_line(running.gateway, args)}; rollout {args.rollout}; pools {pools}",
            flush=True,
        )
        report_ready(args.ready_fd, running.gateway.grpc_port)

    try:
        run_service(
            serve_node(
                node, gateway, inference_address=args.inference, rollout_address=args.rollout,
                base_url=args.base_url, http_socket=_inherited_socket(args.http_fd), on_ready=on_ready,
            )
        )  # fmt: skip
    except GatewayStartError as exc:
        raise CliError(str(exc)) from None
    return 0


# -------------------------------------------------------------------------------------- session


def _gateway_option(parser: argparse.ArgumentParser) -> None:
    default = join_host_port(GatewayConfig().host, GatewayConfig().grpc_port)
    parser.add_argument("--gateway", default=default, metavar="HOST:PORT", help="GatewayService address (default: %(default)s)")


def _session_open_arguments(parser: argparse.ArgumentParser) -> None:
    _gateway_option(parser)
    parser.add_argument("--task-id", default="", help="task the session runs, for bookkeeping")
    parser.add_argument("--history", choices=("faithful", "template"), help="history policy (default: the gateway's)")


def _session_key_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", help="the session's key or id")
    _gateway_option(parser)


def _session_show_arguments(parser: argparse.ArgumentParser) -> None:
    _session_key_arguments(parser)
    parser.add_argument("--json", action="store_true", help="the session and every call record as JSON")


def _gateway_rpc(address: str, method: str, request):
    """One unary GatewayService call; gRPC failures become one-line errors."""
    import grpc

    from polar.v1 import gateway_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            return getattr(gateway_pb2_grpc.GatewayServiceStub(channel), method)(request, timeout=10)
        except grpc.RpcError as exc:
            raise CliError(f"{method} on {address}: {exc.code().name}: {exc.details()}") from None


def _session_open(args: argparse.Namespace) -> int:
    from polar.v1 import gateway_pb2

    history = {None: 0, "faithful": gateway_pb2.HISTORY_POLICY_FAITHFUL, "template": gateway_pb2.HISTORY_POLICY_TEMPLATE}
    request = gateway_pb2.OpenSessionRequest(task_id=args.task_id, history=history[args.history])
    print(_gateway_rpc(args.gateway, "OpenSession", request).session.key)
    return 0


def _session_show(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from polar.v1 import common_pb2, gateway_pb2

    response = _gateway_rpc(args.gateway, "GetSession", gateway_pb2.GetSessionRequest(key=args.key))
    if args.json:
        print(json_format.MessageToJson(response, indent=2))
        return 0
    s = response.session
    print(f"session {s.session_id} ({'closed' if s.closed else 'open'}), {s.call_count} calls")
    for call in response.calls:
        finish = common_pb2.FinishReason.Name(call.finish_reason).removeprefix("FINISH_REASON_").lower()
        extends = f" extends {call.extends_call_id}" if call.extends_call_id else ""
        print(
            f"  {call.call_id}  {common_pb2.Dialect.Name(call.dialect).removeprefix('DIALECT_').lower()}  "
            f"prompt {len(call.prompt_token_ids)}  sampled {len(call.sampled_token_ids)}  {finish}"
            f"{'  aborted' if call.aborted else ''}{extends}"
        )
    return 0


def _session_close(args: argparse.Namespace) -> int:
    from polar.v1 import gateway_pb2

    session = _gateway_rpc(args.gateway, "CloseSession", gateway_pb2.CloseSessionRequest(key=args.key)).session
    print(f"closed session {session.session_id} ({session.call_count} calls)")
    return 0


# ------------------------------------------------------------------------------ submit, status, results


def _rollout_option(parser: argparse.ArgumentParser, help: str = "RolloutService address") -> None:
    default = join_host_port(RolloutConfig().host, RolloutConfig().port)
    parser.add_argument("--rollout", default=default, metavar="HOST:PORT", help=f"{help} (default: %(default)s)")


def _rollout_channel(address: str):
    """A channel to the rollout server that takes messages as large as the server sends (results
    batches pass gRPC's default 4 MB)."""
    import grpc

    from polar.rollout.server import MAX_MESSAGE_BYTES

    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])


def _rollout_rpc(address: str, method: str, request):
    """One unary RolloutService call; gRPC failures become one-line errors."""
    import grpc

    from polar.v1 import rollout_pb2_grpc

    with _rollout_channel(address) as channel:
        try:
            return getattr(rollout_pb2_grpc.RolloutServiceStub(channel), method)(request, timeout=30)
        except grpc.RpcError as exc:
            raise _rpc_error(method, address, exc) from None


def _rpc_error(method: str, address: str, exc) -> CliError:
    import grpc

    hint = " (is `polar up` or `polar serve rollout` running there?)" if exc.code() == grpc.StatusCode.UNAVAILABLE else ""
    return CliError(f"{method} on {address}: {exc.code().name}: {exc.details()}{hint}")


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="TASKS.jsonl", help="one Task per line (protobuf JSON; '#' lines skipped); - reads stdin")
    _rollout_option(parser)


def _submit(args: argparse.Namespace) -> int:
    from polar.v1 import rollout_pb2

    tasks = _read_tasks(args.file)
    response = _rollout_rpc(args.rollout, "SubmitTasks", rollout_pb2.SubmitTasksRequest(tasks=tasks))
    for task_id in response.task_ids:
        print(task_id)
    return 0


def _read_tasks(file: str) -> list:
    """Every task of a task file ("-": stdin), checked whole; CliError naming FILE:LINE otherwise."""
    from polar.rollout.tasks import TaskFileError, parse_task_lines

    source = "<stdin>" if file == "-" else file
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot read task file {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"task file {source} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        tasks = parse_task_lines(text, source)
    except TaskFileError as exc:
        # One problem per line in the message; the error stays one line, nothing was submitted.
        raise CliError(f"nothing submitted: {'; '.join(str(exc).splitlines())}") from None
    if not tasks:
        raise CliError(f"nothing submitted: {source} holds no tasks (only blank or '#' lines)")
    return tasks


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task_ids", nargs="*", metavar="TASK_ID", help="tasks to show (default: every task)")
    _rollout_option(parser)
    parser.add_argument("--watch", action="store_true", help="redraw until every task is released (or Ctrl-C)")
    parser.add_argument(
        "--interval", type=_positive_float, default=1.0, metavar="SECONDS", help="--watch: seconds between redraws (default: %(default)s)"
    )


def _status(args: argparse.Namespace) -> int:
    import grpc

    from polar.rollout.report import render_nodes, render_status, render_totals, summarize
    from polar.v1 import rollout_pb2, rollout_pb2_grpc

    tty = sys.stdout.isatty()
    with _rollout_channel(args.rollout) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)

        def fetch() -> tuple[list, list]:
            """(the live nodes, the tasks asked for)."""
            method = "ListNodes"
            try:
                nodes = stub.ListNodes(rollout_pb2.ListNodesRequest(), timeout=30).nodes
                method = "GetTaskStatus"
                tasks = stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=args.task_ids), timeout=30).tasks
            except grpc.RpcError as exc:
                raise _rpc_error(method, args.rollout, exc) from None
            return list(nodes), list(tasks)

        nodes, tasks = fetch()
        if not args.watch:
            print(render_nodes(nodes) + "\n\n" + render_status(tasks))
            return 0
        last_totals = None
        while True:
            done = all(task.released for task in tasks)
            if tty:
                node_lines = render_nodes(nodes)
                # What the nodes, a blank line, the header, the totals and the cursor's line leave.
                rows = shutil.get_terminal_size().lines - node_lines.count("\n") - 5
                # Home and clear to the end, then draw: the screen replaces itself in place.
                sys.stdout.write(f"\x1b[H\x1b[J{node_lines}\n\n{render_status(tasks, bars=True, max_rows=rows)}\n")
                sys.stdout.flush()
            elif done:
                print(render_nodes(nodes) + "\n\n" + render_status(tasks), flush=True)
            else:
                # Not a terminal (a log, a pipe): one totals line per change, the tables at the end.
                totals = render_totals(summarize(tasks))
                if totals != last_totals:
                    print(totals, flush=True)
                    last_totals = totals
            if done:
                return 0
            time.sleep(args.interval)
            nodes, tasks = fetch()


def _results_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--export", required=True, metavar="OUT.jsonl",
        help="file to write, one Trajectory per line (protobuf JSON), whole groups in release order; - for stdout",
    )  # fmt: skip
    _rollout_option(parser)
    parser.add_argument("--cursor", default="", help="start after this cursor (printed by an earlier export)")
    parser.add_argument("--follow", action="store_true", help="keep exporting groups as they are released, until Ctrl-C")


def _results(args: argparse.Namespace) -> int:
    import grpc

    from polar.rollout.report import trajectory_lines
    from polar.v1 import rollout_pb2, rollout_pb2_grpc

    to_stdout = args.export == "-"
    report = sys.stderr if to_stdout else sys.stdout
    request = rollout_pb2.WatchResultsRequest(cursor=args.cursor, until_caught_up=not args.follow)
    cursor, groups, trajectories = args.cursor, 0, 0

    def summary() -> None:
        where = "stdout" if to_stdout else args.export
        print(f"exported {trajectories} trajectories of {groups} groups to {where}", file=report)
        # The file holds every group up to this cursor: `--cursor` with it resumes after them.
        print(f"cursor: {cursor}" if cursor else "cursor: none (nothing released yet)", file=report, flush=True)

    try:
        out = sys.stdout if to_stdout else open(args.export, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise CliError(f"cannot write {args.export}: {exc.strerror}") from None
    try:
        with _rollout_channel(args.rollout) as channel:
            stream = rollout_pb2_grpc.RolloutServiceStub(channel).WatchResults(request)
            try:
                for batch in stream:
                    lines = trajectory_lines(batch.zstd_trajectories)
                    out.writelines(line + "\n" for line in lines)
                    out.flush()
                    trajectories += len(lines)
                    cursor = batch.cursor
                    groups += batch.group_count
            except grpc.RpcError as exc:
                summary()
                raise _rpc_error("WatchResults", args.rollout, exc) from None
            except KeyboardInterrupt:
                stream.cancel()
                summary()
                return 130
    finally:
        if not to_stdout:
            out.close()
    summary()
    return 0


# ------------------------------------------------------------------------------------------- up


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file overriding the embedded defaults (see polar/config.py)")
    parser.add_argument(
        "--submit", metavar="TASKS.jsonl",
        help="once the stack serves, submit these tasks and print their progress until every group is released",
    )  # fmt: skip


def _up(args: argparse.Namespace) -> int:
    # The file is checked before anything starts: a bad line should not cost a stack start-up.
    tasks = _read_tasks(args.submit) if args.submit else None
    config = load_config(args.config)
    if tasks is None:
        return run_stack(config)

    def follow(addresses: dict[str, str]) -> None:
        threading.Thread(target=_submit_and_follow, args=(addresses["rollout"], tasks), daemon=True).start()

    return run_stack(config, on_ready=follow)


def _submit_and_follow(rollout: str, tasks: list) -> None:
    """`polar up --submit`: the tasks submitted, a totals line per change, the table once all are
    released. Runs beside the supervisor; a failure is reported in one line and the stack serves on."""
    from polar.rollout.report import render_status, render_totals, summarize
    from polar.v1 import rollout_pb2

    try:
        task_ids = list(_rollout_rpc(rollout, "SubmitTasks", rollout_pb2.SubmitTasksRequest(tasks=tasks)).task_ids)
        print(f"polar up: submitted {len(task_ids)} task{'s' if len(task_ids) != 1 else ''}", flush=True)
        last = None
        while True:
            request = rollout_pb2.GetTaskStatusRequest(task_ids=task_ids)
            statuses = list(_rollout_rpc(rollout, "GetTaskStatus", request).tasks)
            if all(status.released for status in statuses):
                print(render_status(statuses), flush=True)
                print(f"polar up: every group released; export them with `polar results --export FILE --rollout {rollout}`", flush=True)
                return
            if (totals := render_totals(summarize(statuses))) != last:
                print(f"polar up: {totals}", flush=True)
                last = totals
            time.sleep(1.0)
    except CliError as exc:
        print(f"polar up: {exc}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- verify


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files", nargs="+", metavar="FILE", help="session files: a Trajectory with its calls and traces (.json, .pb, optionally .zst)"
    )


def _verify(args: argparse.Namespace) -> int:
    from polar.trajectory.verify import verify_command

    # The worst outcome decides: 2 (a file could not be read) over 1 (a trace is unfaithful) over 0.
    return max(verify_command(path, sys.stdout) for path in args.files)


# -------------------------------------------------------------------------------------- version


def _version(args: argparse.Namespace) -> int:
    print(f"polar {polar.__version__}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(("serve", "inference"), "serve a model over gRPC (InferenceService)", _inference_arguments, _serve_inference),
    Command(("serve", "envoy"), "run Envoy in front of the gateway and the inference servers", envoy.add_arguments, envoy.serve),
    Command(("serve", "gateway"), "serve the API dialects over HTTP and GatewayService over gRPC", _gateway_arguments, _serve_gateway),
    Command(("serve", "rollout"), "serve the RolloutService: tasks, dispatch to nodes, results", _rollout_server_arguments, _serve_rollout),
    Command(("serve", "node"), "run a gateway node: the gateway plus the pools that run sessions", _node_arguments, _serve_node),
    Command(("session", "open"), "open a recording session on a gateway and print its key", _session_open_arguments, _session_open),
    Command(("session", "show"), "print a session and its call records", _session_show_arguments, _session_show),
    Command(("session", "close"), "close a session (its key is refused from then on)", _session_key_arguments, _session_close),
    Command(("submit",), "submit the tasks of a JSON Lines file (all or none) and print their ids", _submit_arguments, _submit),
    Command(("status",), "show each task's sessions per state, its reward and whether it was released", _status_arguments, _status),
    Command(("results",), "export released groups as JSON Lines and print the cursor to resume from", _results_arguments, _results),
    Command(("up",), "start the whole stack and supervise it until Ctrl-C", _up_arguments, _up),
    Command(("verify",), "check that every trainable token of a session's traces is what the engine sampled", _verify_arguments, _verify),
    Command(("version",), "print the installed version", lambda parser: None, _version),
)

GROUP_HELP = {"serve": "run one service in the foreground", "session": "open, show and close gateway sessions"}


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog="polar", description="Reinforcement learning for unmodified language agents.")
    subparsers = {(): root.add_subparsers(dest="command", metavar="COMMAND", required=True)}
    for command in COMMANDS:
        for depth in range(1, len(command.words)):
            group = command.words[:depth]
            if group not in subparsers:
                group_parser = subparsers[group[:-1]].add_parser(group[-1], help=GROUP_HELP[group[-1]])
                subparsers[group] = group_parser.add_subparsers(
                    dest="_".join(group), metavar="SERVICE", required=True
                )
        parser = subparsers[command.words[:-1]].add_parser(command.words[-1], help=command.help)
        command.add_arguments(parser)
        parser.set_defaults(run=command.run)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - the promise is one line, never a traceback
        return _fail(f"internal error: {type(exc).__name__}: {exc}")


def _fail(message: str) -> int:
    # Multi-line messages (parser errors quoting input) are folded so the error stays one line.
    print("polar: error: " + " ".join(message.split()), file=sys.stderr)
    return 1


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
