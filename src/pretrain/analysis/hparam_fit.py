"""Fitting the hyperparameter laws of hparams.py to a user's own sweep: the best LR and
batch of each compute budget, then a power law in C through them (``tools/scaling_law.py
--hparams``). Analysis only: training never imports it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.analysis.runs import finished_runs
from pretrain.budget.hparams import HparamLaws, PowerLaw


@dataclass(frozen=True)
class SweepPoint:
    compute: float  # C = M x D
    lr: float
    batch_tokens: float
    loss: float
    name: str = ""


@dataclass(frozen=True)
class BudgetOptimum:
    compute: float
    lr: float
    batch_tokens: float
    loss: float
    how: str  # "quadratic" (smoothed) or "grid" (the best run)
    runs: int
    # "lr" / "batch" when the optimum is the grid's smallest or largest value of that axis:
    # the true optimum may lie outside the grid
    edges: tuple[str, ...] = ()


def collect_sweep(root: Path | str) -> list[SweepPoint]:
    """Every finished run under ``root`` (``result.json`` with a finite final validation
    loss, ``plan.json`` beside it): its C (the plan's ``hparam_compute``), peak LR, global
    batch in tokens and loss."""
    points = []
    for run_dir, plan, result in finished_runs(root):
        if "hparam_compute" not in plan:
            continue  # written before plans recorded C
        loss = result["final_val_loss"]
        points.append(SweepPoint(compute=float(plan["hparam_compute"]), lr=float(plan["lr"]),
                                 batch_tokens=float(plan["global_batch_tokens"]),
                                 loss=float(loss), name=str(run_dir.name)))
    return points


def group_by_compute(points: Iterable[SweepPoint], rel: float = 1e-3) -> list[list[SweepPoint]]:
    groups: list[list[SweepPoint]] = []
    for p in sorted(points, key=lambda p: p.compute):
        if groups and abs(p.compute / groups[-1][0].compute - 1) <= rel:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def best_of_budget(points: Sequence[SweepPoint]) -> BudgetOptimum:
    """The optimum of one budget's grid: the minimum of a quadratic in (log lr, log batch)
    fitted by least squares to the runs (a smoothed best-of-grid: grid noise moves it less
    than it moves the argmin), kept when the quadratic is convex and its minimum lies inside
    the grid's range; else the best run. An axis with fewer than 3 values is left out of the
    quadratic."""
    pts = [p for p in points if math.isfinite(p.loss)]
    if not pts:
        raise ValueError("no finite loss in this budget")
    best = min(pts, key=lambda p: p.loss)
    edges = tuple(name for name, v, vals in (
        ("lr", best.lr, [p.lr for p in pts]),
        ("batch", best.batch_tokens, [p.batch_tokens for p in pts]))
        if len(set(vals)) > 1 and v in (min(vals), max(vals)))
    grid = BudgetOptimum(best.compute, best.lr, best.batch_tokens, best.loss, "grid", len(pts),
                         edges)
    x = np.log([p.lr for p in pts])
    y = np.log([p.batch_tokens for p in pts])
    z = np.array([p.loss for p in pts])
    axes = [a for a in (x, y) if len(np.unique(np.round(a, 9))) >= 3]
    if not axes:
        return grid
    cols = [np.ones_like(z)] + axes + [a * a for a in axes]
    if len(axes) == 2:
        cols.append(axes[0] * axes[1])
    design = np.stack(cols, axis=1)
    if len(z) <= design.shape[1]:
        return grid
    coef, *_ = np.linalg.lstsq(design, z, rcond=None)
    k = len(axes)
    g = coef[1:1 + k]
    h = np.diag(2 * coef[1 + k:1 + 2 * k])
    if k == 2:
        h[0, 1] = h[1, 0] = coef[-1]
    if np.any(np.linalg.eigvalsh(h) <= 0):
        return grid
    opt = np.linalg.solve(h, -g)
    for a, o in zip(axes, opt, strict=True):
        if not a.min() <= o <= a.max():  # no extrapolation beyond the grid
            return grid
    values = {id(x): best.lr, id(y): best.batch_tokens}
    for a, o in zip(axes, opt, strict=True):
        values[id(a)] = float(math.exp(o))
    loss = float(coef[0] + g @ opt + 0.5 * opt @ h @ opt)
    return BudgetOptimum(best.compute, values[id(x)], values[id(y)], loss, "quadratic",
                         len(pts))  # an interior minimum: no edge


def fit_power_law(compute: Sequence[float], values: Sequence[float]) -> PowerLaw:
    """Least squares of log value on log C: value = coef * C^exponent."""
    if len(compute) < 2 or len(set(compute)) < 2:
        raise ValueError("a power law needs optima at 2 or more compute budgets")
    b, a = np.polyfit(np.log(compute), np.log(values), 1)
    return PowerLaw(float(math.exp(a)), float(b))


def fit_hparam_laws(points: Iterable[SweepPoint]) -> tuple[HparamLaws, list[BudgetOptimum]]:
    """The optimum of every budget (``best_of_budget``), then lr(C) and batch(C)."""
    optima = [best_of_budget(g) for g in group_by_compute(points)]
    c = [o.compute for o in optima]
    laws = HparamLaws(lr=fit_power_law(c, [o.lr for o in optima]),
                      batch_tokens=fit_power_law(c, [o.batch_tokens for o in optima]),
                      source=f"fitted to {len(optima)} budgets")
    return laws, optima


def override_line(laws: HparamLaws) -> str:
    """The command-line overrides that make a recipe use these laws."""
    return (f"optim.lr_rule=power 'optim.lr_law=[{laws.lr.coef:.6g},{laws.lr.exponent:.6g}]' "
            f"train.batch_rule=power 'train.batch_law=[{laws.batch_tokens.coef:.6g},"
            f"{laws.batch_tokens.exponent:.6g}]'")
