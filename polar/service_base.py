"""What every Polar service shares, and the one way to declare one.

A service is a config section (a dataclass in polar/config.py, one commented field per setting) plus a
`Service` row (polar/service_table.py) naming it and the function that serves it. From those two follow:

    `polar serve NAME --help`   one flag per field: `field_name` -> `--field-name`, the field's type
                                and checks, its comment as the help, its default
    `polar up`'s command line   `Service.spec(config)`: the same flags with the config's values
    the server's arguments      the config object itself: `serve(config, ready=...)`

Flags that are not settings are the `Flag`s of the row (another service's address such as
`--inference`, or a handed-down socket); `--ready-fd` is every service's.

This module is a leaf: it imports no service, nor the stack or Envoy, so each of them can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polar.config import Setting, settings

LISTEN_BACKLOG = 512  # connections the kernel queues on a handed-down socket before its server accepts


class ServiceError(RuntimeError):
    """A service cannot start or failed; the message names it and says why, for the user as it is."""


@dataclass(frozen=True)
class ServiceSpec:
    """One child of the stack: how to start it and how to tell that it serves."""

    name: str  # shown in the endpoint table and in errors
    # The command; `--ready-fd N` is appended. An argument "{name}" stands for the address to dial
    # the service `name` started before this one, "{name.key}" for a value it reported when ready
    # (so services on port 0 can still be found).
    argv: tuple[str, ...]
    host: str  # address the service listens on
    health_service: str  # gRPC health-checking service name that must report SERVING
    detail: str  # one line for the endpoint table; "{key}" there is a value this service reports
    # The supervisor binds this service's HTTP port and hands it the listening socket (`--http-fd N`).
    takes_http_socket: bool = False
    # A job (the trainer of `polar train`): its exit with code 0 is the stack's work done, and the
    # stack stops with success; any other service's exit is a failure.
    finishes: bool = False
    # Seconds it gets to stop after SIGTERM (e.g. to write a checkpoint); 0 = the stack's stop_timeout_s.
    stop_timeout_s: float = 0.0


@dataclass(frozen=True)
class Flag:
    """A flag of `polar serve NAME` that is not one of its settings. `dest` names a config field it
    sets (e.g. "inference_address" for `--inference`), else a keyword argument of the serve function."""

    name: str  # e.g. "--inference"
    dest: str
    help: str
    options: Mapping[str, Any] = field(default_factory=dict)  # more argparse.add_argument keywords


@dataclass(frozen=True)
class Service:
    """A service of Polar: `polar serve NAME`, and a child of `polar up` through `spec`."""

    name: str  # `polar serve NAME`; its row in `polar up`'s table
    help: str  # one line for `polar serve --help`
    sections: tuple[type, ...]  # its config dataclasses, in the order `serve` takes them
    health_service: str  # the gRPC health-checking name that reports SERVING once it serves
    # "module:function": `serve(*configs, ready=Ready, **flags)`, a coroutine function (run on the
    # service event loop until SIGINT/SIGTERM) or a plain one; imported only when the service runs.
    serve: str
    flags: tuple[Flag, ...] = ()
    takes_http_socket: bool = False  # `--http-fd N`: an HTTP listener bound by whoever started it

    def all_flags(self) -> tuple[Flag, ...]:
        extra = (Flag("--http-fd", "http_socket", argparse.SUPPRESS, {"type": inherited_socket}),)
        return self.flags + (extra if self.takes_http_socket else ())

    def settings(self) -> list[Setting]:
        """The settings that are flags of their own: every field but those an explicit flag sets."""
        given = {flag.dest for flag in self.flags}
        return [setting for section in self.sections for setting in settings(section) if setting.name not in given]

    # -- polar serve NAME ---------------------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for setting in self.settings():
            _add_setting(parser, setting)
        for flag in self.all_flags():
            parser.add_argument(flag.name, dest=flag.dest, help=flag.help, **flag.options)
        # `polar up` passes a pipe's write end here and reads the bound port from it (see polar.app.stack).
        parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    def configs(self, args: argparse.Namespace) -> tuple[Any, ...]:
        """The config sections a parsed command line stands for."""
        return tuple(
            section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section)}) for section in self.sections
        )

    def run(self, args: argparse.Namespace) -> int:
        """`polar serve NAME`: serve until SIGINT or SIGTERM."""
        from polar.grpc_server import run_service

        module, _, function = self.serve.partition(":")
        serve = getattr(importlib.import_module(module), function)
        fields = {f.name for section in self.sections for f in dataclasses.fields(section)}
        keywords = {flag.dest: getattr(args, flag.dest) for flag in self.all_flags() if flag.dest not in fields}
        result = serve(*self.configs(args), ready=Ready(args.ready_fd), **keywords)
        if inspect.iscoroutine(result):
            run_service(result)
        return 0

    # -- polar up -------------------------------------------------------------------------------------

    def argv(self, *configs: Any, **keywords: Any) -> tuple[str, ...]:
        """The command line of `polar serve NAME` that serves these configs; `keywords` give the
        values of flags that set no config field (a list repeats its flag)."""
        argv = [sys.executable, "-m", "polar", "serve", self.name]
        values = {f.name: getattr(config, f.name) for config in configs for f in dataclasses.fields(config)}
        for setting in self.settings():
            value = values[setting.name]
            if setting.kind is bool:
                argv.append(_flag_name(setting.name) if value else "--no-" + _flag_name(setting.name)[2:])
            else:
                argv += [_flag_name(setting.name), str(value)]
        for flag in self.flags:
            value = values[flag.dest] if flag.dest in values else keywords.get(flag.dest)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if item not in (None, ""):
                    argv += [flag.name, str(item)]
        return tuple(argv)

    def spec(self, *configs: Any, detail: str, **keywords: Any) -> ServiceSpec:
        """This service as a child of the stack, serving these configs."""
        hosts = [config.host for config in configs if hasattr(config, "host")]
        if not hosts:
            raise ValueError(f"{self.name}: no config section has the `host` its health check dials")
        host = hosts[0]
        return ServiceSpec(self.name, self.argv(*configs, **keywords), host, self.health_service, detail)


def _flag_name(field_name: str) -> str:
    """The one naming rule: field `generate_timeout_s` is flag `--generate-timeout-s`."""
    return "--" + field_name.replace("_", "-")


def _add_setting(parser: argparse.ArgumentParser, setting: Setting) -> None:
    shown = '""' if setting.default == "" else "%(default)s"
    text = f"{setting.help.replace('%', '%%')} (default: {shown})"
    if setting.kind is bool:
        parser.add_argument(
            _flag_name(setting.name), action=argparse.BooleanOptionalAction, default=setting.default, help=text
        )
        return

    def parse(value: str) -> Any:
        try:
            return setting.convert(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.kind.__name__  # argparse names the type in some messages
    parser.add_argument(
        _flag_name(setting.name), type=parse, default=setting.default, metavar=_metavar(setting), help=text
    )


def _metavar(setting: Setting) -> str:
    if setting.choices:
        return "|".join(map(str, setting.choices))
    if setting.name.endswith("port"):
        return "PORT"
    if setting.kind is float:
        return "SECONDS" if setting.name.endswith("_s") else "X"
    return "N" if setting.kind is int else setting.name.rsplit("_", 1)[-1].upper()


# ---------------------------------------------------------------------------------- readiness


class Ready:
    """How a served process says it serves: one line on stdout for people, and its port (plus any
    `key=value` words for later services, "{name.key}") on `--ready-fd` for `polar up`."""

    def __init__(self, ready_fd: int | None = None) -> None:
        self.ready_fd = ready_fd

    def __call__(self, port: int, line: str, **reported: str) -> None:
        print(line, flush=True)
        if not os.environ.get("POLAR_CREDENTIALS"):  # polar.credentials.ENV_VAR (this module imports no service)
            print(
                "warning: no credentials ($POLAR_CREDENTIALS unset): this service's gRPC calls are open to"
                " every process that can reach its port (`polar up` sets them)",
                file=sys.stderr,
                flush=True,
            )
        report_ready(self.ready_fd, port, **reported)


def report_ready(ready_fd: int | None, port: int, **reported: str) -> None:
    """A child's side of readiness: tell `polar up` (which passed --ready-fd) the port that serves
    and what else it reports ("{name.key}" for later services); nothing without --ready-fd."""
    if ready_fd is None:
        return
    words = [str(port), *(f"{key}={value}" for key, value in reported.items())]
    with os.fdopen(ready_fd, "w") as ready:
        ready.write(" ".join(words) + "\n")


# ---------------------------------------------------------------------------------- addresses


def connectable(host: str) -> str:
    """The address a local client dials for a server listening on host."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def advertised(host: str, port: int, advertise_address: str = "") -> str:
    """Where other machines reach a server bound to host:port: its `advertise_address` when given,
    else host:port, a wildcard host standing for this machine's name."""
    if advertise_address:
        return advertise_address
    return join_host_port(socket.gethostname() if host in ("0.0.0.0", "::", "") else host, port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port) and listening, for a server that must be
    known by its port before it starts: handed to it, the port stays taken from the moment it is
    chosen, where a port merely found free could be taken by anything before the server binds it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def inherited_socket(fd: str) -> socket.socket:
    """The listening socket a parent passed as `--http-fd N`."""
    try:
        sock = socket.socket(fileno=int(fd))
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a number"
        raise argparse.ArgumentTypeError(f"--http-fd {fd} is not an open socket: {why}") from None
    sock.set_inheritable(False)  # the harnesses and evaluators a node starts get no copy
    return sock
