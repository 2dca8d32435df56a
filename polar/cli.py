"""The `polar` command line: one row of `COMMANDS` per job, each a thin call into the package.

    polar serve inference   an InferenceService server over one engine (torch, vllm, scripted)
    polar serve envoy       Envoy in front of the gateway and the inference servers (polar.envoy)
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
from polar.config import InferenceConfig, load_config
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


# ------------------------------------------------------------------------------------------- up


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file overriding the embedded defaults (see polar/config.py)")


def _up(args: argparse.Namespace) -> int:
    return run_stack(load_config(args.config))


# -------------------------------------------------------------------------------------- version


def _version(args: argparse.Namespace) -> int:
    print(f"polar {polar.__version__}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(("serve", "inference"), "serve a model over gRPC (InferenceService)", _inference_arguments, _serve_inference),
    Command(("serve", "envoy"), "run Envoy in front of the gateway and the inference servers", envoy.add_arguments, envoy.serve),
    Command(("up",), "start the whole stack and supervise it until Ctrl-C", _up_arguments, _up),
    Command(("version",), "print the installed version", lambda parser: None, _version),
)

GROUP_HELP = {"serve": "run one service in the foreground"}


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
