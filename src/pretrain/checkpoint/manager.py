"""Saving and loading a run's checkpoints with torch.distributed.checkpoint (DCP): the
save policy (blocking or async through one reused stager, a background worker that
checksums after async writes and runs retention), finalising (rank 0 writes meta.json and
renames ``.tmp`` into place: folder.py holds that format), retention, and loading.

DCP stores every tensor globally by name (model_state.ModelOptimizer), and the data
position is stored as global samples consumed, so a checkpoint saved with one TP x PP x DP
layout loads into another.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from pretrain import torch_compat
from pretrain.checkpoint.failures import SAVE_ERRORS
from pretrain.checkpoint.folder import (
    CHECKSUMS,
    DELETING,
    FILES,
    META,
    SAVED_AT,
    CheckpointError,
    as_save_failure,
    barrier,
    check_room,
    checkpoint_status,
    complete_checkpoints,
    file_sha256,
    newest_checkpoint,
    on_rank0,
    own_checksums,
    read_meta,
    save_failure,
    step_dir_name,
    this_rank,
)
from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.config.schema import CheckpointConfig

log = logging.getLogger("pretrain.checkpoint")
# DCP warns on every call without a process group that it assumes one process: it is right.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable",
                        category=UserWarning)

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
    On CUDA the memory is pinned and the device-to-host copies are non-blocking. Staging stays
    synchronous
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
            on_rank0(lambda: check_room(self.folder, checkpoint_bytes))

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
        barrier(self.group)
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
        barrier()
        every = [sums]
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, sums)
        merged = {name: digest for part in every for name, digest in part.items()}
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        on_rank0(lambda: as_save_failure(final, lambda: self._commit(tmp, meta, merged)))
        if this_rank() == 0:
            self._retain_in_background()

    @staticmethod
    def _commit(tmp: Path, meta: dict, sums: dict[str, str]) -> Path:
        """Rank 0: write meta.json (with every file's size and sha256) and rename ``tmp``
        into place. A file no rank claimed (not named as DCP names them) is hashed here."""
        files = {f.name: f.stat().st_size for f in tmp.iterdir() if f.is_file()}
        sums = {**{n: file_sha256(tmp / n) for n in files if n not in sums}, **sums}
        meta = {**meta, FILES: files, CHECKSUMS: dict(sorted(sums.items())),
                SAVED_AT: time.time()}
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
