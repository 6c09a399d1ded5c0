"""Processes that die with the process that started them: no rank outlives its launcher.

``tools/run_local.py`` starts torchrun, and torchrun's agent starts each rank in a session
of its own (``start_new_session``), so killing the launcher, even with its process group,
leaves the ranks training. Linux can tie a process to its parent: ``PR_SET_PDEATHSIG``
makes the kernel send it a signal when the thread that forked it exits, whatever killed
that (SIGKILL included, which no handler can forward). So each link of the chain is tied
to the one before it: torchrun to the launcher (set between fork and exec, ``preexec``),
and each rank to torchrun's agent (set first thing in train.py, ``tie_rank_to_agent``).
Both signals are SIGKILL: a parent that died without stopping its children (killed -9) gives
them no time to save, and a rank asked to save by a signal would wait in a collective for
ranks that are gone. The graceful stop stays what it was: SIGTERM or SIGINT to the launcher
is forwarded, and every rank saves and exits 75.

A parent can die before its child has asked to be told (between fork and ``prctl``): the
child then checks that its parent is still the one it was started by, and if not, kills
itself. Elsewhere than Linux these calls do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Set by tools/run_local.py for torchrun and, through it, every rank: the launcher's pid,
# so a rank can tell its agent (its parent, whose parent is the launcher) from the process
# that adopted it when the agent died first.
LAUNCHER_PID = "PRETRAIN_LAUNCHER_PID"


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved now (a child between fork and exec should not load it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL,
                    prctl: Callable[..., int] | None = None) -> bool:
    """Ask the kernel for ``sig`` when this process's parent exits; if the parent is
    already not ``expected_parent`` (it died first: this process was adopted), take
    ``sig`` now. False where the kernel has no such call (not Linux)."""
    prctl = prctl or _prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``subprocess.Popen(preexec_fn=...)`` that ties the child to this process (None
    where it cannot: not Linux). Runs in the child between fork and exec."""
    prctl, me = _prctl(), os.getpid()
    if prctl is None:
        return None

    def tie() -> None:
        die_with_parent(me, sig, prctl)
    return tie


def parent_of(pid: int) -> int | None:
    """``pid``'s parent, from /proc (None when it is gone or there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"


def tie_rank_to_agent() -> bool:
    """In a rank torchrun started (first thing, before imports that take seconds): die
    with its agent. Under tools/run_local.py the agent is known (its parent is the
    launcher), so a rank adopted before it asked is caught; under another launcher the
    parent at this moment is taken to be the agent. False when not under torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    agent = os.getppid()
    launcher, above = os.environ.get(LAUNCHER_PID), parent_of(agent)
    if launcher and above is not None and above != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)  # the agent is gone already: so is the run
    return die_with_parent(agent)
