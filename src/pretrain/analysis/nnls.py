"""Non-negative least squares of relative residuals for tiny linear models, many at once, by
hand: the variable-projection step of the compute-optimal fits (analysis/optimal.py).

A model is y ~ sum_j c_j col_j with every c_j >= 0 (a floor and scale constants); the
objective is sum_i ((model_i - y_i) / y_i)^2. For each of G rows (one per point of a grid of
exponents) the best non-negative coefficients are the best feasible solution over the
model's active sets (every non-empty subset of the columns: at most 7 for three), each the
unconstrained solution of its normal equations. Those are solved by Gaussian elimination
written out here, and every sum is numpy's pairwise reduction of an elementwise product:
no BLAS or LAPACK call, so the answer is the same bit for bit whichever kernels OpenBLAS
picks on this CPU.
"""

from __future__ import annotations

import itertools

import numpy as np


def _eliminate(m: list, v: list, p: int) -> None:
    """Zero column ``p`` below the diagonal (rows of G systems at once), in place."""
    k = len(v)
    for r in range(p + 1, k):
        f = m[r][p] / m[p][p]
        for j in range(p, k):
            m[r][j] = m[r][j] - f * m[p][j]
        v[r] = v[r] - f * v[p]


def solve_small(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Solve m x = v for G systems of k <= 3 unknowns (m: k x k x G, v: k x G) by Gaussian
    elimination without pivoting (m is a Gram matrix: symmetric, positive where the columns
    are independent); singular systems give non-finite rows."""
    k = len(v)
    m = [[m[i][j].copy() for j in range(k)] for i in range(k)]
    v = [v[i].copy() for i in range(k)]
    x = [np.zeros_like(v[0]) for _ in range(k)]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for p in range(k):
            _eliminate(m, v, p)
        for p in reversed(range(k)):
            acc = v[p]
            for j in range(p + 1, k):
                acc = acc - m[p][j] * x[j]
            x[p] = acc / m[p][p]
    return np.array(x)


def best_subset_fit(cols: list[np.ndarray], y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coefficients k x G, objective G): per row, the non-negative coefficients of the
    columns (each G x m) minimising the sum of squared relative residuals against y (m),
    and that sum; rows where no active set is feasible get an infinite objective."""
    y = np.asarray(y, float)
    w = 1.0 / y
    scaled = [c * w for c in cols]                  # the model / y, column by column
    ones = np.ones_like(y)
    g = len(cols[0])
    best_x = np.zeros((len(cols), g))
    best_f = np.full(g, np.inf)
    for size in range(1, len(cols) + 1):
        for active in itertools.combinations(range(len(cols)), size):
            gram = [[np.sum(scaled[i] * scaled[j], axis=-1) for j in active] for i in active]
            rhs = np.array([np.sum(scaled[i] * ones, axis=-1) for i in active])
            x = solve_small(np.array(gram), rhs)
            with np.errstate(invalid="ignore", over="ignore"):
                resid = sum(x[a][:, None] * scaled[i] for a, i in enumerate(active)) - 1.0
                f = np.sum(resid * resid, axis=-1)
                ok = np.all(np.isfinite(x), axis=0) & np.all(x >= 0, axis=0) & np.isfinite(f)
            better = ok & (f < best_f)
            best_f = np.where(better, f, best_f)
            for a, i in enumerate(active):
                best_x[i] = np.where(better, x[a], best_x[i])
            for i in set(range(len(cols))) - set(active):
                best_x[i] = np.where(better, 0.0, best_x[i])
    return best_x, best_f
