"""The backtest a ladder passes before it predicts: fit the runs at or under 1/R of the
largest compute, predict the rest, for each candidate of the fit policy (analysis/policy.py;
issues 55 and 61, docs/ladder/README.md).

Why: a held-out run at R x the ladder's largest compute is an extrapolation by R; the ladder
can make that same extrapolation on itself, from its bottom rungs to its top ones, with no
extra runs. A ladder whose law cannot do that within the tolerance (2%) cannot be trusted to
do it once more beyond its top: the byte ladder of issue 48 predicted its own top rungs 19%
high from 30x below, and then missed its held-out run by 10.4%. Choosing the form by
leaving out one size (1.4x in N) says nothing about 30x; choosing it by this test does, and
never by the held-out run.

The top rungs are the predicted runs within 2x of the largest compute: the runs R/2..R above
what was fitted, which is the extrapolation a held-out run at R makes. The verdict is on
their mean absolute error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.analysis.policy import (
    TOLERANCE,
    TOP_SPAN,
    Candidate,
    candidates,
    degenerate,
    fittable,
)
from pretrain.analysis.runs import RunPoint

__all__ = ["Backtest", "FormResult", "backtest", "max_ratio", "fittable", "TOLERANCE"]

# a run within 0.1% of a cut is at it: grids put runs at exact factors of 2 of the top, and a
# cut that splits them by the last bits of 6ND moves a run across it (issue 68's jitter did)
CUT_TOLERANCE = 1e-3


def max_ratio(flops: Sequence[float], sizes: Sequence[float] | None = None,
              tokens: Sequence[float] | None = None) -> float:
    """The largest R at which the backtest can be run on runs of these computes (and sizes
    and tokens, when given): the fit below C_max / R must stay fittable."""
    c = np.asarray(flops, float)
    if sizes is None or tokens is None:
        pts = [RunPoint("", 1.0, 1.0 + i, x, 1.0) for i, x in enumerate(c)]
    else:
        pts = [RunPoint("", n, t, x, 1.0) for n, t, x in zip(sizes, tokens, c, strict=True)]
    top = float(c.max())
    best = 1.0
    for x in sorted(set(c.tolist())):
        fit = [p for p in pts if p.flops <= x * (1 + CUT_TOLERANCE)]
        rest = [p for p in pts if p.flops > x * (1 + CUT_TOLERANCE)]
        if rest and fittable(fit):
            best = max(best, top / x)
    return best


@dataclass
class FormResult:
    """One candidate at one ratio: its errors on every predicted run and the top rungs."""

    candidate: Candidate
    fitted: int
    errors: list[tuple[RunPoint, float]]   # each predicted run: predicted / measured - 1
    top: list[tuple[RunPoint, float]]      # the top rungs among them
    problem: str | None = None
    degenerate: str | None = None          # why the fit is degenerate (policy.degenerate)

    @property
    def form(self) -> str:
        return self.candidate.name

    @property
    def top_mean(self) -> float:
        return float(np.mean([e for _, e in self.top])) if self.top else math.nan

    @property
    def top_mae(self) -> float:
        return float(np.mean([abs(e) for _, e in self.top])) if self.top else math.nan

    @property
    def mae(self) -> float:
        return float(np.mean([abs(e) for _, e in self.errors])) if self.errors else math.nan

    def as_dict(self) -> dict:
        return {"candidate": self.candidate.name, "fitted_runs": self.fitted,
                "problem": self.problem, "degenerate": self.degenerate, "top_mean": self.top_mean,
                "top_mean_abs": self.top_mae, "mean_abs": self.mae,
                "runs": [{"name": p.name, "n_params": p.n_params, "tokens": p.tokens,
                          "flops": p.flops, "loss": p.loss, "error": e,
                          "top": any(q is p for q, _ in self.top)} for p, e in self.errors]}


@dataclass
class Backtest:
    ratio: float
    cut: float                  # the largest compute fitted: C_max / ratio
    results: list[FormResult]
    tolerance: float = TOLERANCE

    @property
    def best(self) -> FormResult | None:
        ok = [r for r in self.results if r.problem is None and r.top]
        return min(ok, key=lambda r: r.top_mae) if ok else None

    @property
    def supported(self) -> bool:
        return self.best is not None and self.best.top_mae <= self.tolerance

    def as_dict(self) -> dict:
        best = self.best
        return {"ratio": self.ratio, "cut_flops": self.cut, "tolerance": self.tolerance,
                "best": best.form if best else None, "supported": self.supported,
                "candidates": [r.as_dict() for r in self.results]}


def split(points: Sequence[RunPoint], ratio: float) -> tuple[list[RunPoint], list[RunPoint]]:
    """(fitted, predicted): the runs at or under 1/ratio of the largest compute, the rest."""
    cut = max(p.flops for p in points) / ratio * (1 + CUT_TOLERANCE)
    return ([p for p in points if p.flops <= cut],
            sorted((p for p in points if p.flops > cut), key=lambda p: p.flops))


def backtest(points: Sequence[RunPoint], ratio: float,
             candidates_: Sequence[Candidate] | None = None,
             tolerance: float = TOLERANCE, noise: float = math.nan) -> Backtest:
    """Fit each candidate to the runs with C <= C_max / ratio, predict the others; each
    fit also judged by policy.degenerate (``noise``: the seed spread, where measured)."""
    if ratio <= 1:
        raise ValueError(f"--backtest {ratio:g}: the ratio must be above 1")
    top_c = max(p.flops for p in points)
    fit, rest = split(points, ratio)
    if not rest or not fittable(fit):
        can = max_ratio([p.flops for p in points], [p.n_params for p in points],
                        [p.tokens for p in points])
        raise ValueError(f"--backtest {ratio:g}: {len(fit)} runs at or under C = "
                         f"{top_c / ratio:.3g} (1/{ratio:g} of the largest, {top_c:.3g}); "
                         "L(N, D) needs 6+ runs of 2+ sizes and 2+ tokens/param there. These "
                         f"runs allow a backtest up to {can:.3g}x")
    results = []
    top_rungs = [p for p in rest if p.flops >= top_c / TOP_SPAN * (1 - CUT_TOLERANCE)]
    for cand in candidates_ if candidates_ is not None else candidates(points):
        results.append(_result(cand, fit, rest, top_rungs, noise))
    return Backtest(ratio, top_c / ratio, results, tolerance)


def _result(cand: Candidate, fit: list[RunPoint], rest: list[RunPoint],
            top_rungs: list[RunPoint], noise: float) -> FormResult:
    """One candidate fitted under the cut and scored on the runs above it. A data-regime
    candidate (one fit per bound, policy.Candidate.groups) scores the top rungs whose regime
    the cut leaves fittable and not degenerate, if any: the ratios are set by the other
    candidates, and a regime too thin under a cut says nothing of the regime of the targets."""
    groups, fitted, problem, why = [], 0, None, None
    for kept, targets in cand.groups(fit, top_rungs if cand.regime else rest):
        fitted = max(fitted, len(kept))
        if not fittable(kept):
            problem = problem or f"{len(kept)} runs left under the cut: not fittable"
            continue
        try:
            law = cand.fit_runs(kept).law
        except ValueError as e:
            problem = problem or str(e)
            continue
        bad = degenerate(law, kept, cand.count, noise)
        why = why or bad
        groups.append((law, targets, bad))
    if cand.regime:    # no degenerate fit of a thin regime refuses it: it has no score here
        groups, why = [g for g in groups if g[2] is None], None
        problem = None if groups else (problem or "every regime under the cut is degenerate")
    elif problem:
        groups = []
    if not groups:
        return FormResult(cand, fitted, [], [], problem=problem)
    errs = sorted(((p, cand.predict(law, p) / p.loss - 1.0) for law, ts, _ in groups
                   for p in ts), key=lambda pe: pe[0].flops)
    top = [(p, e) for p, e in errs if any(p is q for q in top_rungs)]
    return FormResult(cand, fitted, errs, top, degenerate=why)
