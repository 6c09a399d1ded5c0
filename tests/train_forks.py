"""``python train.py ARGS`` for tests whose subject is what train.py does with its arguments
(the error it prints, its exit status, the run directory it writes, the run it trains),
each call in a fresh fork of one process per pytest worker that imported torch, Hydra and
the trainer once (tests/fork_server.py): a train.py start imports them again, about 3 s
of CPU a call (issue 69). The child runs train.py itself as ``__main__`` (its top-level
checks, Hydra, the trainer, ``sys.exit``), in the test's folder and environment, with its
own stdout, stderr and exit status. A real interpreter start of train.py is kept where the
process is the subject: tests/test_mixture.py's killed run, tests/test_reliability.py's
recipe path refused before Hydra, tests/test_cli_errors.py's runs_dir refused by the
Hydra callback, and the torchrun launches of tests/test_parallel_launch.py."""

from __future__ import annotations

import atexit
import subprocess
from pathlib import Path

from fork_server import ForkServer
from helpers import REPO, launch_env

TRAIN = str(REPO / "train.py")
# what train.py imports at its top and on its way to a run or a dry run
PRELOAD = ("hydra", "omegaconf", "hydra.core.hydra_config", "pretrain.launch.lifeline",
           "pretrain.config.naming", "pretrain.config.structured", "pretrain.errors",
           "pretrain.train.fault_tolerant", "pretrain.decision.resolve")
SERVER = ForkServer(TRAIN, preload=PRELOAD)
atexit.register(SERVER.close)  # waited for: its CPU counts in the pytest run's own


def train_py(*args: str, cwd: Path | str, timeout: float = 300,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """As ``subprocess.run([python, train.py, *args], cwd=cwd, capture_output=True,
    text=True, env=launch_env(**env))`` gives it."""
    code, out, err = SERVER.run(list(args), timeout=timeout, cwd=cwd,
                                env=launch_env(**(env or {})))
    return subprocess.CompletedProcess([TRAIN, *args], code, out, err)
