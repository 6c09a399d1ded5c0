"""The compute-optimal loss of a budget C = 6 N D, and N and D there (issue 68, part 4): what
an iso-FLOP sweep exists to answer.

Two ways, both Hoffmann et al. 2022's:

- **approach 2** (``Frontier``): at each budget of the sweep, a parabola in log N through its
  runs' losses; its vertex is that budget's optimum (N*, L*). Then the frontier
  L*(C) = E + a C^-b through the vertices, and N*(C) = k C^p through their sizes (a line in
  log-log); D*(C) = C / (6 N*(C)).
- **approach 3** (``Surface``): L(N, D) = E + A/N^alpha + B/D^beta fitted to every run, and
  its minimum along 6 N D = C (``ChinchillaLaw.optimal``, their eq. 4).

Which one answers is chosen by a backtest of the same kind the fit policy runs
(analysis/prediction.py): fit each below a cut of the sweep's budgets and predict the best
run of each budget above it; the score is the mean over cuts of the top budgets' mean
|error|. A ladder that is not an iso-FLOP sweep has no approach 2; approach 3 is then scored
on its top rungs (the runs within 2x of its largest compute). Where neither is usable the
answer is a refusal, never a number.

Determined fits. Every fit here is linear in its scale constants once its exponents are
fixed (variable projection): for each exponent on a fixed grid the scale constants are the
non-negative least-squares solution of relative residuals, solved in closed form over each
active set; the best grid point is refined by Brent's method (one exponent) or Nelder-Mead
(two). The sums are numpy's pairwise reductions of elementwise products and the small
systems are solved by hand, never by a BLAS or LAPACK call, so the answer does not depend on
which OpenBLAS kernels the CPU picks (``OPENBLAS_CORETYPE``), and the grid start does not
depend on a random draw. The bootstrap resamples runs within each budget from a fixed seed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.analysis.fitting import refine_exponent, refine_exponents
from pretrain.analysis.isoflop_fit import Budget, budgets, parabola_minimum
from pretrain.analysis.nnls import best_subset_fit
from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import ChinchillaLaw
from pretrain.budget.compute import FLOPS_PER_PARAM_TOKEN

__all__ = ["Budget", "budgets", "parabola_minimum", "Frontier", "Surface", "fit_frontier",
           "fit_surface"]

FRONTIER_B = np.geomspace(0.003, 1.5, 400)       # the grid of L*(C)'s exponent b
SURFACE_GRID = np.linspace(0.02, 1.5, 38)        # the grid of alpha and of beta
EXPONENT_BOUNDS = (0.005, 3.0)


def _log_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of least squares y = k0 + k1 x, by hand (no BLAS)."""
    xm, ym = float(np.mean(x)), float(np.mean(y))
    sxx = float(np.sum((x - xm) * (x - xm)))
    k1 = float(np.sum((x - xm) * (y - ym))) / sxx if sxx > 0 else 0.0
    return ym - k1 * xm, k1


@dataclass(frozen=True)
class Frontier:
    """Approach 2: L*(C) = E + a (C/c_ref)^-b, log N*(C) = n0 + n1 log C."""

    e: float
    a: float
    b: float
    c_ref: float
    n0: float
    n1: float
    budgets: int

    def at(self, flops: float) -> tuple[float, float, float]:
        """(loss, N, D) at the optimum of budget ``flops``."""
        loss = self.e + self.a * (flops / self.c_ref) ** -self.b
        n = math.exp(self.n0 + self.n1 * math.log(flops))
        return loss, n, flops / (FLOPS_PER_PARAM_TOKEN * n)

    def constants(self) -> dict[str, float]:
        return {"E": self.e, "a": self.a * self.c_ref ** self.b, "b": self.b,
                "n_exponent": self.n1, "n_coefficient": math.exp(self.n0)}


def _frontier_sse(b: np.ndarray, x: np.ndarray, loss: np.ndarray):
    """Per exponent b: the best non-negative (E, a) of E + a x^-b and the sum of squared
    relative residuals."""
    cols = [np.ones((len(b), len(x))), x[None, :] ** -b[:, None]]
    return best_subset_fit(cols, loss)


def fit_frontier(found: Sequence[Budget]) -> Frontier:
    """Approach 2's frontier through the budgets' parabola minima."""
    if len(found) < 3:
        raise ValueError(f"the frontier has 3 constants: need 3 budgets with a minimum, got "
                         f"{len(found)}")
    c = np.array([f.flops for f in found])
    loss = np.array([f.loss for f in found])
    c_ref = float(np.exp(np.mean(np.log(c))))
    x = c / c_ref
    coef, sse = _frontier_sse(FRONTIER_B, x, loss)
    i = int(np.argmin(sse))
    lo, hi = FRONTIER_B[max(i - 1, 0)], FRONTIER_B[min(i + 1, len(FRONTIER_B) - 1)]
    best, value = refine_exponent(
        lambda b: float(_frontier_sse(np.array([b]), x, loss)[1][0]), lo, hi)
    b = best if value <= sse[i] else float(FRONTIER_B[i])
    coef, _ = _frontier_sse(np.array([b]), x, loss)
    e, a = float(coef[0, 0]), float(coef[1, 0])
    n0, n1 = _log_line(np.log(c), np.log([f.n_opt for f in found]))
    return Frontier(e, a, b, c_ref, n0, n1, len(found))


@dataclass(frozen=True)
class Surface:
    """Approach 3: the fitted L(N, D) and its optimum along 6 N D = C."""

    law: ChinchillaLaw

    def at(self, flops: float) -> tuple[float, float, float]:
        n, d = self.law.optimal(flops)
        return float(self.law.predict(n, d)), float(n), float(d)

    def constants(self) -> dict[str, float]:
        return dict(vars(self.law))


def _surface_sse(ab: np.ndarray, x: np.ndarray, y: np.ndarray, loss: np.ndarray):
    """Per (alpha, beta) row of ``ab``: the best non-negative (E, A, B) of
    E + A x^-alpha + B y^-beta and the sum of squared relative residuals."""
    cols = [np.ones((len(ab), len(x))), x[None, :] ** -ab[:, :1], y[None, :] ** -ab[:, 1:]]
    return best_subset_fit(cols, loss)


def fit_surface(n: Sequence[float], d: Sequence[float], loss: Sequence[float],
                start: tuple[float, float] | None = None) -> Surface:
    """Approach 3's L(N, D) by variable projection: the (alpha, beta) grid, then Nelder-Mead
    from its best point (or from ``start``, the full data's exponents: the bootstrap);
    N and D scaled by their geometric means (the fit's conditioning does not depend on
    units)."""
    n, d, loss = (np.asarray(v, float) for v in (n, d, loss))
    if len(loss) < 6:
        raise ValueError(f"L(N, D) has 5 constants: need at least 6 runs, got {len(loss)}")
    n_ref, d_ref = float(np.exp(np.mean(np.log(n)))), float(np.exp(np.mean(np.log(d))))
    x, y = n / n_ref, d / d_ref
    grid = (np.array(list(itertools.product(SURFACE_GRID, SURFACE_GRID))) if start is None
            else np.array([start], float))
    _, sse = _surface_sse(grid, x, y, loss)
    i = int(np.argmin(sse))
    lo, hi = EXPONENT_BOUNDS

    def objective(ab: np.ndarray) -> float:
        if not (lo <= ab[0] <= hi and lo <= ab[1] <= hi):
            return math.inf
        return float(_surface_sse(ab[None, :], x, y, loss)[1][0])

    step = SURFACE_GRID[1] - SURFACE_GRID[0]
    simplex = grid[i] + np.array([[0.0, 0.0], [step / 2, 0.0], [0.0, step / 2]])
    best, value = refine_exponents(objective, grid[i], simplex)
    ab = best if value <= sse[i] else grid[i]
    coef, _ = _surface_sse(np.asarray(ab, float)[None, :], x, y, loss)
    e, a, b = (float(v) for v in coef[:, 0])
    alpha, beta = float(ab[0]), float(ab[1])
    return Surface(ChinchillaLaw(E=e, A=a * n_ref ** alpha, B=b * d_ref ** beta, alpha=alpha,
                                 beta=beta))


def surface_of(points: Sequence[RunPoint], start: tuple[float, float] | None = None
               ) -> Surface:
    """Approach 3 fitted to these runs."""
    return fit_surface([p.n_params for p in points], [p.tokens for p in points],
                       [p.loss for p in points], start)
