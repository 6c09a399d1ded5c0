"""Running a recipe on this machine with as many processes as its layout needs:
``torchrun --standalone --nproc_per_node=N train.py <overrides>`` (one node, a local
rendezvous, gloo on CPU or NCCL on GPUs), data prepared first as its own job, and the
requeue status of a run that stopped early (``tools/run_local.py`` is the command line).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.config.schema import ParallelConfig
from pretrain.launch import LaunchError
from pretrain.launch.lifeline import LAUNCHER_PID, preexec
from pretrain.parallel.layout import layout_world_size, model_parallel_size
from pretrain.parallel.rules import world_problems
from pretrain.train.preemption import EXIT_REQUEUE, STOPPED


def world_size(par: ParallelConfig, nproc: int | None) -> int:
    """The processes to start: the layout's own (``layout_world_size``), or ``nproc`` when
    the layout leaves dp to the world size; LaunchError when they disagree."""
    if par.dp is None and nproc is None:
        raise LaunchError(
            "parallel.dp is null (data parallel over the whole world), so the process count "
            f"is yours to choose: pass --nproc N (a multiple of tp*pp = "
            f"{model_parallel_size(par)}) or set parallel.dp")
    n = nproc if nproc is not None else layout_world_size(par)
    _, problems = world_problems(par, n)
    if problems:
        raise LaunchError(f"--nproc {n}: {problems[0]}")
    return n


def command(overrides: list[str], nproc: int) -> list[str]:
    """torchrun (as pretrain.launch.torchrun: a failed rank's error in one line)."""
    return [sys.executable, "-m", "pretrain.launch.torchrun", "--standalone",
            f"--nproc_per_node={nproc}", str(REPO / "train.py"), *overrides]


def prepare_command(overrides: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "tools" / "prepare_data.py"), *overrides]


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def tied_env() -> dict[str, str]:
    """This environment plus this launcher's pid, which each rank checks its agent's
    parent against (lifeline.tie_rank_to_agent)."""
    return {**os.environ, LAUNCHER_PID: str(os.getpid())}


def run_tied(cmd: list[str]) -> int:
    """Run ``cmd`` to its end, killed if this launcher dies first (lifeline.preexec)."""
    return subprocess.run(cmd, preexec_fn=preexec()).returncode


def run_forwarding_signals(cmd: list[str]) -> int:
    """Run ``cmd`` and return its status, passing SIGTERM, SIGINT and SIGUSR1 on to it
    (torchrun passes them to its workers, whose trainer saves and exits 75), so that
    stopping this launcher stops the run instead of orphaning it. A launcher killed
    outright (SIGKILL) takes ``cmd`` with it, and torchrun's ranks with that (lifeline)."""
    child = subprocess.Popen(cmd, preexec_fn=preexec(), env=tied_env())

    def forward(signum, frame) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_status(run_dir: Path, returncode: int) -> int:
    """torchrun's status, or 75 (requeue) for a run whose ranks stopped early and exited 0:
    torchrun cannot pass a rank's 75 through, so the trainer leaves stopped.json in the run
    directory (preemption.requeue_exit)."""
    stopped = Path(run_dir) / STOPPED
    if returncode == 0 and stopped.exists():
        return json.loads(stopped.read_text()).get("exit_code", EXIT_REQUEUE)
    return returncode
