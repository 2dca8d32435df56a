"""The megatron backend's torchrun entry point: rank 0 is `polar serve trainer`, the other ranks
follow it.

    torchrun --nnodes N --node-rank R --nproc-per-node G --master-addr A --master-port P \\
        -m trainer.backends.megatron.launch --rollout HOST:PORT --inference HOST:PORT [...]

takes the flags of `polar serve trainer` (scripts/launch_megatron.sh builds the torchrun line) and
sets --backend megatron. Rank 0 serves exactly as `polar serve trainer` does: it alone talks to the
rollout server and the inference servers, and every backend call it makes is run in lockstep by the
other ranks. They ignore SIGINT and SIGTERM (torchrun passes them to every rank): rank 0 stops
between micro-batches, writes its checkpoint with their help, then releases them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from polar.service_table import TRAINER


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.backends.megatron.launch", description=__doc__.split("\n\n")[0]
    )
    TRAINER.add_arguments(parser)
    args = parser.parse_args(argv)
    args.backend = "megatron"

    if int(os.environ.get("RANK", "0")) == 0:
        from trainer.backends.megatron import leave_job, release_followers

        args.ready_fd = _inherited_through_torchrun(args.ready_fd)

        try:
            return TRAINER.run(args)
        finally:
            release_followers()
            leave_job()

    from trainer.backends.megatron import MegatronBackend, options_from_config

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    (config,) = TRAINER.configs(args)
    # The model is rank 0's choice (the run's latest checkpoint, or config.model): it is broadcast.
    MegatronBackend(options_from_config(config, config.model)).follow()
    return 0


def _inherited_through_torchrun(ready_fd: int | None) -> int | None:
    """`polar train` hands its trainer a readiness pipe (--ready-fd), but torchrun starts each rank
    with its standard streams only: rank 0 opens the pipe again through its parent, the torchrun
    agent, which inherited it."""
    if ready_fd is None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return ready_fd
    return os.open(f"/proc/{os.getppid()}/fd/{ready_fd}", os.O_WRONLY)


if __name__ == "__main__":
    sys.exit(main())
