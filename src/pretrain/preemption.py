"""Stop requests: SIGTERM / SIGUSR1 (what SLURM sends before preemption or the time limit)
and the run's own time limit, agreed on by every rank.

A signal handler only sets a flag; the training loop checks it between steps, every
``train.stop_check_interval`` steps (``check`` is a collective: every rank calls it after the
same steps), so every rank finishes the same step, saves, and the process exits with
``EXIT_REQUEUE`` (75, EX_TEMPFAIL from sysexits.h: "temporary failure, retry"), which
slurm/train.sbatch turns into a requeue.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger("pretrain")

EXIT_REQUEUE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self, time_limit_minutes: float | None = None):
        self.reason: str | None = None
        self.start = time.monotonic()
        self.time_limit_s = 60 * time_limit_minutes if time_limit_minutes else None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name
        log.warning("received %s: finishing this step, then saving and exiting", self.reason)

    def check(self, device: torch.device) -> str | None:
        """The reason to stop now, the same on every rank: one tiny all-reduce and a host
        sync, so the trainer calls it every ``train.stop_check_interval`` steps, on every
        rank after the same steps. A rank that got no signal itself reports ``signal``."""
        local = self.reason
        if local is None and self.time_limit_s and time.monotonic() - self.start > self.time_limit_s:
            local = "time_limit"
        flag = torch.tensor([0 if local is None else 1 if local != "time_limit" else 2],
                            device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
        if code == 0:
            return None
        return local or ("signal" if code == 1 else "time_limit")

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
