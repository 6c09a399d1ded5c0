"""One run at a time in a run directory.

Two runs writing one directory delete each other's unfinished saves and interleave their
metrics. Rank 0 holds an exclusive ``flock`` on ``run_dir/run.lock`` for the whole run, and
writes its owner, host and pid into it; a second run finds the lock taken and stops with an
error that names them. The kernel drops a ``flock`` when its process dies, so a crashed or
killed run never leaves a lock behind that blocks the next attempt (a requeued Slurm job
finds it free).
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import socket
import time
from pathlib import Path

from pretrain.errors import UserError

LOCK = "run.lock"


class RunLockedError(UserError, RuntimeError):
    pass


def _ours(holder: str) -> bool:
    try:
        owner = json.loads(holder)
    except json.JSONDecodeError:
        return False
    return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if _ours(holder):  # an earlier run of this same process, abandoned (tests,
                return  # notebooks): one process runs one trainer at a time
            raise RunLockedError(
                f"another run is using {self.path.parent} ({holder}); wait for it to end, "
                "or give this run another run_name") from None
        os.ftruncate(fd, 0)
        owner = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.write(fd, json.dumps(owner).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
