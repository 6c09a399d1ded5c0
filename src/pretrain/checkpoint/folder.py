"""The on-disk format of a run's checkpoints, and how every rank agrees on what is there.

One directory per save, ``<run>/checkpoints/step_0001000/``, holding DCP's shard files and
``.metadata`` plus our ``meta.json`` (step, tokens, samples consumed, layout, config, each
hook's state, and the size and sha256 of every file). It is written as
``step_0001000.tmp`` and renamed by rank 0 only once every rank's shards are on disk, so a
directory without ``.tmp`` whose files match its ``meta.json`` is complete
(``checkpoint_status``); anything else is skipped with a warning and left in place
(``complete_checkpoints``). Retention renames what it condemns to ``*.deleting`` first.

On a cluster every rank must act on the same answer (save or skip, which checkpoint to
resume from), and a shared filesystem should not see every rank scan the same folder: rank 0
alone looks at the disk and broadcasts what it found, or the error it hit (``on_rank0``).
Also here: the room check before a run and the words of a failed save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from pretrain.checkpoint.failures import SAVE_ERRORS, save_failure_message
from pretrain.errors import UserError
from pretrain.parallel.mesh import broadcast_from_rank0

log = logging.getLogger("pretrain.checkpoint")

STEP_DIR = re.compile(r"^step_(\d{7,})$")
META = "meta.json"
CHECKSUMS = "sha256"  # meta.json's {file: sha256 hex digest}, written with the save
FILES = "files"  # meta.json's {file: size in bytes}, written with the save
SAVED_AT = "saved_at"  # meta.json's time of the save (seconds since the epoch)
# meta.json's own keys, the one list: what a run writes (train/checkpointing.py's save) and
# what the manager adds (FILES, CHECKSUMS, SAVED_AT). Each hook's state sits under the
# hook's name, which may be none of these (train/services/__init__.py); tests/test_meta_keys.py
# compares a real save's meta.json with this list.
RUN_META_KEYS = ("step", "tokens", "samples_seen", "layout", "world_size", "branch", "config")
META_KEYS = frozenset({*RUN_META_KEYS, FILES, CHECKSUMS, SAVED_AT})
# A checkpoint retention condemned: renamed first (the scanner ignores it), then deleted.
DELETING = ".deleting"
T = TypeVar("T")


class CheckpointError(UserError, RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def on_rank0(decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0 only; every rank returns its answer, or raises its error.

    Every rank calls this together (it is a broadcast). Why: 1024 ranks each listing and
    stat-ing the same checkpoint folder on a shared filesystem is millions of metadata
    operations, and two ranks that see the folder differently would take different paths
    (one enters a save collective the other skips) and hang. The error is sent as text, so
    the other ranks raise a ``CheckpointError`` with rank 0's message instead of waiting
    forever; rank 0 raises the original exception. Without a process group: ``decide()``.
    """
    if not dist.is_initialized():
        return decide()
    answer, error = None, None
    if this_rank() == 0:
        try:
            answer = decide()
        except Exception as e:  # sent to the other ranks, then raised here too
            error = e
    message = None if error is None else _message(error)
    answer, message = broadcast_from_rank0((answer, message))
    if error is not None:
        raise error
    if message is not None:
        raise CheckpointError(message)
    return answer


def _message(error: Exception) -> str:
    """The text every rank raises: a CheckpointError's own message, else what rank 0 hit."""
    if isinstance(error, CheckpointError):
        return str(error)
    return f"on rank 0: {type(error).__name__}: {error}"


def checkpoint_status(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint, else why not (for the warning)."""
    meta_path = path / META
    if not path.is_dir():
        return "no such directory" if not path.exists() else "not a directory"
    if not (path / ".metadata").exists():
        return "DCP .metadata is missing"
    if not meta_path.exists():
        return f"{META} is missing"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{META} is unreadable ({e})"
    for name, size in meta.get(FILES, {}).items():
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} expected"
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def own_checksums(folder: Path, rank: int) -> dict[str, str]:
    """sha256 of the files this rank wrote into ``folder`` in a DCP save (DCP names them
    ``__<rank>_<n>.distcp`` after the rank in the save's group); rank 0 also the
    ``.metadata`` its coordinator wrote. Each rank reads only its own: O(shard)."""
    mine = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (folder / ".metadata").exists():
        mine.append(folder / ".metadata")
    return {p.name: file_sha256(p) for p in mine}


def verify_checksums(path: Path) -> str | None:
    """None if every file of checkpoint ``path`` has the sha256 its meta.json records (or
    it records none: saved before checksums), else which file does not. Every rank calls
    it together: each hashes every world-size-th file, and all learn the answer."""
    sums = on_rank0(lambda: read_meta(path).get(CHECKSUMS, {}))
    names = sorted(sums)
    world = dist.get_world_size() if dist.is_initialized() else 1
    bad = [n for n in names[this_rank()::world] if file_sha256(Path(path) / n) != sums[n]]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, bad)
        bad = [n for part in every for n in part]
    if not bad:
        return None
    return f"{', '.join(sorted(bad))} do(es) not match the sha256 recorded in {META}"


def require_intact(path: Path, fix: str) -> None:
    """CheckpointError, naming the file and ``fix``, unless every file of checkpoint
    ``path`` has the sha256 its meta.json records (``verify_checksums``: every rank calls
    it together). What resume, a weights-only start and the tools reading a checkpoint
    (tools/evaluate.py, tools/export_hf.py) all check before they read one."""
    why = verify_checksums(path)
    if why is not None:
        raise CheckpointError(f"{path} is corrupt: {why}. {fix}")


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def complete_checkpoints(folder: Path, warn: bool = True) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``folder``, oldest first; incomplete ones are named."""
    found = []
    if not folder.is_dir():
        return found
    for p in sorted(folder.iterdir()):
        if p.name.endswith(".tmp") and p.is_dir():
            if warn:
                log.warning("checkpoint %s was never completed (a save was cut short); "
                            "skipping it, not deleting it", p)
            continue
        m = STEP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        why = checkpoint_status(p)
        if why is not None:
            if warn:
                log.warning("checkpoint %s is incomplete or corrupt (%s); skipping it, "
                            "not deleting it", p, why)
            continue
        found.append((int(m.group(1)), p))
    return sorted(found)


def require_exists(path: str | Path, key: str | None = None) -> Path:
    """``path`` if it exists, else a CheckpointError that says it is missing (and, for a
    step folder, which steps its folder does hold), naming ``key`` when given."""
    p = Path(path)
    if p.exists():
        return p
    named = f"{key}={p}" if key else str(p)
    beside = ""
    if STEP_DIR.match(p.name) and p.parent.is_dir():
        steps = [s for s, _ in complete_checkpoints(p.parent, warn=False)]
        beside = f"; {p.parent} holds complete checkpoints at steps {steps}"
    what = "step folder" if STEP_DIR.match(p.name) else "path"
    raise CheckpointError(f"{named}: no such {what}{beside}. Check the path: a run "
                          "directory, its checkpoints folder or one step_XXXXXXX folder")


def resolve_checkpoint(path: str | Path, key: str | None = None) -> Path:
    """A run directory, a checkpoints folder or one step directory -> a complete step dir.
    ``key``: the setting that named it, for the error of a missing path."""
    p = require_exists(path, key)
    if STEP_DIR.match(p.name):
        why = checkpoint_status(p)
        if why:
            raise CheckpointError(f"{p} is not a complete checkpoint: {why}")
        return p
    for folder in (p / "checkpoints", p):
        found = complete_checkpoints(folder)
        if found:
            return found[-1][1]
    raise CheckpointError(f"no complete checkpoint under {p} (looked for step_XXXXXXX "
                          f"directories in {p / 'checkpoints'} and {p})")


def newest_checkpoint(folder: Path, skip: Sequence[Path] = ()) -> Path | None:
    """The newest complete checkpoint under ``folder`` but those in ``skip`` (this
    process's view: call it on rank 0, see ``on_rank0``), or None."""
    found = [p for _, p in complete_checkpoints(folder) if p not in skip]
    return found[-1] if found else None


def check_room(folder: Path, need: float) -> None:
    """Rank 0: CheckpointError unless ``folder`` takes a file and has ``need`` bytes free."""
    probe = folder / f".write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoints to {folder} ({e.strerror or e}): make it writable, or "
            "set runs_dir (or run_name) to a writable place, or checkpoint.enabled=false"
        ) from e
    free = shutil.disk_usage(folder).free
    if free < need:
        raise CheckpointError(
            f"{folder} has {free / 1e9:.2f} GB free, and one checkpoint of this run takes "
            f"about {need / 1e9:.2f} GB (weights and AdamW state): free space, or set "
            "runs_dir to a larger disk, or checkpoint.enabled=false")


def save_failure(final: Path, error: BaseException) -> CheckpointError:
    """What a failed save says (checkpoint/failures.py): the cause in words (no space,
    quota, read-only, a missing folder, else the innermost error), that the older
    checkpoints are kept, and that the run stops."""
    return CheckpointError(save_failure_message(final, error))


def as_save_failure(final: Path, action: Callable[[], T]) -> T:
    """``action()``, a step of saving ``final`` outside DCP (making its folder, writing
    meta.json, the rename), with any error it raises said as ``save_failure`` says it."""
    try:
        return action()
    except CheckpointError:
        raise
    except SAVE_ERRORS as e:
        raise save_failure(final, e) from e

