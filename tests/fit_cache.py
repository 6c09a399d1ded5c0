"""Scaling-law fits computed once per pytest run, whatever the number of pytest-xdist workers.

pretrain/analysis/fitting.py's ``fit`` answers a repeated call from an in-process cache: a
fit is a function of its arguments alone (a grid of starts, a fixed summation order). Under
README's ``pytest -q -n auto`` each worker has its own, and the fit modules refit the same
published ladders: the leave-one-out headline fits every ladder's policy, and
test_published_optimal, test_published_ladders and test_fit_stability fit some of them again
(measured in one process, each module with an empty cache: 18 s of their 65 s of fits were
another module's), as does a module whose tests two workers share (worksteal, conftest.py).

``share_fits`` puts each fit a worker computes in the run's shared folder
(tests/built_once.py's ``run_root``) under fitting's own key, and a worker that asks for the
same fit reads it there: the same law and parameter vector to the bit (pickled floats). One
worker computes a key while another that wants it waits (a lock per key prefix), as
built_once does. Only the pytest processes share: a process a test starts, such as
tests/test_fit_stability.py's under another OPENBLAS_CORETYPE, fits for itself. A fit that
fails (no convergence) is not kept: the next caller fails the same way again.
"""

from __future__ import annotations

import fcntl
import pickle

from built_once import run_root


def share_fits(tmp_path_factory) -> None:
    """From now on, ``fitting.fit``'s computations go through the run's shared folder."""
    from pretrain.analysis import fitting

    folder = run_root(tmp_path_factory) / "fits"
    folder.mkdir(exist_ok=True)
    compute = fitting._fit
    if getattr(compute, "shared", False):
        return

    def shared(form, n, d, loss, *, delta, keep, starts, fixed):
        key = fitting._fit_key(form, (n, d, loss), delta, keep, starts, fixed).hex()
        done = folder / f"{key}.pkl"
        with open(folder / f"{key[:2]}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if done.exists():
                return pickle.loads(done.read_bytes())
            value = compute(form, n, d, loss, delta=delta, keep=keep, starts=starts,
                            fixed=fixed)
            part = done.with_suffix(".part")
            part.write_bytes(pickle.dumps(value))
            part.replace(done)
            return value

    shared.shared = True
    fitting._fit = shared
