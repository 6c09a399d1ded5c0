"""One preparation of the same data at a time on a machine: the staging dir's lock
(``prepare.prepare``; the Slurm path's plan, encode array and merge jobs are ordered by their
dependencies instead)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# In the staging dir while a process of this machine prepares it; removed once the dir is
# published (``prepare.merge``).
LOCK = ".preparing.lock"


@contextlib.contextmanager
def one_preparation(staging: Path, out: Path):
    """Hold ``staging``'s lock while preparing ``out``. Two runs started at once on a fresh
    ``data.root`` (torchft's replica groups, a sweep's first jobs) encoded the same pieces
    into the same staging dir and raced on its temporary files; the second now waits for
    the first and then finds the data prepared."""
    staging.mkdir(parents=True, exist_ok=True)
    with open(staging / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("data: another process is preparing %s: waiting for it", out)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError as e:  # a file system without flock (Lustre mounted without it)
            log.warning("data: no file lock on %s (%s): preparing without one, as one "
                        "process at a time must", staging, e.strerror)
        try:
            yield
        except BaseException:
            _remove_if_unplanned(staging)
            raise


def _remove_if_unplanned(staging: Path) -> None:
    """A preparation that failed before planning (a missing file, a bad source) leaves no
    staging dir; one that planned keeps it, for the next run to resume."""
    if [p.name for p in staging.iterdir()] == [LOCK]:
        (staging / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            staging.rmdir()
