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
BASIN = 2    # sizes each side of a budget's best run that its parabola goes through


@dataclass(frozen=True)
class Budget:
    """One budget of a sweep: its FLOPs, its runs (by size), the best of them, its basin (the
    best and up to ``BASIN`` sizes each side), and the parabola's vertex (N*, L*) through
    the basin, or why there is none."""

    flops: float
    runs: tuple[RunPoint, ...]
    basin: tuple[RunPoint, ...] = ()
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


def basin(group: Sequence[RunPoint], width: int = BASIN) -> list[RunPoint]:
    """The best run of a budget (at each size, its lowest loss) and up to ``width`` sizes on
    each side: the valley a parabola describes. The far wings (a tenth of a token per
    parameter, a thousand) rise steeply and would pull a parabola through every run off the
    valley: on Porian et al.'s tuned grid its vertex lands 3.6% below every run."""
    by_size: dict[float, RunPoint] = {}
    for p in group:
        if p.n_params not in by_size or p.loss < by_size[p.n_params].loss:
            by_size[p.n_params] = p
    sizes = sorted(by_size)
    i = min(range(len(sizes)), key=lambda k: by_size[sizes[k]].loss)
    return [by_size[n] for n in sizes[max(i - width, 0):i + width + 1]]


def budgets(points: Sequence[RunPoint]) -> list[Budget]:
    """Every budget of at least 3 runs, with its basin and vertex or the reason it has
    none."""
    out = []
    for g in groups(points):
        if len(g) < MIN_SIZES:
            continue
        valley = tuple(basin(g))
        found = parabola_minimum(valley)
        if isinstance(found, str):
            out.append(Budget(nominal(g), tuple(g), valley, problem=found))
        else:
            out.append(Budget(nominal(g), tuple(g), valley, found[0], found[1]))
    return out


def usable(found: Sequence[Budget]) -> list[Budget]:
    """The budgets with a vertex."""
    return [b for b in found if b.problem is None]
