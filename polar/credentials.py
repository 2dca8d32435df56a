"""The stack's credentials: one secret token per role (node, inference, trainer, operator), which
every gRPC call carries and every Polar gRPC server checks (polar.grpc_server's interceptor), and the
credentials issued to other machines by name (`polar credentials`), kept hashed.

Where the tokens live and who gets them: docs/design/credentials.md; the roles and the sandbox that
keeps them from harnesses: docs/credentials.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

NODE = "node"
TRAINER = "trainer"
OPERATOR = "operator"
INFERENCE = "inference"
SHARED_ROLES = (NODE, TRAINER, OPERATOR)  # the stack's own tokens, one file each (`ensure`)
ISSUED_ROLES = (NODE, INFERENCE)  # what `polar credentials issue` gives other machines
ROLES = (NODE, TRAINER, OPERATOR, INFERENCE)
ISSUED_FILE = "issued.json"  # in the credentials folder, unless [rollout] issued_credentials says where
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

ENV_VAR = "POLAR_CREDENTIALS"  # the credentials folder, set by `polar up` for its children
STATE_ENV_VAR = "POLAR_STATE_DIR"
HEADER = "authorization"  # gRPC metadata key; the value is "Bearer <token>"
TOKEN_BYTES = 32


class CredentialsError(OSError):
    """The credentials folder or a token file is missing, unreadable or malformed; the message says which."""


@dataclass(frozen=True)
class Caller:
    """Who made a call: its role, and the name of its issued credential ("" for the stack's own
    tokens, which every machine of the stack that holds them shares)."""

    role: str
    name: str = ""


@dataclass(frozen=True)
class IssuedCredential:
    """A credential issued by name, as the rollout server keeps it: never the token itself."""

    name: str
    role: str  # one of ISSUED_ROLES (or a shared role, when a control plane tells its inference servers)
    sha256: str  # hex digest of the token
    issued_at: float = 0.0  # Unix time


class IssuedError(ValueError):
    """A credential that cannot be issued or revoked (bad name or role, name taken or unknown)."""


class Issued:
    """Credentials issued by name, by the SHA-256 of their token: read from a file (the rollout
    server's, `watch`), read again whenever the file changes, or told by a control plane (`learn`)."""

    def __init__(self) -> None:
        self._by_hash: dict[str, IssuedCredential] = {}
        self._path: Path | None = None
        self._stamp: tuple[int, int, int] | None = None

    def watch(self, path: Path) -> None:
        self._path = Path(path)
        self.refresh()

    def learn(self, entries: list[IssuedCredential]) -> None:
        self._by_hash = {entry.sha256: entry for entry in entries}

    def refresh(self) -> bool:
        """Read the watched file again if it changed since (a missing file: none issued); whether
        what is issued changed."""
        if self._path is None:
            return False
        try:
            info = self._path.stat()
            stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        before = set(self._by_hash)
        self._by_hash = {entry.sha256: entry for entry in read_issued(self._path)} if stamp else {}
        return set(self._by_hash) != before

    def find(self, token: str) -> IssuedCredential | None:
        self.refresh()
        return self._by_hash.get(_digest(token))

    def entries(self) -> list[IssuedCredential]:
        self.refresh()
        return list(self._by_hash.values())

    def names(self) -> set[str]:
        return {entry.name for entry in self.entries()}


@dataclass(frozen=True)
class Credentials:
    """The roles' tokens read from `folder` (a machine other than the stack's own holds only its
    issued one), and the credentials issued by name that a server also admits."""

    folder: Path
    tokens: dict[str, str]  # role -> token (hex)
    issued: Issued = field(default_factory=Issued, compare=False)

    def caller_of(self, authorization: str | None) -> Caller | None:
        """Who an `authorization` metadata value ("Bearer <token>") is: one of the folder's role
        tokens (name ""), an issued credential, else None."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        presented = authorization[len("Bearer ") :].strip()
        found = None
        for role, token in self.tokens.items():
            # Every token compared, in constant time: the answer's timing says nothing about them.
            if hmac.compare_digest(presented.encode(), token.encode()):
                found = Caller(role)
        if found is None and (entry := self.issued.find(presented)) is not None:
            found = Caller(entry.role, entry.name)
        return found

    def role_of(self, authorization: str | None) -> str | None:
        """The role whose token an `authorization` metadata value carries ("Bearer <token>"), else None."""
        caller = self.caller_of(authorization)
        return caller.role if caller is not None else None

    def accepted(self) -> list[IssuedCredential]:
        """Every credential this server admits, as hashes: what a control plane tells its inference
        servers (theirs are left out: nothing calls an inference server as one)."""
        own = [IssuedCredential("", role, _digest(token)) for role, token in self.tokens.items() if role != INFERENCE]
        return own + [entry for entry in self.issued.entries() if entry.role != INFERENCE]

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
    for role in SHARED_ROLES:
        path = folder / role
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # kept: a stack restarted, or one beside it, uses the same tokens
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(TOKEN_BYTES) + "\n")
    return load(folder)


def load(folder: Path | str) -> Credentials:
    """The role tokens in `folder` (every role whose file is there: the stack's own folder holds
    node, trainer and operator, another machine's its issued one); CredentialsError naming what is
    wrong, or that there is none."""
    folder = Path(folder)
    tokens = {}
    for role in ROLES:
        path = folder / role
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CredentialsError(f"cannot read the {role} credential {path}: {exc.strerror}") from None
        if not _is_token(token):
            raise CredentialsError(f"{path} does not hold a credential ({2 * TOKEN_BYTES} hex characters)")
        tokens[role] = token
    if not tokens:
        raise CredentialsError(f"{folder} holds no credential (files named {', '.join(ROLES)})")
    return Credentials(folder, tokens)


_OF_PROCESS: dict[str, Credentials] = {}


def of_process() -> Credentials | None:
    """The credentials a served process was handed ($POLAR_CREDENTIALS), else None (none: open).
    One object per folder in a process: what its servers admit (`issued`) is what its control-plane
    link learned or its rollout server watches."""
    folder = os.environ.get(ENV_VAR)
    if not folder:
        return None
    if folder not in _OF_PROCESS:
        _OF_PROCESS[folder] = load(folder)
    return _OF_PROCESS[folder]


def for_machine(role: str, folder: Path | None = None) -> Credentials:
    """The credential a machine of `role` ("node" or "inference") joins another's stack with: its
    folder (default: the state folder's) must hold that role's token (an inference server may use a
    node one); CredentialsError saying how to get one."""
    folder = Path(folder) if folder is not None else default_folder()
    wanted = (INFERENCE, NODE) if role == INFERENCE else (NODE,)
    try:
        found = load(folder)
    except CredentialsError:
        found = None
    if found is None or not any(r in found.tokens for r in wanted):
        raise CredentialsError(
            f"this machine has no {role} credential in {folder}: on the rollout server's machine run"
            f" `polar credentials issue NAME {role} --out DIR` and copy DIR here as {folder}"
            f" (or point ${ENV_VAR} at it)"
        )
    return found


def call_role(found: Credentials | None, preferred: str) -> str:
    """The role a client calls as: `preferred` where the folder holds it, else node (a machine's
    inference server joining with a node credential, as the stack's own does)."""
    if found is None or preferred in found.tokens:
        return preferred
    return NODE


# --------------------------------------------------------------------------- issued by name


def issued_path(folder: Path | None = None, configured: str = "") -> Path:
    """The file of credentials issued by name: `configured` ([rollout] issued_credentials), else
    issued.json in the credentials folder."""
    if configured:
        return Path(configured)
    return (Path(folder) if folder is not None else default_folder()) / ISSUED_FILE


def read_issued(path: Path) -> list[IssuedCredential]:
    """The credentials in an issued file (none when it does not exist); CredentialsError when it
    cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
        return [
            IssuedCredential(e["name"], e["role"], e["sha256"], float(e.get("issued_at", 0)))
            for e in data["credentials"]
        ]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"cannot read the issued credentials {path}: {exc}") from None


def issue(path: Path, name: str, role: str) -> str:
    """Issue a new credential NAME of ROLE: its hash is added to `path` (made with mode 0600), its
    token returned (shown once, kept nowhere else). IssuedError for a bad or taken name or a role
    that is not issued."""
    if not NAME_PATTERN.fullmatch(name):
        raise IssuedError(
            f"name {name!r}: letters, digits, '.', '_' and '-', at most 64, starting with a letter or digit"
        )
    if role not in ISSUED_ROLES:
        raise IssuedError(f"role {role!r}: issued credentials are {' or '.join(ISSUED_ROLES)}")
    token = secrets.token_hex(TOKEN_BYTES)
    with _locked(path) as entries:
        if any(entry.name == name for entry in entries):
            raise IssuedError(
                f"a credential named {name!r} is issued already: revoke it first (`polar credentials revoke {name}`)"
            )
        entries.append(IssuedCredential(name, role, _digest(token), time.time()))
    return token


def revoke(path: Path, name: str) -> None:
    """Remove credential NAME from `path`; IssuedError when none has that name."""
    with _locked(path) as entries:
        kept = [entry for entry in entries if entry.name != name]
        if len(kept) == len(entries):
            raise IssuedError(f"no credential named {name!r} is issued (in {path})")
        entries[:] = kept


def write_token(folder: Path, role: str, token: str) -> Path:
    """A credentials folder for another machine: `folder/role` (folder 0700, file 0600)."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / role
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[list[IssuedCredential]]:
    """The entries of `path`, under an exclusive lock, written back (atomically, mode 0600) after."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = read_issued(path)
        yield entries
        scratch = path.with_name(path.name + ".new")
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"credentials": [vars(entry) for entry in entries]}, out, indent=1)
        os.replace(scratch, path)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _is_token(token: str) -> bool:
    return len(token) == 2 * TOKEN_BYTES and all(c in "0123456789abcdef" for c in token)


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


def aio_channel(address: str, tls_ca: str = "", options=()) -> grpc.aio.Channel:
    """An asyncio channel to another Polar server: over TLS (grpc's own) when `tls_ca` names the
    PEM CA certificate its certificate must chain to, else plaintext (this machine's own services).
    CredentialsError when the CA file cannot be read."""
    if not tls_ca:
        return grpc.aio.insecure_channel(address, options=list(options))
    try:
        root = Path(tls_ca).read_bytes()
    except OSError as exc:
        raise CredentialsError(f"cannot read the TLS CA certificate {tls_ca}: {exc.strerror}") from None
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root), options=list(options))


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
