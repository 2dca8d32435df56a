"""PID 1 of a sandboxed command's PID namespace (sandbox.py's `leader` starts it, with `python -I -S`
by its file path). A file of its own so that its start imports only os, signal and sys: it runs once
per command, and sandbox.py's imports (ctypes, json, socket, subprocess) took most of its time.

    python -I -S sandbox_init.py STATUS_FD UID GID UNSHARE -- ARGV...
"""

import os
import signal
import sys

# sandbox.py's SETUP_FAILED (the command never ran); this file imports nothing of it, to stay small.
SETUP_FAILED = 125


def _ignore(signum, frame) -> None:
    """A handler that does nothing: unlike SIG_IGN, exec resets it, so children get the default."""


def init(status_fd: int, uid: str, gid: str, unshare: str, argv: list[str]) -> None:
    """Run argv as uid:gid, reap every orphan, report argv's end on status_fd."""
    os.set_inheritable(status_fd, False)
    signal.signal(signal.SIGINT, _ignore)
    command = [unshare, "--user", f"--map-user={uid}", f"--map-group={gid}", "--", *argv]
    try:
        pid = os.posix_spawn(unshare, command, os.environ)
    except OSError as exc:
        print(f"polar sandbox: cannot start {unshare}: {exc.strerror}", file=sys.stderr)
        os._exit(SETUP_FAILED)
    while True:
        try:
            ended, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if ended == pid:
            break
    os.write(status_fd, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    status_fd, uid, gid, unshare = sys.argv[1:5]
    init(int(status_fd), uid, gid, unshare, sys.argv[6:])
