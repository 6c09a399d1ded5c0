"""What a failed checkpoint save says: its cause in words, found under torch's wrapping.

A save can fail at any point of the write: making its folder, inside DCP's writer (the
shards, ``.metadata``), in the checksum thread of an async save, writing ``meta.json`` or the
rename. DCP reports a failure on any rank as ``torch.distributed.checkpoint.api
.CheckpointException``, which derives from ``BaseException`` (an ``except Exception``
misses it) and carries each failed rank's own exception in ``failures``. ``SAVE_ERRORS`` is
what the save paths catch; ``save_failure`` walks every cause (``__cause__``,
``__context__``, DCP's per-rank failures) for an errno it can name, and the full-disk
``RuntimeError`` of torch's zip writer ("enforce fail at inline_container.cc ... unexpected
pos"), which carries none, is recognised by its text and the free space left.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

# What a save path catches: every Exception, and DCP's BaseException.
SAVE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)

# Below this many free bytes after a failed write, the disk is taken as full.
FULL_DISK_BYTES = 64 * 2**20

ERRNO_WORDS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the directory is read-only or not writable (read-only file system)",
    errno.EACCES: "the directory is read-only or not writable (permission denied)",
    errno.EPERM: "the directory is read-only or not writable (operation not permitted)",
    errno.ENOENT: "a folder of the save is missing (deleted or unmounted while writing)",
}
# torch's zip writer (torch.save inside DCP's writer) on a short write: no errno.
SHORT_WRITE = ("unexpected pos", "file write failed", "inline_container")


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception under it, each once: its ``__cause__`` and
    ``__context__`` chain, and the per-rank failures a CheckpointException carries."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo.extend(pair[0] for pair in e.failures.values())
        todo.extend([e.__cause__, e.__context__])


def _free_bytes(folder: Path) -> float:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return float("inf")


def _missing(folder: Path) -> Path | None:
    """The nearest of ``folder`` and its parents that is gone, or None."""
    for p in (folder, *folder.parents):
        if p.exists():
            return None if p == folder else folder
    return folder


def cause_in_words(error: BaseException, folder: Path) -> str:
    """Why a save under ``folder`` failed, in words: from the first cause with a known
    errno, a short write on a (nearly) full disk, a folder gone or not writable; else the
    innermost cause's type and first line."""
    chain = list(causes(error))
    for e in chain:
        code = getattr(e, "errno", None)
        if code in ERRNO_WORDS:
            where = getattr(e, "filename", None)
            return ERRNO_WORDS[code] + (f" ({where})" if where else "")
    short = any(any(s in str(e) for s in SHORT_WRITE) for e in chain
                if not isinstance(e, CheckpointException))
    if short and _free_bytes(folder) < FULL_DISK_BYTES:
        return "no space left on the device (torch's writer stopped short of a file's end)"
    if _free_bytes(folder) < 2**20:
        return "no space left on the device"
    gone = _missing(folder)
    if gone is not None:
        return f"a folder of the save is missing ({gone})"
    if not os.access(folder, os.W_OK):
        return "the directory is read-only or not writable"
    inner = next((e for e in reversed(chain) if not isinstance(e, CheckpointException)),
                 error)
    first = (str(inner).strip().splitlines() or [""])[0]
    if short:
        first += " (a write stopped short: is the disk full?)"
    return f"{type(inner).__name__}: {first}"


def save_failure_message(final: Path, error: BaseException) -> str:
    """The documented message of a failed save of checkpoint folder ``final``."""
    folder = final.parent
    return (f"saving checkpoint {final.name} in {folder} failed: "
            f"{cause_in_words(error, folder)}. The older checkpoints there are kept; the run "
            "stops here (resume from the newest once the cause is fixed).")
