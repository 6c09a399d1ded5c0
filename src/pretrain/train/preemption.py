"""When a run stops, saves and asks to be requeued: stop requests (SIGTERM / SIGUSR1, what
SLURM sends before preemption or the time limit, and the run's own time limit), agreed on by
every rank, and the policy between steps (``StopSavePolicy``: stop checks, periodic saves,
``train.exit_interval``, stopped.json for the launcher).

A signal handler only sets a flag; the training loop checks it between steps, every
``train.stop_check_interval`` steps (``check`` is a collective: every rank calls it after the
same steps), so every rank finishes the same step, saves, and the process exits with
``EXIT_REQUEUE`` (75, EX_TEMPFAIL from sysexits.h: "temporary failure, retry"), which
slurm/train.sbatch turns into a requeue.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("pretrain")

EXIT_REQUEUE = 75
# Written by rank 0 when a run stops early to be requeued (signal, time limit, exit_interval).
STOPPED = "stopped.json"
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
        if (
            local is None
            and self.time_limit_s
            and time.monotonic() - self.start > self.time_limit_s
        ):
            local = "time_limit"
        flag = torch.tensor([0 if local is None else 1 if local != "time_limit" else 2],
                            device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
        if code == 0:
            return None
        return local or ("signal" if code == 1 else "time_limit")

    def at_start(self, device: torch.device, step: int) -> str | None:
        """A stop requested during start-up (a collective, like ``check``), said."""
        stopped = self.check(device)
        if stopped is not None:
            log.warning("stop requested during start-up (%s): nothing trained since step %d, "
                        "exiting with status %d so the launcher requeues the run", stopped,
                        step, EXIT_REQUEUE)
        return stopped

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)


class StopSavePolicy:
    """Between steps: whether every rank stops now (a stop request, or an
    ``train.exit_interval`` step), and whether a periodic checkpoint is due.

    A pending async save is polled after every step (a CPU all-reduce on its own gloo
    group), so a failed save stops the run at the next step. The stop request's
    all-reduce runs on stop-check steps only: every ``train.stop_check_interval`` steps, on
    ``train.exit_interval`` steps, and on steps with a checkpoint due (a stop then saves
    once, blocking). The steps are a function of the step number, so every rank calls them
    at the same steps and stops at the same step."""

    def __init__(self, train_cfg, checkpoint_interval_steps: int | None, ckpt,
                 device: torch.device, request: StopRequest):
        self.cfg, self.every, self.ckpt, self.device = (train_cfg, checkpoint_interval_steps,
                                                        ckpt, device)
        self.request = request  # installed first thing, before the run's start-up

    def after_step(self, step: int, settle) -> tuple[str | None, bool]:
        """After step ``step`` (not the last): (why every rank stops now, or None; whether
        a periodic checkpoint is due). ``settle()`` reads the device-side counts of
        skipped steps, on the steps that sync anyway."""
        train = self.cfg
        exit_now = bool(train.exit_interval) and step % train.exit_interval == 0
        sync_step = exit_now or step % train.stop_check_interval == 0
        save_due = self._save_due(step, sync_step)
        # A pending async save is polled every step: a failed one stops the run at the
        # first step after it failed (every rank polls at the same steps: none, or all).
        self.ckpt.poll()
        if not (sync_step or save_due):
            return None, False
        settle()
        stopped = self.request.check(self.device)
        if stopped is None and exit_now:
            stopped = f"train.exit_interval={train.exit_interval}"
        return stopped, save_due

    def stop_or_save(self, step: int, settle, save) -> str | None:
        """After step ``step`` (not the last): why every rank stops now, having saved a
        checkpoint (``save(block=True)``), or None, having saved a periodic one if due."""
        stopped, save_due = self.after_step(step, settle)
        if stopped is not None:
            log.warning("stopping at step %d (%s): saving a checkpoint, then exiting with "
                        "status %d so the launcher requeues the run", step, stopped,
                        EXIT_REQUEUE)
            save(block=True)
        elif save_due:
            save()
        return stopped

    def _save_due(self, step: int, sync_step: bool) -> bool:
        """Whether a periodic checkpoint is due after this step. A step interval is decided
        locally; a minute interval needs rank 0's clock (``CheckpointManager.due``
        broadcasts it), so it is asked on stop-check steps only: such a save comes at most
        ``train.stop_check_interval - 1`` steps late."""
        if (
            sync_step or (self.every and step % self.every == 0) or step in self.ckpt.keep_steps
        ):  # a branch point (checkpoint/branch.py)
            return self.ckpt.due(step)
        return False

    def restore(self) -> None:
        self.request.restore()


def requeue_exit(run_dir: Path, step: int, reason: str, rank0: bool) -> int:
    """The exit status of a run stopped early, to be requeued. One process exits 75 itself.
    Under torchrun a non-zero exit of one rank makes torchrun kill the others and return 1,
    so ranks exit 0 there and the launcher (tools/run_local.py, slurm/train.sbatch) reads
    stopped.json, which rank 0 writes, instead."""
    if rank0:
        (Path(run_dir) / STOPPED).write_text(json.dumps(
            {"step": step, "reason": reason, "exit_code": EXIT_REQUEUE}))
    return 0 if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_REQUEUE


def already_finished(run_dir: Path, step: int, steps: int) -> dict:
    """A finished run started again (resumed from its final checkpoint): nothing to train,
    and result.json (the sweep fits read it) stays exactly as the run wrote it."""
    path = Path(run_dir) / "result.json"
    log.info("this run finished already (step %d of %d, resumed from its final checkpoint): "
             "nothing to train; %s is left as it was", step, steps, path)
    if path.exists():
        return {**json.loads(path.read_text()), "already_finished": True}
    return {"steps": step, "already_finished": True}
