"""The stack's credentials: one secret token per role, which every gRPC call carries and every Polar
gRPC server checks (polar.grpc_server's interceptor).

    node       a gateway node: RegisterNode, Heartbeat, ReportSession; Generate on inference
    trainer    the trainer: tasks and results on the rollout server; Pause, UpdateWeights, Resume
    operator   the person at the `polar` command line: everything

Where they live: `polar up` (and `polar train`) keep them in the state folder's `credentials/`
folder (mode 0700), one file per role named after it holding 64 hex characters (mode 0600). The
state folder is $POLAR_STATE_DIR, else $XDG_STATE_HOME/polar, else ~/.local/state/polar. A stack
reuses the tokens it finds there and creates the missing ones, so a restarted stack and the
commands run against it agree.

Who gets them: `polar up` hands the folder to its children as $POLAR_CREDENTIALS; a served process
sends its role's token (`metadata(role)`) and its server accepts any of the three, each for the rpcs
its role may call. The `polar` commands read $POLAR_CREDENTIALS, else the state folder's
`credentials/`, and call as the operator. Harnesses never get the variable: their environment is
built from an allow-list (polar.rollout.harness), and evaluators and prepare steps run without it.
A harness of the local runtime still runs as the same user; the node's `harness_isolation`
(polar.rollout.isolation) hides the files from it in a mount namespace, and where that cannot be
made, `polar up` says at start that harnesses can read them.

A server started without credentials (no $POLAR_CREDENTIALS: `polar serve NAME` alone, the servers
tests start in their own process) accepts every caller, and says so when it starts.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

NODE = "node"
TRAINER = "trainer"
OPERATOR = "operator"
ROLES = (NODE, TRAINER, OPERATOR)

ENV_VAR = "POLAR_CREDENTIALS"  # the credentials folder, set by `polar up` for its children
STATE_ENV_VAR = "POLAR_STATE_DIR"
HEADER = "authorization"  # gRPC metadata key; the value is "Bearer <token>"
TOKEN_BYTES = 32


class CredentialsError(OSError):
    """The credentials folder or a token file is missing, unreadable or malformed; the message says which."""


@dataclass(frozen=True)
class Credentials:
    """Every role's token, read from `folder`."""

    folder: Path
    tokens: dict[str, str]  # role -> token (hex)

    def role_of(self, authorization: str | None) -> str | None:
        """The role whose token an `authorization` metadata value carries ("Bearer <token>"), else None."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        presented = authorization[len("Bearer ") :].strip().encode()
        found = None
        for role, token in self.tokens.items():
            # Every token compared, in constant time: the answer's timing says nothing about them.
            if hmac.compare_digest(presented, token.encode()):
                found = role
        return found

    def metadata(self, role: str) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata of a call made as `role`."""
        return ((HEADER, f"Bearer {self.tokens[role]}"),)


def state_dir() -> Path:
    """Where `polar up` keeps the stack's state (see the module docstring)."""
    if os.environ.get(STATE_ENV_VAR):
        return Path(os.environ[STATE_ENV_VAR])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "polar"


def default_folder() -> Path:
    return state_dir() / "credentials"


def ensure(folder: Path | None = None) -> Credentials:
    """The tokens in `folder` (default: the state folder's), each role's created when missing:
    the folder with mode 0700, every file 0600."""
    folder = Path(folder) if folder is not None else default_folder()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for role in ROLES:
        path = folder / role
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # kept: a stack restarted, or one beside it, uses the same tokens
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(TOKEN_BYTES) + "\n")
    return load(folder)


def load(folder: Path | str) -> Credentials:
    """Every role's token from `folder`; CredentialsError naming what is wrong."""
    folder = Path(folder)
    tokens = {}
    for role in ROLES:
        path = folder / role
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise CredentialsError(f"cannot read the {role} credential {path}: {exc.strerror}") from None
        if len(token) != 2 * TOKEN_BYTES or any(c not in "0123456789abcdef" for c in token):
            raise CredentialsError(f"{path} does not hold a credential ({2 * TOKEN_BYTES} hex characters)")
        tokens[role] = token
    return Credentials(folder, tokens)


def of_process() -> Credentials | None:
    """The credentials a served process was handed ($POLAR_CREDENTIALS), else None (none: open)."""
    folder = os.environ.get(ENV_VAR)
    return load(folder) if folder else None


def for_commands() -> Credentials | None:
    """The credentials the `polar` commands call with: $POLAR_CREDENTIALS, else the state folder's
    when `polar up` wrote them, else None (the call goes without, and a stack refuses it)."""
    if os.environ.get(ENV_VAR):
        return load(os.environ[ENV_VAR])
    folder = default_folder()
    return load(folder) if (folder / OPERATOR).exists() else None


def without(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` less the credentials variable: for every command a node runs in a runtime."""
    return {name: value for name, value in environment.items() if name != ENV_VAR}


def metadata(role: str, credentials: Credentials | None) -> tuple[tuple[str, str], ...]:
    """The metadata of a call made as `role` with these credentials (none: empty)."""
    return credentials.metadata(role) if credentials is not None else ()


def channel(address: str, role: str, credentials: Credentials | None, options=()) -> grpc.Channel:
    """A blocking channel whose every call carries `role`'s token (none: a plain channel)."""
    plain = grpc.insecure_channel(address, options=list(options))
    if credentials is None:
        return plain
    return grpc.intercept_channel(plain, _WithMetadata(credentials.metadata(role)))


class _WithMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata to every call of a blocking channel."""

    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            tuple(details.metadata or ()) + self._extra,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def _call(self, continuation: Callable, details, request):
        return continuation(self._details(details), request)

    intercept_unary_unary = _call
    intercept_unary_stream = _call
    intercept_stream_unary = _call
    intercept_stream_stream = _call


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


@contextlib.contextmanager
def handed_to_children(issued: Credentials | None) -> Iterator[None]:
    """$POLAR_CREDENTIALS set to `issued`'s folder as `polar up` hands it to the services it starts
    (unset for None: they serve every caller), for processes started inside; restored on exit."""
    saved = os.environ.pop(ENV_VAR, None)
    if issued is not None:
        os.environ[ENV_VAR] = str(issued.folder)
    try:
        yield
    finally:
        os.environ.pop(ENV_VAR, None)
        if saved is not None:
            os.environ[ENV_VAR] = saved
