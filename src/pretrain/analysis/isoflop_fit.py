"""The budgets of an iso-FLOP sweep and each one's optimum (Hoffmann et al. 2022's approach
2, step one): a parabola in log N through the losses of a budget's runs, its vertex the
budget's (N*, L*). Fitted by hand (centred normal equations, analysis/nnls.solve_small), not
by ``np.polyfit``'s LAPACK call, so the vertex is the same under any BLAS kernels.

A budget is a ``budget`` column's value where the table gives one (the nominal FLOPs of the
group, as the paper names it), else runs whose C = 6 N D agree within 10%
(analysis/scaling.isoflop_groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.analysis.nnls import solve_small
from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import isoflop_groups

MIN_SIZES = 3


@dataclass(frozen=True)
class Budget:
    """One budget of a sweep: its FLOPs, its runs (by size), the best of them, and the
    parabola's vertex (N*, L*), or why there is none."""

    flops: float
    runs: tuple[RunPoint, ...]
    n_opt: float = math.nan
    loss: float = math.nan
    problem: str | None = None

    @property
    def best(self) -> RunPoint:
        return min(self.runs, key=lambda p: p.loss)


def nominal(group: Sequence[RunPoint]) -> float:
    """A group's budget: its ``budget`` column where every run has one, else the geometric
    mean of its runs' C."""
    values = [p.fields.get("budget") for p in group]
    if all(values):
        return float(values[0])
    return float(np.exp(np.mean(np.log([p.flops for p in group]))))


def groups(points: Sequence[RunPoint]) -> list[list[RunPoint]]:
    """Runs by budget, smallest first, each by size."""
    if points and all(p.fields.get("budget") for p in points):
        by: dict[float, list[RunPoint]] = {}
        for p in points:
            by.setdefault(float(p.fields["budget"]), []).append(p)
        return [sorted(by[c], key=lambda p: p.n_params) for c in sorted(by)]
    return isoflop_groups(points)


def parabola_minimum(group: Sequence[RunPoint]) -> tuple[float, float] | str:
    """(N*, L*) at the vertex of the least-squares parabola in log N through the runs'
    losses, or why there is none: fewer than 3 sizes, a parabola that opens downward, a
    vertex outside the sizes run (the valley lies beyond them)."""
    if len({p.n_params for p in group}) < MIN_SIZES:
        return f"fewer than {MIN_SIZES} sizes"
    x = np.log([p.n_params for p in group])
    xm = float(np.mean(x))
    x = x - xm
    y = np.array([p.loss for p in group])
    powers = [np.ones_like(x), x, x * x]
    gram = np.array([[[np.sum(powers[i] * powers[j])] for j in range(3)] for i in range(3)])
    rhs = np.array([[np.sum(powers[i] * y)] for i in range(3)])
    k0, k1, k2 = (float(v[0]) for v in solve_small(gram, rhs))
    if not k2 > 0:
        return "the parabola in log N opens downward: no valley among these sizes"
    xv = -k1 / (2 * k2)
    if not x.min() <= xv <= x.max():
        return (f"the vertex, N = {math.exp(xm + xv):.3g}, lies outside the sizes run "
                f"({math.exp(xm + x.min()):.3g}..{math.exp(xm + x.max()):.3g})")
    return math.exp(xm + xv), k0 - k1 * k1 / (4 * k2)


def budgets(points: Sequence[RunPoint]) -> list[Budget]:
    """Every budget of at least 3 runs, with its vertex or the reason it has none."""
    out = []
    for g in groups(points):
        if len(g) < MIN_SIZES:
            continue
        found = parabola_minimum(g)
        if isinstance(found, str):
            out.append(Budget(nominal(g), tuple(g), problem=found))
        else:
            out.append(Budget(nominal(g), tuple(g), found[0], found[1]))
    return out


def usable(found: Sequence[Budget]) -> list[Budget]:
    """The budgets with a vertex."""
    return [b for b in found if b.problem is None]
