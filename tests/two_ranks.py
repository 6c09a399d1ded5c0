"""Run a function on two gloo processes and collect what each rank returned or raised.

For tests of what ranks must agree on (rank 0 decides, the others follow). Spawned, not
forked (a forked child of a process that already ran torch ops can hang in OpenMP), and
with a short process-group timeout, so a rank stuck in a collective its peer skipped fails
the test instead of hanging it. ``blind_to_checkpoints`` gives a rank a filesystem view
without the checkpoint directories, as a rank whose view of a shared filesystem lags.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD = 2


def run_on_two_ranks(fn: Callable[..., Any], store: Path, *args: Any,
                     timeout: float = 120) -> list[tuple[str, Any]]:
    """``fn(rank, *args)`` on ranks 0 and 1 (a process group is set up around it): per rank
    ``("ok", value)`` or ``("error", "Type: message")``; ``("hung", None)`` if a rank did
    not finish within ``timeout`` seconds (it is then killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    procs = [ctx.Process(target=_rank_main, args=(rank, store, env, fn, args, results))
             for rank in range(WORLD)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    try:
        while len(got) < WORLD:
            rank, outcome = results.get(timeout=timeout)
            got[rank] = outcome
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    return [got.get(rank, ("hung", None)) for rank in range(WORLD)]


def _rank_main(rank: int, store: Path, env: dict, fn: Callable[..., Any], args: tuple,
               results) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    try:
        outcome: tuple[str, Any] = ("ok", fn(rank, *args))
    except Exception as e:
        traceback.print_exc()
        outcome = ("error", f"{type(e).__name__}: {e}")
    results.put((rank, outcome))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def blind_to_checkpoints() -> None:
    """From now on this process sees no ``step_XXXXXXX`` directory nor anything in one:
    they are missing from listings, do not exist, cannot be opened."""
    from pretrain.checkpoint.folder import STEP_DIR

    def hidden(path: Path) -> bool:
        return any(STEP_DIR.match(part) for part in Path(path).parts)

    real_stat, real_open, real_iterdir = Path.stat, Path.open, Path.iterdir

    def stat(self, *args, **kwargs):  # Path.exists/is_dir/is_file go through stat
        if hidden(self):
            raise FileNotFoundError(f"(hidden from this rank) {self}")
        return real_stat(self, *args, **kwargs)

    def open_(self, *args, **kwargs):  # Path.read_text/read_bytes go through open
        if hidden(self):
            raise FileNotFoundError(f"(hidden from this rank) {self}")
        return real_open(self, *args, **kwargs)

    def iterdir(self):
        return (p for p in real_iterdir(self) if not hidden(p))

    Path.stat, Path.open, Path.iterdir = stat, open_, iterdir
