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
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from pretrain.cli import compose_config
from pretrain.data.prepare import needs_preparation
from pretrain.paths import REPO


def world_size(overrides: list[str], nproc: int | None) -> int:
    par = compose_config(overrides).parallel
    if par.dp is None:
        if nproc is None:
            raise SystemExit(
                "run_local: parallel.dp is null (data parallel over the whole world), so the "
                "process count is yours to choose: pass --nproc N (a multiple of "
                f"tp*pp = {par.tp * par.pp}) or set parallel.dp"
            )
        return nproc
    need = par.tp * par.pp * par.dp
    if nproc is not None and nproc != need:
        raise SystemExit(f"run_local: --nproc {nproc} but the layout tp={par.tp} x pp={par.pp} "
                         f"x dp={par.dp} needs {need} processes")
    return need


def command(overrides: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(REPO / "train.py"), *overrides]


def prepare_command(overrides: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "tools" / "prepare_data.py"), *overrides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes, when the recipe leaves parallel.dp null")
    parser.add_argument("--print", action="store_true", help="print the command, run nothing")
    args, overrides = parser.parse_known_args(argv)
    cmd = command(overrides, world_size(overrides, args.nproc))
    if args.print:
        print(shlex.join(cmd))
        return 0
    # A run stopped early to be requeued (signal, time limit, train.exit_interval) exits 75
    # on one process; torchrun cannot pass that through, so the trainer leaves stopped.json
    # in the run directory and this launcher returns 75 for it.
    cfg = compose_config(overrides)
    if needs_preparation(cfg.data):
        # A multi-process run never tokenises (train.py refuses): prepare first, as its own
        # job, with the same overrides and data.num_proc worker processes.
        print(f"run_local: preparing data.name={cfg.data.name} first: "
              f"{shlex.join(prepare_command(overrides))}", file=sys.stderr, flush=True)
        code = subprocess.run(prepare_command(overrides)).returncode
        if code:
            return code
    stopped = Path(cfg.runs_dir) / cfg.run_name / "stopped.json"
    code = subprocess.run(cmd).returncode
    if code == 0 and stopped.exists():
        code = json.loads(stopped.read_text()).get("exit_code", 75)
    return code


if __name__ == "__main__":
    sys.exit(main())
