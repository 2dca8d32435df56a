"""The `polar` command line: one row of `COMMANDS` per job, each a thin call into the package.

    polar serve inference   an InferenceService server over one engine (torch, vllm, scripted)
    polar serve envoy       Envoy in front of the gateway and the inference servers (polar.envoy)
    polar serve gateway     the API dialects (HTTP) and GatewayService (gRPC) over an inference service
    polar session open|show|close   recording sessions on a gateway (keys, call records)
    polar up                the whole stack, on the embedded defaults or a TOML config
    polar version           the installed version

A failure is one line on stderr (`polar: error: ...`) and a non-zero exit, never a traceback:
usage mistakes exit 2, everything else 1, an interrupt 130.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import polar
from polar import envoy
from polar.config import GatewayConfig, InferenceConfig, load_config
from polar.stack import StackError, join_host_port, run_stack


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
        if args.ready_fd is not None:
            with os.fdopen(args.ready_fd, "w") as ready:
                ready.write(f"{port}\n")

    asyncio.run(serve(engine, join_host_port(args.host, args.port), on_ready))


def _gateway_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--base-url", default="", metavar="URL",
        help="the URL harnesses use, reported by GetNodeStatus (Envoy's harness listener; default: the gateway's own)",
    )  # fmt: skip
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _serve_gateway(args: argparse.Namespace) -> int:
    from gateway.dialects import available_dialects
    from gateway.server import serve_gateway

    def on_ready(running) -> None:
        dialects = ", ".join(available_dialects()) or "none"
        print(
            f"gateway: {running.gateway.model.name} at {running.http_url} ({dialects}); harness base URL {running.base_url}; "
            f"GatewayService on {join_host_port(args.host, running.grpc_port)}; inference {args.inference}",
            flush=True,
        )
        if args.ready_fd is not None:
            with os.fdopen(args.ready_fd, "w") as ready:
                ready.write(f"{running.grpc_port}\n")

    asyncio.run(
        serve_gateway(
            args.inference, args.host, args.port, args.grpc_port, args.chat_format, args.parser, args.history,
            on_ready, tokenizer_path=args.tokenizer, base_url=args.base_url,
        )
    )  # fmt: skip
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


# ------------------------------------------------------------------------------------------- up


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file overriding the embedded defaults (see polar/config.py)")


def _up(args: argparse.Namespace) -> int:
    return run_stack(load_config(args.config))


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
    Command(("session", "open"), "open a recording session on a gateway and print its key", _session_open_arguments, _session_open),
    Command(("session", "show"), "print a session and its call records", _session_show_arguments, _session_show),
    Command(("session", "close"), "close a session (its key is refused from then on)", _session_key_arguments, _session_close),
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


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
