"""The megatron backend's torchrun entry point: rank 0 is the trainer, the other ranks follow it.

    torchrun --nnodes N --node-rank R --nproc-per-node G --master-addr A --master-port P \\
        -m trainer.backends.megatron.launch --config polar.toml --run-dir runs/r1 \\
        --rollout HOST:PORT --inference HOST:PORT[,HOST:PORT...]

(scripts/launch_megatron.sh builds that line.) Rank 0 runs the trainer service exactly as `polar
serve trainer` does, with [trainer] backend = "megatron": it alone talks to the rollout server and
the inference servers, and every backend call it makes is run in lockstep by the other ranks. They
ignore SIGINT and SIGTERM (torchrun passes them to every rank): rank 0 stops between micro-batches,
writes its checkpoint with their help, then releases them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path

from polar.config import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.backends.megatron.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="Polar's TOML config; its [trainer] section is used")
    parser.add_argument("--run-dir", type=Path, required=True, help="the run folder (checkpoints, metrics)")
    parser.add_argument("--rollout", required=True, help="HOST:PORT of the rollout server")
    parser.add_argument("--inference", required=True, help="HOST:PORT of each inference server, comma-separated")
    args = parser.parse_args(argv)
    config = dataclasses.replace(load_config(args.config).trainer, backend="megatron")

    if int(os.environ.get("RANK", "0")) == 0:
        from polar.grpc_server import run_service
        from trainer.backends.megatron import release_followers
        from trainer.service import serve_trainer

        try:
            run_service(serve_trainer(config, args.run_dir, args.rollout, args.inference.split(",")))
        finally:
            release_followers()
        return 0

    from trainer.backends.megatron import MegatronBackend, options_from_config

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    # The model is rank 0's choice (the run's latest checkpoint, or config.model): it is broadcast.
    MegatronBackend(options_from_config(config, config.model)).follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
