"""Child processes that die with their parent, started without running Python between fork and exec.

Our processes serve gRPC, whose threads and fork handlers make `fork()` followed by Python code in
the child (subprocess's `preexec_fn`) unsafe: the child can crash in gRPC's handlers before it ever
runs the command (seen as a harness or Envoy dying with SIGSEGV or SIGABRT at start, under load).
So instead of calling prctl(PR_SET_PDEATHSIG) in the child, the command is prefixed with util-linux
`setpriv --pdeathsig`, which asks the kernel for the signal and then execs the command. Without a
`preexec_fn`, Python spawns with vfork/posix_spawn and nothing runs in the child before exec.

The signal is tied to the thread that spawned the child (the event loop's, or the main thread), as
PR_SET_PDEATHSIG always is. Where `setpriv` is missing the command runs as given: it then outlives a
SIGKILLed parent, which only matters after a crash.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

SETPRIV = shutil.which("setpriv")


def dying_with_parent(argv: Sequence[str], signal_name: str = "TERM") -> list[str]:
    """argv, prefixed so that the kernel sends SIG`signal_name` to the command when its parent dies."""
    if SETPRIV is None:
        return list(argv)
    return [SETPRIV, "--pdeathsig", signal_name, "--", *argv]
