"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

One directory per save, ``<run>/checkpoints/step_0001000/``, holding DCP's shard files and
``.metadata`` plus our ``meta.json`` (step, tokens, samples consumed, layout, config, and the
size of every file). It is written as ``step_0001000.tmp`` and renamed by rank 0 only once
every rank's shards are on disk, so a directory without ``.tmp`` whose files match its
``meta.json`` is complete; anything else is skipped with a warning and left in place.

On a cluster every rank must act on the same answer (save or skip, which checkpoint to
resume from), and a shared filesystem should not see every rank scan the same folder: rank 0
alone looks at the disk and broadcasts what it found, or the error it hit (``on_rank0``).
Retention deletes old checkpoints on rank 0 in a background thread, after renaming them out
of the scanner's sight (``step_0000100.deleting``), so training never waits for a delete.

DCP stores every tensor globally by name, and the data position is stored as global samples
consumed, so a checkpoint saved with one TP x PP x DP layout loads into another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from pretrain import torch_compat
from pretrain.checkpoint.failures import SAVE_ERRORS, save_failure_message
from pretrain.config.schema import CheckpointConfig
from pretrain.parallel.mesh import broadcast_from_rank0

log = logging.getLogger("pretrain.checkpoint")
# DCP warns on every call without a process group that it assumes one process: it is right.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable",
                        category=UserWarning)

STEP_DIR = re.compile(r"^step_(\d{7,})$")
META = "meta.json"
CHECKSUMS = "sha256"  # meta.json's {file: sha256 hex digest}, written with the save
# A checkpoint retention condemned: renamed first (the scanner ignores it), then deleted.
DELETING = ".deleting"
T = TypeVar("T")


class CheckpointError(RuntimeError):
    pass


_PART_PREFIX = re.compile(r"^\d+\.")


class ModelOptimizer(Stateful):
    """Model and optimizer state as DCP wants it: the plain model's parameter names, DTensors
    for shards, whatever the layout.

    ``get_state_dict`` / ``set_state_dict`` hide the wrappers (FSDP2, compile, activation
    checkpointing). A rank may hold several pipeline stages (``parts``): their names are the
    whole model's already (layers keep their global index), so their states are merged. A
    tied output head is stored once, as ``tok_emb.weight``: a pipeline's last stage holds its
    own copy of it (kept equal to the embedding), which saves and loads under that name.
    """

    def __init__(self, parts: torch.nn.Module | list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer | None):
        self.parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
        self.optimizer = optimizer
        self.container = (self.parts[0] if len(self.parts) == 1
                          else torch.nn.ModuleList(self.parts))
        self.tied = bool(getattr(getattr(self.parts[0], "cfg", None), "tie_embeddings", False))

    def _canonical(self, name: str) -> str:
        name = _PART_PREFIX.sub("", name) if len(self.parts) > 1 else name
        return "tok_emb.weight" if self.tied and name == "lm_head.weight" else name

    def _model_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            for name, t in get_model_state_dict(part).items():
                if self.tied and name == "lm_head.weight" and getattr(part, "tok_emb", None) is not None:
                    continue  # the same tensor as tok_emb.weight: stored once
                out[self._canonical(name)] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self._model_state()}
        if self.optimizer is not None:
            osd = get_optimizer_state_dict(self.container, self.optimizer)
            state["optim"] = {
                "state": {self._canonical(k): v for k, v in osd["state"].items()},
                "param_groups": [{**g, "params": [self._canonical(p) for p in g["params"]]}
                                 for g in osd["param_groups"]],
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_sd = state["model"]
        for part in self.parts:
            names = get_model_state_dict(part).keys()
            mine = {n: model_sd[self._canonical(n)] for n in names
                    if self._canonical(n) in model_sd}
            set_model_state_dict(part, mine, options=StateDictOptions(strict=False))
        if self.optimizer is None:
            return
        # Back from canonical names to the container's names (with the part prefix).
        template = get_optimizer_state_dict(self.container, self.optimizer)
        to_mine = {self._canonical(k): k for g in template["param_groups"] for k in g["params"]}
        osd = state["optim"]
        set_optimizer_state_dict(self.container, self.optimizer, {
            "state": {to_mine[k]: v for k, v in osd["state"].items() if k in to_mine},
            "param_groups": [{**g, "params": [to_mine[p] for p in g["params"] if p in to_mine]}
                             for g in osd["param_groups"]],
        })


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
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
    if _rank() == 0:
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
    for name, size in meta.get("files", {}).items():
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
    bad = [n for n in names[_rank()::world] if file_sha256(Path(path) / n) != sums[n]]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, bad)
        bad = [n for part in every for n in part]
    if not bad:
        return None
    return f"{', '.join(sorted(bad))} do(es) not match the sha256 recorded in {META}"


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


def _check_room(folder: Path, need: float) -> None:
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


def describe_policy(cfg: CheckpointConfig) -> str:
    """When a run saves, in words, for the plan (``dry_run=true`` prints it): periodic saves
    only when enabled; a stop (signal, time limit, exit_interval) saves in any case."""
    points = (f"; branch points for {', '.join(f'{k:g}' for k in cfg.branch_tokens_per_param)}"
              " tokens/param, kept" if cfg.branch_tokens_per_param else "")
    if not cfg.enabled:
        return "on a stop only (checkpoint.enabled=false)" + points
    every = [f"every {cfg.interval_steps} steps"] if cfg.interval_steps else []
    if cfg.interval_minutes:
        every.append(f"every {cfg.interval_minutes:g} min")
    when = ", ".join(every + ["on a stop", "at the end"])
    keep = f"keep last {cfg.keep_last}" + (f" + every {cfg.keep_every}th step"
                                           if cfg.keep_every else "")
    return f"{when}; {keep}; {'async' if cfg.async_save else 'blocking'}{points}"


# torch 2.11's DefaultStager closes its StateDictStager after every stage: the staged
# memory is let go and the deep-copy table emptied, so a second stage through the same
# stager fails (``KeyError: <class 'type'>`` in _state_dict_stager.py). From torch 2.13 it
# keeps both until close(). Below that, each save gets a fresh stager (as dcp.async_save
# makes one per call when given none), with this project's options.
STAGER_REUSABLE_FROM = "2.13"


def stager_reusable() -> bool:
    """Whether one ``DefaultStager`` may stage every save of a run on this torch."""
    return torch_compat.at_least(STAGER_REUSABLE_FROM)


def make_stager(device: torch.device) -> AsyncStager | None:
    """The stager of a manager's async saves: torch's ``DefaultStager``, one reused for
    every save where torch allows it (``stager_reusable``), else one per save.

    It keeps the CPU copy of every tensor it staged, keyed by the source tensor's storage,
    so the next save copies into the same memory; without it ``dcp.async_save`` makes a
    stager per call and allocates the whole state again. The price: that copy of this
    rank's model and optimizer state stays allocated between saves (``close`` frees it).
    On CUDA the memory is pinned and the device-to-host copies are non-blocking. Staging stays synchronous
    (``use_async_staging=False``): ``async_save`` returns once the copy is taken, so the
    next optimizer step cannot change what is being written. On CPU pinning is ignored by
    torch (with a warning) and non-blocking copies raise (both need an accelerator): both
    are off there. Shared memory only serves DCP's process-based saver; ours is a thread.
    None on a torch without ``DefaultStager``: each save then stages into fresh memory.
    """
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    cuda = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=cuda))


class CheckpointManager:
    """Saves (async where possible), finalises, retains and finds checkpoints of one run.

    Every rank calls ``save``, ``wait``, ``poll``, ``due``, ``latest``, ``load`` and
    ``close`` together: they hold collectives, and rank 0 alone touches the folder. Call
    ``close()`` at the end of training.
    """

    def __init__(self, folder: Path, cfg: CheckpointConfig,
                 device: torch.device = torch.device("cpu"), keep_steps: Sequence[int] = ()):
        self.folder = Path(folder)
        self.cfg = cfg
        # Branch points (checkpoint/branch.branch_points): saved at these steps whatever
        # cfg.enabled says, and never deleted by retention.
        self.keep_steps = frozenset(keep_steps)
        self.device = device  # for the small agreement collectives (NCCL needs CUDA tensors)
        self.pending: tuple[Future, Path, dict] | None = None
        self.last_save_time = time.monotonic()
        # Async saves run their collectives in a background thread: give them their own
        # gloo group so they never interleave with the training step's collectives.
        # (none when nothing is saved: a group nothing uses is one more to shut down)
        saves = cfg.enabled or bool(self.keep_steps)
        self.group = (dist.new_group(backend="gloo")
                      if dist.is_initialized() and saves and cfg.async_save else None)
        # poll's agreement on whether a save is done: a CPU tensor on a gloo group of its own
        self._poll_group = dist.new_group(backend="gloo") if self.group is not None else None
        self.stager = make_stager(device) if cfg.async_save and stager_reusable() else None
        # Rank 0's retention worker (made on first use) and the last pass given to it.
        self._deleter: ThreadPoolExecutor | None = None
        self._retention: Future | None = None
        # Held while the folder is scanned and while retention renames what it condemned,
        # so a scan never returns a checkpoint that is about to be deleted.
        self._scan_lock = threading.Lock()
        self._closed = False

    # -- room ----------------------------------------------------------------------------

    def check_room(self, checkpoint_bytes: float) -> None:
        """Before training: the folder can be written and has room for one more checkpoint
        of ``checkpoint_bytes`` (planning/memory.checkpoint_bytes), else CheckpointError
        naming the fix. Rank 0 looks; every rank gets its answer (call it on every rank)."""
        if self.cfg.enabled:
            on_rank0(lambda: _check_room(self.folder, checkpoint_bytes))

    # -- when ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        if step in self.keep_steps:
            return True
        if not self.cfg.enabled:
            return False
        if self.cfg.interval_steps and step % self.cfg.interval_steps == 0:
            return True
        if self.cfg.interval_minutes:
            elapsed = torch.tensor(time.monotonic() - self.last_save_time, device=self.device)
            if dist.is_initialized():  # every rank must agree, or the save collective hangs
                dist.broadcast(elapsed, src=0)
            return elapsed.item() >= 60 * self.cfg.interval_minutes
        return False

    # -- save ----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict, block: bool = False) -> None:
        """Write ``state`` for ``step``. Async unless ``block`` or disabled in the config:
        DCP stages a copy in memory and writes it while training goes on. The previous async
        save is finished first: its staged copy is the memory this one stages into."""
        if self._closed:
            raise CheckpointError(f"the checkpoint manager of {self.folder} is closed")
        self.wait()
        final = self.folder / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        # Rank 0's answer for every rank (one rank skipping the save would hang the others);
        # it arrives after rank 0 made the directory, so it is also the barrier before DCP.
        if not on_rank0(lambda: as_save_failure(final, lambda: self._prepare(final, tmp))):
            log.warning("checkpoint %s already exists and is complete; not overwriting it",
                        final)
            return
        t0 = time.perf_counter()
        background = self.cfg.async_save and not block
        try:
            if background:
                written = self._async_save(state, tmp)
                self.pending = (self._worker().submit(self._hash_after, written, tmp), tmp,
                                meta)
            else:
                dcp.save(state, checkpoint_id=str(tmp))
                sums = own_checksums(tmp, self._save_rank())
        except SAVE_ERRORS as e:  # DCP's CheckpointException is a BaseException
            raise save_failure(final, e) from e
        if background:
            log.info("checkpoint step %d: async save started, training blocked %.2f s",
                     step, time.perf_counter() - t0)
        else:
            self._finalise(tmp, meta, sums)
            log.info("checkpoint step %d saved to %s in %.2f s", step, final,
                     time.perf_counter() - t0)
        self.last_save_time = time.monotonic()

    @staticmethod
    def _prepare(final: Path, tmp: Path) -> bool:
        """Rank 0: False if ``final`` is a complete checkpoint (never overwritten), else True
        with an empty ``tmp`` directory to write into. An incomplete or corrupt ``final``
        (a leftover the scanner skips) is moved aside to ``<name>.stale``, kept for a look,
        so that this step's save is not lost to it."""
        if final.exists():
            why = checkpoint_status(final)
            if why is None:
                return False
            stale = final.with_name(f"{final.name}.stale")
            if stale.exists():
                stale = final.with_name(f"{final.name}.stale-{time.time_ns()}")
            final.rename(stale)
            log.warning("checkpoint %s was left incomplete or corrupt (%s): moved aside to "
                        "%s, and this step is saved again", final, why, stale.name)
        if tmp.exists():
            shutil.rmtree(tmp)  # our own leftover from a save that never completed
        tmp.mkdir(parents=True)
        return True

    def _save_rank(self) -> int:
        """This rank's index in the save's process group: DCP names its files after it."""
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _hash_after(self, written: Future, tmp: Path) -> dict[str, str]:
        """In a worker thread: wait for an async save's writes, then checksum this rank's
        files, so neither blocks training."""
        written.result()
        return own_checksums(tmp, self._save_rank())

    def _worker(self) -> ThreadPoolExecutor:
        """This manager's one background thread (checksums after async saves; retention)."""
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="checkpoint-worker")
        return self._deleter

    def _async_save(self, state: dict[str, Any], tmp: Path) -> Future:
        """``dcp.async_save`` through this manager's one stager, or on a torch whose stager
        is single-use, a fresh one (when torch has one)."""
        stager = self.stager if self.stager is not None else make_stager(self.device)
        given = {} if stager is None else {"async_stager": stager}
        return dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group, **given)

    def wait(self) -> None:
        """Finish a pending async save (every rank calls it)."""
        if self.pending is None:
            return
        fut, tmp, meta = self.pending
        self.pending = None
        try:
            sums = fut.result()
        except SAVE_ERRORS as e:  # DCP's CheckpointException is a BaseException
            raise save_failure(tmp.with_name(tmp.name.removesuffix(".tmp")), e) from e
        _barrier(self.group)
        self._finalise(tmp, meta, sums)

    def poll(self) -> None:
        """Finish a pending async save if its writes are done (or failed: its error is
        raised here, ``save_failure``); cheap to call every step. The ranks agree on a CPU
        tensor over a gloo group of its own (no device sync, never interleaved with the
        save thread's collectives on ``self.group``)."""
        if self.pending is not None:
            done = torch.tensor(int(self.pending[0].done()))
            if dist.is_initialized():
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
            if done.item():
                self.wait()

    def _finalise(self, tmp: Path, meta: dict, sums: dict[str, str]) -> None:
        """Once all ranks wrote and checksummed their files (``sums``): rank 0 records every
        file's size and checksum and renames into place, and every rank learns that it
        worked (or raises rank 0's error). Then rank 0 queues retention; nobody waits."""
        _barrier()
        every = [sums]
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, sums)
        merged = {name: digest for part in every for name, digest in part.items()}
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        on_rank0(lambda: as_save_failure(final, lambda: self._commit(tmp, meta, merged)))
        if _rank() == 0:
            self._retain_in_background()

    @staticmethod
    def _commit(tmp: Path, meta: dict, sums: dict[str, str]) -> Path:
        """Rank 0: write meta.json (with every file's size and sha256) and rename ``tmp``
        into place. A file no rank claimed (not named as DCP names them) is hashed here."""
        files = {f.name: f.stat().st_size for f in tmp.iterdir() if f.is_file()}
        sums = {**{n: file_sha256(tmp / n) for n in files if n not in sums}, **sums}
        meta = {**meta, "files": files, CHECKSUMS: dict(sorted(sums.items())),
                "saved_at": time.time()}
        (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        tmp.rename(final)
        log.info("checkpoint complete: %s (%.1f MB)", final, sum(files.values()) / 1e6)
        return final

    # -- retention -----------------------------------------------------------------------

    def _retain_in_background(self) -> None:
        """Give rank 0's one worker a retention pass, unless one is still queued: that one
        scans after this checkpoint's rename too. Deleting can take minutes on a shared
        filesystem; training does not wait for it (``close`` does)."""
        queued = self._retention is not None and not (self._retention.running()
                                                      or self._retention.done())
        if queued:
            return
        self._retention = self._worker().submit(self._retain_logged)

    def _retain_logged(self) -> None:
        """``retain`` in the worker: a failed delete is a warning, never a crash of training
        (what is left is retried by the next pass)."""
        try:
            self.retain()
        except Exception:
            log.warning("checkpoint retention failed in %s", self.folder, exc_info=True)

    def retain(self) -> list[Path]:
        """Keep the newest keep_last plus every keep_every-th step and the branch points
        (``keep_steps``); delete the other complete
        checkpoints. Returns the directories removed.

        Only complete checkpoints count and the newest of them is always kept, so the only
        complete checkpoint is never deleted (incomplete ones are left alone, as the scanner
        leaves them). Condemned ones are renamed to ``*.deleting`` under the scan lock, so
        ``latest`` cannot return one, then deleted; so are ``*.deleting`` leftovers of a
        process killed mid-delete. Rank 0's worker runs it; call it directly only when no
        pass is queued (``finish_deletions``)."""
        with self._scan_lock:
            doomed = self._leftovers()
            for path in self._expired():
                doomed.append(path.rename(path.with_name(path.name + DELETING)))
        for path in doomed:
            shutil.rmtree(path)
            log.info("checkpoint retention: removed %s",
                     path.with_name(path.name.removesuffix(DELETING)))
        return doomed

    def _expired(self) -> list[Path]:
        """Complete checkpoints the retention settings no longer keep."""
        found = complete_checkpoints(self.folder, warn=False)
        keep = {p for _, p in found[-max(1, self.cfg.keep_last):]}
        if self.cfg.keep_every:
            keep |= {p for s, p in found if s % self.cfg.keep_every == 0}
        keep |= {p for s, p in found if s in self.keep_steps}
        return [p for _, p in found if p not in keep]

    def _leftovers(self) -> list[Path]:
        """Directories an earlier retention renamed but did not finish deleting."""
        if not self.folder.is_dir():
            return []
        return [p for p in sorted(self.folder.iterdir())
                if p.name.endswith(DELETING) and p.is_dir()]

    def finish_deletions(self) -> None:
        """Wait until rank 0's queued retention passes are done (a no-op elsewhere)."""
        if self._retention is not None:
            self._retention.result()

    def close(self) -> None:
        """End of training (every rank): finish a pending async save, wait for rank 0's
        deletions (an exit mid-delete would leave half a directory behind) and free the
        staging memory. Calling it again does nothing; saving after it is an error."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    # -- load ----------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest complete checkpoint, as rank 0 sees it, on every rank (collective).
        A pending async save is finished first: it holds a state saved before anything
        went wrong, and is the newest good one."""
        self.wait()
        return on_rank0(self._newest)

    def _newest(self) -> Path | None:
        with self._scan_lock:  # not while retention is renaming what it condemned
            return newest_checkpoint(self.folder)

    @staticmethod
    def load(path: Path, state: dict[str, Any]) -> dict:
        """Load ``state`` (Stateful values are updated in place) from ``path``; its meta,
        as rank 0 read it. Every rank calls this (DCP's load is collective too)."""
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(path))
        log.info("loaded checkpoint %s in %.2f s", path, time.perf_counter() - t0)
        return on_rank0(lambda: read_meta(path))


def load_model_weights(model: torch.nn.Module, path: Path) -> dict:
    """Only the model weights of a checkpoint (for export, or to start a new run)."""
    return CheckpointManager.load(path, {"model_optim": ModelOptimizer(model, None)})
