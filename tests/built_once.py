"""A trained state built once per pytest run, whatever the number of pytest-xdist workers.

README's ``pytest -q -n auto`` hands a module's tests to whichever worker is free (``--dist
worksteal``, conftest.py), so a module-scoped fixture that trains (a group of layouts, a run
to resume from) was built again on every worker that ran one of the module's tests: two
workers, twice the training, on a machine whose two cores were both busy. ``built_once``
keeps the value in the run's shared temporary folder (the parent of each worker's
``basetemp``) under a file lock: the first worker to ask builds it, another one waits for it
(leaving its core to the builder) and reads the same value. A build that fails leaves
nothing, so the next one to ask builds it again and fails the same way.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def run_root(tmp_path_factory) -> Path:
    """The temporary folder every worker of this pytest run shares (one process: its own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """``build(folder)``'s value, built by one worker of this run: ``folder`` is
    ``<run root>/built-<name>``, where the build keeps its files (runs, checkpoints) for
    every worker to read; the value must pickle."""
    root = run_root(tmp_path_factory)
    folder, done = root / f"built-{name}", root / f"built-{name}.pkl"
    with open(root / f"built-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the worker dies)
        if done.exists():
            return pickle.loads(done.read_bytes())
        folder.mkdir(exist_ok=True)
        value = build(folder)
        part = done.with_suffix(".part")
        part.write_bytes(pickle.dumps(value))
        part.replace(done)
        return value
