"""The inside of a harness sandbox: a program the node runs with `python -I -S` by its file path, so it
imports nothing but the standard library (the docker runtime runs it with the image's python3).

    unshare --user --map-root-user --mount [--net] -- python -I -S sandbox.py leader SPEC -- ARGV...
    python3 sandbox.py forward HOST PORT SOCKET          (a docker runtime's first process)

What `leader` and `forward` do, step by step: docs/design/sandbox.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 0x2, 0x4, 0x1000, 0x4000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
RELAY_CHUNK = 65536
# The exit code of a sandbox that could not be set up (the command never ran): that of `env` and
# `nice` when they cannot run theirs.
SETUP_FAILED = 125


class SetupError(Exception):
    """The sandbox could not be made; the message says which step failed."""


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    arguments = [None if value is None else value.encode() for value in (source, target, fstype)]
    if libc.mount(*arguments, ctypes.c_ulong(flags), None if data is None else data.encode()) != 0:
        code = ctypes.get_errno()
        raise SetupError(f"cannot mount over {target}: {os.strerror(code)}")


def hide(paths: list[list[str]], keep: str, mount_at: str) -> None:
    """Cover each [path, mode] (a folder: an empty tmpfs of that mode; a file: /dev/null), then bind
    `keep` at `mount_at`, a path on one of the covering tmpfs (made here), the same for every
    session: the session folder's own path, which differs from session to session, no longer exists."""
    keep_fd = os.open(keep, os.O_PATH | os.O_DIRECTORY)
    try:
        covers = []
        for path, mode in paths:
            if os.path.isdir(path):
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}")
                covers.append(path.rstrip("/") + "/")
            elif os.path.exists(path):
                mount("/dev/null", path, None, MS_BIND, None)
        if not any(mount_at.startswith(cover) for cover in covers):
            raise SetupError(f"{mount_at} is not on a hidden folder's tmpfs")
        os.makedirs(mount_at, exist_ok=True)
        mount(f"/proc/self/fd/{keep_fd}", mount_at, None, MS_BIND | MS_REC, None)
    finally:
        os.close(keep_fd)


def loopback_up() -> None:
    # struct ifreq: the interface's name, then a union whose first member here is the flags.
    layout = "16sH22x"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            flags = struct.unpack(layout, fcntl.ioctl(probe, SIOCGIFFLAGS, struct.pack(layout, b"lo", 0)))[1]
            fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack(layout, b"lo", flags | IFF_UP))
        except OSError as exc:
            raise SetupError(f"cannot bring up the loopback device: {exc.strerror}") from None


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise SetupError(f"cannot listen on {host} port {port}: {exc.strerror}") from None
    listener.listen(64)
    return listener


def serve_forwarding(listener: socket.socket, socket_path: str) -> None:
    """Relay every connection to `listener` to the Unix socket `socket_path` (relative paths: to
    this process's working folder, which lifts the length limit of a socket's address)."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            continue
        threading.Thread(target=_forward_one, args=(client, socket_path), daemon=True).start()


def _forward_one(client: socket.socket, socket_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError:
        client.close()
        upstream.close()
        return
    relay(client, upstream)


def relay(one: socket.socket, other: socket.socket) -> None:
    """Copy bytes both ways, each chunk as soon as it arrives (a stream of events stays a stream),
    passing on each side's end of writing; close both once both directions are done."""
    back = threading.Thread(target=_pump, args=(other, one), daemon=True)
    back.start()
    _pump(one, other)
    back.join()
    one.close()
    other.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(RELAY_CHUNK):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        # A reset on either side ends both directions.
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _ignore(signum, frame) -> None:
    """A handler that does nothing: unlike SIG_IGN, exec resets it, so children get the default."""


def end_like(code: int) -> None:
    """Exit as a process whose exit code (os.waitstatus_to_exitcode) was `code`: killed by the same
    signal when it is negative."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def leader(spec: dict, argv: list[str]) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # The group's SIGTERM is for the command; this process waits to end as the command does.
        signal.signal(signum, _ignore)
    keep, mount_at = spec["keep"], spec["mount_at"]
    # The command's working folder, as the command sees it: at the same place under mount_at.
    cwd = os.getcwd()
    workspace = mount_at + cwd[len(keep) :] if cwd == keep or cwd.startswith(keep + "/") else mount_at
    hide(spec["hide"], keep, mount_at)
    # Working folders resolved again through the new mounts: one kept from before would reach the
    # hidden folders through "..".
    os.chdir(mount_at)
    if spec["network"]:
        loopback_up()
    if spec.get("forward"):
        host, port, socket_path = spec["forward"]
        listener = listen(host, port)
        threading.Thread(target=serve_forwarding, args=(listener, socket_path), daemon=True).start()
    status_read, status_write = os.pipe()
    init = [
        sys.executable,
        "-I",
        "-S",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py"),
        str(status_write),
        str(spec["uid"]),
        str(spec["gid"]),
    ]
    pid_namespace = [
        *spec["dying_with_parent"],
        spec["unshare"],
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child=KILL",
    ]
    child = subprocess.Popen(
        [*pid_namespace, "--", *init, spec["unshare"], "--", *argv], cwd=workspace, pass_fds=[status_write]
    )
    os.close(status_write)
    child.wait()
    with os.fdopen(status_read, "rb") as status:
        reported = status.read().strip()
    end_like(int(reported) if reported else child.returncode)


# Created in the forwarder's working directory (the session folder) once it listens: the node starts
# no command in the container before, or a harness's first call could find nothing listening.
LISTENING_MARKER = "forwarder.listening"


def forward(host: str, port: int, socket_path: str) -> None:
    """A container's first process: forward host:port to socket_path, and reap orphans."""
    listener = listen(host, port)
    with open(LISTENING_MARKER, "w"):
        pass
    threading.Thread(target=serve_forwarding, args=(listener, socket_path), daemon=True).start()
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(1.0)  # no child now; a command started later becomes one when it leaves orphans


def main(arguments: list[str]) -> None:
    try:
        if arguments[0] == "leader":
            leader(json.loads(arguments[1]), arguments[3:])
        elif arguments[0] == "forward":
            forward(arguments[1], int(arguments[2]), arguments[3])
        else:
            raise SetupError(f"unknown mode {arguments[0]!r}")
    except SetupError as exc:
        print(f"polar sandbox: {exc}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
