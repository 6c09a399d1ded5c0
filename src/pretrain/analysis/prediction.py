"""Predict beyond a ladder by the fit policy (analysis/policy.py): backtest every candidate at
every ratio the ladder allows, choose the one that predicts the ladder's own top rungs best,
refuse degenerate fits, and predict each target with an interval widened by the chosen
candidate's backtest error.

The ratios are 2^(k/2) = 2, 2.8, 4, 5.7, 8, ... up to the largest at which every candidate
can still be fitted below the cut (a filter that drops runs can make a candidate unfittable
sooner): each candidate is scored on the same extrapolations. The score is the mean over
those ratios of the top rungs' mean |error|: a candidate is chosen for carrying the ladder
from near and from far, not for one lucky ratio.

The interval: the bootstrap's 95% interval of the chosen candidate (resampled runs), widened
in quadrature by its backtest score, the error the ladder showed it makes when it
extrapolates. Both are stated, with the interval's width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pretrain.analysis.backtest import Backtest, backtest, split
from pretrain.analysis.fitting import bootstrap
from pretrain.analysis.laws import Law
from pretrain.analysis.policy import Candidate, candidates, degenerate, fittable
from pretrain.analysis.runs import RunPoint

MAX_RATIO_STEPS = 12     # 2^(12/2) = 64: beyond it the fitted part is a handful of runs
# the chosen candidate's backtest score above which the ladder is refused, not predicted: a
# ladder that misses its own top rungs by that much cannot carry its law further (chosen
# leave-one-ladder-out between 5% and 10%: tools/leave_one_out.py)
REFUSE_SCORE = 0.10


@dataclass
class Scored:
    """A candidate, its backtest score (mean over ratios of the top rungs' mean |error|),
    its fit to the whole ladder and why it was refused, if it was."""

    candidate: Candidate
    by_ratio: dict[float, float]          # ratio -> top rungs' mean |error|
    signed: dict[float, float]            # ratio -> top rungs' mean error
    law: Law | None = None
    theta: np.ndarray | None = None
    refused: str | None = None

    @property
    def score(self) -> float:
        v = list(self.by_ratio.values())
        return float(np.mean(v)) if v else math.nan

    def as_dict(self) -> dict:
        return {"candidate": self.candidate.name, "form": self.candidate.form,
                "count": self.candidate.count, "min_tokens_per_param": self.candidate.min_tpp,
                "score": self.score, "by_ratio": self.by_ratio, "signed": self.signed,
                "law": self.law.as_dict() if self.law else None, "refused": self.refused}


@dataclass
class Choice:
    """What the policy chose on a ladder, and the whole table it chose from."""

    ratios: list[float]
    scored: list[Scored]
    chosen: Scored | None
    backtests: list[Backtest] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ratios": self.ratios, "candidates": [s.as_dict() for s in self.scored],
                "chosen": self.chosen.as_dict() if self.chosen else None}


def ratios(points: Sequence[RunPoint], cands: Sequence[Candidate]) -> list[float]:
    """2^(k/2), k = 2, 3, ...: each ratio at which every candidate can still be fitted
    below the cut (the data-regime candidates aside: they score the top rungs they can),
    one per distinct cut (two ratios that fit the same runs are one test, not two)."""
    out, seen = [], set()
    for k in range(2, MAX_RATIO_STEPS + 1 if cands else 0):
        r = 2 ** (k / 2)
        fit, rest = split(points, r)
        if not rest or not all(fittable(c.runs(fit)) for c in cands if not c.regime):
            break
        if len(fit) not in seen:
            seen.add(len(fit))
            out.append(r)
    return out


def choose(points: Sequence[RunPoint], cands: Sequence[Candidate] | None = None,
           noise: float = math.nan, targets: Sequence[RunPoint] = ()) -> Choice:
    """Fit every candidate to ``points`` (the ladder) and refuse the degenerate ones;
    backtest the rest at every ratio all of them allow; refuse those whose fit turns
    degenerate under a cut; choose the best score among the others. The ``targets``, where
    known, offer the data-regime candidates (policy.Candidate.regime): each is fitted once
    per bound, its law the one of the last bound (the most runs)."""
    scored = []
    for cand in cands if cands is not None else candidates(points, targets=targets):
        s = Scored(cand, {}, {})
        try:
            for kept, _ in cand.groups(points, targets):
                fitted = cand.fit_runs(kept)
                s.law, s.theta = fitted.law, fitted.theta
                s.refused = s.refused or degenerate(s.law, kept, cand.count, noise)
        except ValueError as e:
            s.refused = f"not fitted: {e}"
        scored.append(s)
    live = [s for s in scored if s.refused is None]
    rs = ratios(points, [s.candidate for s in live])
    bts = [backtest(points, r, [s.candidate for s in live], noise=noise) for r in rs]
    for i, s in enumerate(live):
        results = [bt.results[i] for bt in bts]
        s.by_ratio = {bt.ratio: r.top_mae for bt, r in zip(bts, results, strict=True) if r.top}
        s.signed = {bt.ratio: r.top_mean for bt, r in zip(bts, results, strict=True) if r.top}
        # a form that turns degenerate when the ladder is cut would do so in an
        # extrapolation of that distance too: refused, with the first ratio it failed at
        failed = [(bt.ratio, r) for bt, r in zip(bts, results, strict=True) if r.degenerate]
        if failed:
            r, res = failed[0]
            s.refused = (f"fitted to the {res.fitted} runs under 1/{r:.3g} of the top, "
                         + res.degenerate)
        elif not rs:
            s.refused = "the ladder is too short to backtest (no ratio leaves a fittable part)"
        elif 2 * len(s.by_ratio) < len(rs):
            s.refused = (f"its targets' data regime is fittable and not degenerate under "
                         f"{len(s.by_ratio)} of the {len(rs)} cuts: too few to judge it")
    return Choice(rs, scored, pick(scored), bts)


def refusal(choice: Choice, threshold: float = REFUSE_SCORE) -> str | None:
    """Why the ladder is refused rather than predicted, in one line, or None."""
    s = choice.chosen
    if s is None:
        return "every candidate was refused"
    if s.score > threshold:
        return (f"{s.candidate.name} misses the ladder's own top rungs by {100 * s.score:.1f}% "
                f"from below (over {100 * threshold:g}%)")
    return None


def pick(scored: Sequence[Scored]) -> Scored | None:
    """The candidate with the lowest score among those not refused, each scored on the
    ratios every one of them reached (a data-regime candidate may not reach the farthest:
    the others are then compared with it nearer too); the chosen one comes back with its
    score over those ratios. Ties go to the earlier candidate."""
    ok = [s for s in scored if s.refused is None and s.by_ratio]
    if not ok:
        return None
    common = set.intersection(*(set(s.by_ratio) for s in ok))
    if not common:
        return None
    trimmed = [replace(s, by_ratio={r: v for r, v in s.by_ratio.items() if r in common},
                       signed={r: v for r, v in s.signed.items() if r in common})
               for s in ok]
    return min(trimmed, key=lambda s: s.score)


@dataclass
class Prediction:
    """One target: the chosen law's loss there, its bootstrap interval and the interval
    widened by the backtest score; the measured loss and the error when it is known."""

    name: str
    n_params: float
    tokens: float
    loss: float
    bootstrap: tuple[float, float]
    interval: tuple[float, float]
    measured: float | None = None

    @property
    def error(self) -> float | None:
        return None if self.measured is None else self.loss / self.measured - 1.0

    @property
    def covered(self) -> bool | None:
        if self.measured is None:
            return None
        return self.interval[0] <= self.measured <= self.interval[1]

    @property
    def width(self) -> float:
        return (self.interval[1] - self.interval[0]) / self.loss

    def as_dict(self) -> dict:
        return {"name": self.name, "n_params": self.n_params, "tokens": self.tokens,
                "flops": 6 * self.n_params * self.tokens, "loss": self.loss,
                "bootstrap": list(self.bootstrap), "interval": list(self.interval),
                "width": self.width, "measured": self.measured, "error": self.error,
                "covered": self.covered}


def interval(value: float, samples: np.ndarray, score: float, noise: float
             ) -> tuple[tuple[float, float], tuple[float, float]]:
    """The one interval rule of every prediction (the fit policy's and --predict-optimal's):
    (the bootstrap's 95% percentiles, value x (1 +- rel)) with rel = the bootstrap's relative
    std, the backtest score and the seed spread in quadrature (a NaN term counts 0; under 10
    finite resamples the bootstrap adds nothing)."""
    samples = samples[np.isfinite(samples)]
    enough = len(samples) >= 10
    lo, hi = np.percentile(samples, [2.5, 97.5]) if enough else (value, value)
    spread = float(np.std(samples)) / value if enough else 0.0
    rel = math.hypot(spread, *(x if math.isfinite(x) else 0.0 for x in (score, noise)))
    return (float(lo), float(hi)), (value * (1 - rel), value * (1 + rel))


def predict(choice: Choice, points: Sequence[RunPoint], targets: Sequence[RunPoint],
            resamples: int = 100, seed: int = 0, noise: float = math.nan) -> list[Prediction]:
    """The chosen candidate at each target (a RunPoint: its loss is the measured one for a
    held-out run, NaN for a point to predict), with its intervals: the bootstrap's relative
    std, the backtest score and the seed spread ``noise`` (where measured) in quadrature."""
    s = choice.chosen
    if s is None or s.law is None:
        return []
    cand = s.candidate
    out = {}
    for runs, group in cand.groups(points, targets):
        law, theta = s.law, s.theta
        if cand.regime:    # this bound's own fit
            fitted = cand.fit_runs(runs)
            law, theta = fitted.law, fitted.theta
        n, d, loss = cand.arrays(runs)
        laws = []
        if resamples > 0:
            laws = bootstrap(cand.form, n, d, loss, theta, resamples, seed,
                             usable=lambda idx, runs=runs: fittable([runs[i] for i in idx]))
        for t in group:
            value = cand.predict(law, t)
            boot, wide = interval(value, np.array([cand.predict(x, t) for x in laws]),
                                  s.score, noise)
            measured = t.loss if math.isfinite(t.loss) else None
            out[id(t)] = Prediction(t.name, t.count(cand.count) or t.n_params, t.tokens,
                                    value, boot, wide, measured)
    return [out[id(t)] for t in targets]
