"""Run a recipe on this machine with as many processes as its parallel layout needs.

    python tools/run_local.py +recipe=nano-3d                 # 8 processes (tp2 x pp2 x dp2)
    python tools/run_local.py +recipe=tiny parallel=zero3     # any recipe, any preset
    python tools/run_local.py --nproc 4 +recipe=tiny parallel=zero3 parallel.dp=null
    python tools/run_local.py --print +recipe=nano-3d         # show the command, run nothing

The layout is composed exactly as train.py composes it; the world size is tp * pp * dp
(``--nproc`` when the recipe leaves dp to the world size). It then runs
``torchrun --standalone --nproc_per_node=N train.py <overrides>``: one node, a local
rendezvous, gloo on CPU or NCCL on GPUs. Multi-node runs go through slurm/ instead.
Data not yet prepared is prepared first (``tools/prepare_data.py`` with the same
overrides): the training processes never tokenise.

Stopping it stops the run: SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 are passed on (every rank
saves a checkpoint and the launcher exits 75); killed outright (``kill -9``), it takes
torchrun and every rank with it within moments, and the newest checkpoint is where the run
resumes (pretrain/launch/lifeline.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pretrain.config.compose import compose_config
from pretrain.config.schema import ConfigError
from pretrain.data.mixture_prepare import needs_mixture_preparation
from pretrain.data.prepare import needs_preparation
from pretrain.decision.checks import check
from pretrain.errors import cli, report
from pretrain.launch import LaunchError
from pretrain.launch.local import (
    command,
    exit_status,
    prepare_command,
    run_forwarding_signals,
    run_tied,
    world_size,
)


@cli
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes, when the recipe leaves parallel.dp null")
    parser.add_argument("--print", action="store_true", help="print the command, run nothing")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose_config(overrides)
    try:
        nproc = world_size(cfg.parallel, args.nproc)
        # The whole config, with the world size about to be launched, before any process
        # starts: every problem in one message, not each rank's traceback after torchrun.
        if cfg.parallel.name != "auto":  # auto picks a layout that fits, in each rank
            check(cfg, nproc)
        cmd = command(overrides, nproc)
    except (LaunchError, ConfigError) as e:
        return report(e)
    if args.print:
        print(shlex.join(cmd))
        return 0
    if needs_preparation(cfg.data) or needs_mixture_preparation(cfg.data):
        # A multi-process run never tokenises (train.py refuses): prepare first, as its own
        # job, with the same overrides and data.num_proc worker processes.
        print(f"run_local: preparing data.name={cfg.data.name} first: "
              f"{shlex.join(prepare_command(overrides))}", file=sys.stderr, flush=True)
        code = run_tied(prepare_command(overrides))
        if code:
            return code
    # a run stopped early to be requeued (signal, time limit, train.exit_interval): 75
    return exit_status(Path(cfg.runs_dir) / cfg.run_name, run_forwarding_signals(cmd))


if __name__ == "__main__":
    sys.exit(main())
