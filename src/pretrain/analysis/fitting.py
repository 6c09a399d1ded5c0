"""The one fitter and the one bootstrap of every scaling law (pretrain/analysis/laws.py).

The objective is Hoffmann et al. 2022's (section D.2): the Huber loss (delta 1e-3) of the
residual log(predicted) - log(measured), so a few diverged or unlucky runs do not drag the
fit, minimised by L-BFGS-B with the form's analytic gradient from the best points of a grid
of starts (the objective has many local minima). Screening the grid by objective value
first and descending from the ``keep`` best finds the same optimum as descending from every
point, at a fraction of the cost; the bootstrap refits from the full-data optimum.

An exact gradient matters: the OLMo ladder's published fit (Bhagia et al. 2024) gives -1.98%
and -3.83% on its 7B and 13B with an analytic Jacobian, -0.27% and +1.20% when the optimizer
differences numerically, because the objective is flat along E and the run stops early. Here
the tolerances are tight and the gradient exact, so the answer is the objective's, not the
optimizer's (tests/test_published_ladders.py checks both published figures). The gradient is
summed by numpy, not a BLAS matrix product, so it is the same under every OPENBLAS_CORETYPE
(tests/test_fit_stability.py).

The compute-optimal fits (analysis/optimal.py) project their scale constants out and search
their exponents alone; their searches are here too (``refine_exponent``,
``refine_exponents``), so this file holds every optimizer call.

Needs scipy (the ``analysis`` extra): ``pip install -e '.[analysis]'``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import numpy as np

from pretrain.analysis.laws import FORMS, Law

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, section D.2


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals and its derivative (quadratic inside delta, linear outside)."""
    a = np.abs(r)
    value = np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))
    return value, np.minimum(np.maximum(r, -delta), delta)  # np.clip's, without its wrapper


@functools.cache
def _blas_pools():
    """threadpoolctl's view of the loaded BLAS libraries (None without threadpoolctl),
    taken once: scanning the process's libraries cost 2.7 ms a fit, 6% of a policy's
    hundreds of fits. Taken on the first fit, after scipy.optimize has loaded its BLAS."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


def _one_blas_thread() -> AbstractContextManager:
    """L-BFGS-B's tiny matrix products run 10-100x slower when OpenBLAS spreads them over
    threads on a busy machine (measured: 12 ms a step instead of 0.2 ms); one thread is
    always right for problems this small."""
    pools = _blas_pools()
    return nullcontext() if pools is None else pools.limit(limits=1, user_api="blas")


@dataclass(frozen=True)
class Fitted:
    """A fit: the law, its parameter vector (to restart the bootstrap from) and the
    objective it reached."""

    law: Law
    theta: np.ndarray
    objective: float


# A fit is a function of its arguments alone (the starts are a grid, not random; the
# gradient is summed in a fixed order): the policy's backtests ask for the same fit again
# (a cut that leaves two candidates the same runs; 166 of the 756 fits of
# ``tools/scaling_law.py --loo``, 10 of its 45 s). Those are answered from here.
FIT_CACHE_SIZE = 4096
_FITS: OrderedDict[bytes, Fitted] = OrderedDict()


def _fit_key(form: str, arrays: Sequence, delta: float, keep: int,
             starts: np.ndarray | None, fixed: dict[str, float] | None) -> bytes:
    h = hashlib.blake2b(repr((form, delta, keep, sorted((fixed or {}).items()),
                              None if starts is None else np.shape(starts))).encode())
    for a in (*arrays, *(() if starts is None else (starts,))):
        h.update(np.ascontiguousarray(a, float).tobytes())
    return h.digest()


def fit(form: str, n: Sequence[float], d: Sequence[float], loss: Sequence[float], *,
        delta: float = HUBER_DELTA, keep: int = 8, starts: np.ndarray | None = None,
        fixed: dict[str, float] | None = None) -> Fitted:
    """Fit ``form`` to runs of N parameters, D tokens and these losses.

    ``fixed``: parameters held at a value (by their name in the form's ``params``, e.g.
    ``{"e": log(E)}``), the rest fitted; ``starts``: rows of full parameter vectors instead
    of the form's grid (the bootstrap passes the full-data optimum). The same arguments
    again: the same fit, from ``_FITS`` (a copy: the caller may keep or change it)."""
    key = _fit_key(form, (n, d, loss), delta, keep, starts, fixed)
    if key in _FITS:
        _FITS.move_to_end(key)
    else:
        _FITS[key] = _fit(form, n, d, loss, delta=delta, keep=keep, starts=starts,
                          fixed=fixed)
        if len(_FITS) > FIT_CACHE_SIZE:
            _FITS.popitem(last=False)
    hit = _FITS[key]
    return replace(hit, law=Law(hit.law.form, dict(hit.law.constants)),
                   theta=hit.theta.copy())


def _fit(form: str, n: Sequence[float], d: Sequence[float], loss: Sequence[float], *,
         delta: float, keep: int, starts: np.ndarray | None,
         fixed: dict[str, float] | None) -> Fitted:
    from scipy.optimize import minimize

    spec = FORMS[form]
    ln_n, ln_d = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    log_l = np.log(np.asarray(loss, float))
    if len(log_l) < len(spec.params) - len(fixed or {}):
        raise ValueError(f"{form} has {len(spec.params) - len(fixed or {})} free constants: "
                         f"need at least that many runs, got {len(log_l)}")
    low = float(np.exp(log_l.min()))
    lo, hi = (np.array(b, float) for b in spec.bounds(low))
    if starts is None:
        starts = spec.starts(low, ln_n, ln_d)
    starts = np.clip(np.array(starts, float), lo, hi)
    free = np.ones(len(spec.params), bool)
    for name, value in (fixed or {}).items():
        i = spec.params.index(name)
        free[i] = False
        starts[:, i] = value
    starts = np.unique(starts, axis=0)

    def full(x: np.ndarray, base: np.ndarray) -> np.ndarray:
        out = base.copy()
        out[free] = x
        return out

    def objective(x: np.ndarray, base: np.ndarray) -> tuple[float, np.ndarray]:
        theta = full(x, base)  # under the descents' np.errstate (below)
        pred, jac = spec.log_model(theta, ln_n, ln_d)
        value, dh = huber(pred - log_l, delta)
        total = float(value.sum())
        if not math.isfinite(total):
            return math.inf, np.zeros(int(free.sum()))
        return total, (dh[:, None] * jac).sum(axis=0)[free]  # numpy's sum, not BLAS

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        grid, _ = spec.log_model(starts.T[..., None], ln_n, ln_d, jac=False)
        screened = huber(grid - log_l, delta)[0].sum(axis=1)
    screened = np.where(np.isfinite(screened), screened, np.inf)
    best_x, best_f = None, math.inf
    bounds = list(zip(lo[free], hi[free], strict=True))
    with _one_blas_thread(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i in [i for i in np.argsort(screened) if math.isfinite(screened[i])][:keep]:
            res = minimize(objective, starts[i][free], args=(starts[i],), jac=True,
                           method="L-BFGS-B", bounds=bounds,
                           options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12})
            if math.isfinite(res.fun) and res.fun < best_f:
                best_x, best_f = full(res.x, starts[i]), float(res.fun)
    if best_x is None:
        raise ValueError(f"the {form} fit did not converge from any start (non-finite "
                         "objective): check the runs' losses")
    return Fitted(Law(form, spec.constants(best_x)), best_x, best_f)


def rms_residual(law: Law, n, d, loss) -> float:
    """The rms of measured / fitted - 1 over the runs: how well the law describes them."""
    loss = np.asarray(loss, float)
    return float(np.sqrt(np.mean((loss / law.predict(n, d) - 1.0) ** 2)))


def bootstrap(form: str, n, d, loss, start: np.ndarray, resamples: int, seed: int = 0,
              fixed: dict[str, float] | None = None, usable=None) -> list[Law]:
    """Refit on ``resamples`` resamples of the runs (with replacement), each from the
    full-data optimum ``start``; resamples the law cannot be fitted on (``usable(idx)``
    false, or no convergence) are dropped."""
    n, d, loss = (np.asarray(v, float) for v in (n, d, loss))
    rng = np.random.default_rng(seed)
    laws = []
    for _ in range(resamples):
        idx = rng.integers(0, len(loss), len(loss))
        if usable is not None and not usable(idx):
            continue
        try:
            laws.append(fit(form, n[idx], d[idx], loss[idx], keep=1, starts=start[None, :],
                            fixed=fixed).law)
        except (ValueError, FloatingPointError):
            continue
    return laws


def refine_exponent(objective, lo: float, hi: float) -> tuple[float, float]:
    """(x, objective(x)) at the minimum of a one-exponent objective in [lo, hi]: bounded
    Brent, started nowhere random (analysis/optimal.py's frontier)."""
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(objective, bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-10})
    return float(res.x), float(res.fun)


def refine_exponents(objective, start: np.ndarray, simplex: np.ndarray
                     ) -> tuple[np.ndarray, float]:
    """(x, objective(x)) at a minimum of a two-exponent objective: Nelder-Mead from a given
    simplex (analysis/optimal.py's L(N, D) by variable projection)."""
    from scipy.optimize import minimize

    res = minimize(objective, start, method="Nelder-Mead",
                   options={"initial_simplex": simplex, "xatol": 1e-9, "fatol": 1e-16,
                            "maxiter": 4000, "maxfev": 8000})
    return np.asarray(res.x, float), float(res.fun)
