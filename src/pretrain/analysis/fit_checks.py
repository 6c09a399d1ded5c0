"""What a fit of L(N, D) can be trusted for: the seed spread (the noise floor), residuals,
each size left out and predicted by the rest, and the fit with E held fixed (whether the
runs identify the irreducible loss at all)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import ChinchillaLaw, Estimate, fit_chinchilla_law


def _same(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def seed_groups(points: Sequence[RunPoint]) -> list[list[RunPoint]]:
    """Runs of the same (N, D): the same size and budget trained again at another seed."""
    groups: list[list[RunPoint]] = []
    for p in points:
        for g in groups:
            if _same(g[0].n_params, p.n_params) and _same(g[0].tokens, p.tokens):
                g.append(p)
                break
        else:
            groups.append([p])
    return [g for g in groups if len(g) > 1]


def seed_spread(points: Sequence[RunPoint]) -> tuple[float, int]:
    """The seed-to-seed spread of the loss: the pooled standard deviation of log loss within
    runs of the same (N, D) (a relative spread, 0.01 = 1%), and how many such groups. NaN
    when no run was repeated. No fit of these runs can predict a run more closely than this:
    the run itself would land elsewhere at another seed."""
    groups = seed_groups(points)
    if not groups:
        return math.nan, 0
    ss = sum(float(np.sum((np.log([p.loss for p in g]) - np.mean(np.log([p.loss for p in g])))
                          ** 2)) for g in groups)
    dof = sum(len(g) - 1 for g in groups)
    return math.sqrt(ss / dof), len(groups)


def with_seed_spread(est: Estimate, rel: float) -> Estimate:
    """A prediction's interval widened by the seed spread (in quadrature with the bootstrap
    std, the 95% interval at 1.96 of the combined std around the value where it is wider
    than the bootstrap's percentile interval)."""
    if not math.isfinite(rel) or rel <= 0:
        return est
    seed_std = rel * est.value
    std = math.hypot(est.std if math.isfinite(est.std) else 0.0, seed_std)
    low = min(est.low, est.value - 1.96 * std) if math.isfinite(est.low) else est.value - 1.96 * std
    high = (max(est.high, est.value + 1.96 * std) if math.isfinite(est.high)
            else est.value + 1.96 * std)
    return Estimate(est.value, std, low, high)


def residuals(law: ChinchillaLaw, points: Sequence[RunPoint]) -> list[tuple[RunPoint, float]]:
    """Each run and its relative residual, measured / fitted - 1."""
    return [(p, p.loss / float(law.predict(p.n_params, p.tokens)) - 1.0) for p in points]


def sizes_of(points: Sequence[RunPoint]) -> list[float]:
    """The distinct N of the runs, ascending."""
    out: list[float] = []
    for n in sorted(p.n_params for p in points):
        if not out or not _same(out[-1], n):
            out.append(n)
    return out


def leave_size_out(points: Sequence[RunPoint], size: float
                   ) -> tuple[ChinchillaLaw, list[tuple[RunPoint, float]]]:
    """L(N, D) fitted without the runs of one size, and that size's runs with their relative
    errors (predicted / measured - 1): the largest size left out is the ladder's own
    extrapolation test, one size further than the fit has seen."""
    rest = [p for p in points if not _same(p.n_params, size)]
    out = [p for p in points if _same(p.n_params, size)]
    law = fit_chinchilla_law([p.n_params for p in rest], [p.tokens for p in rest],
                             [p.loss for p in rest])
    return law, [(p, float(law.predict(p.n_params, p.tokens)) / p.loss - 1.0) for p in out]


def e_profile(points: Sequence[RunPoint], fractions: Sequence[float] = (0.0, 0.25, 0.5, 0.75)
              ) -> list[tuple[float, ChinchillaLaw, float]]:
    """L(N, D) refitted with E held at each fraction of the lowest loss: (E, law, rms of the
    relative residuals). Where the rms barely moves while a prediction does, the runs do
    not identify E, and a prediction far beyond them is E's guess, not the runs' (the byte
    ladder: rms 2.5-2.7% for E = 0 to 0.7, its 30x prediction -11% to +2%)."""
    low = min(p.loss for p in points)
    n, d, l_arr = (np.array([getattr(p, k) for p in points])
                   for k in ("n_params", "tokens", "loss"))
    out = []
    for f in fractions:
        law = fit_chinchilla_law(n, d, l_arr, fixed_e=f * low)
        rms = float(np.sqrt(np.mean((l_arr / law.predict(n, d) - 1.0) ** 2)))
        out.append((f * low, law, rms))
    return out
