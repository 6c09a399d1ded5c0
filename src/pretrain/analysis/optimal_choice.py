"""Which approach answers the compute-optimal question on a ladder, chosen by its own
backtest, and the answer at each asked budget with its interval (analysis/optimal.py has the
two fits; tools/fit_optimal.py prints this).

The backtest, the same kind the fit policy runs (analysis/prediction.py): on an iso-FLOP
sweep, for each cut that leaves at least 4 budgets with a vertex below it (one cut per
distinct set of them, none more than 64x below the top), both approaches
are fitted to the runs of the budgets at or under the cut and predict the optimum of each
budget above it within 2x of the largest (the top budgets); the error is the prediction over
that budget's best run, less one. A ladder that is not an iso-FLOP sweep (no 4 budgets with a
vertex) has no approach 2; approach 3 is cut at 2^(k/2) of its largest compute and scored on
its top rungs (the L(N, D) it fitted at those runs' N and D). The score is the mean over cuts
of the top's mean |error|; the lower wins.

Refused, never printed as a number: approach 2 with fewer than 4 budgets with a vertex, a
frontier exponent b outside the measured range of language models, or its floor E at the
lowest optimum loss; approach 3 on runs that cannot separate N from D (all at one tokens per
parameter) or whose fit the fit policy calls degenerate (analysis/policy.degenerate).

The interval: the prediction times (1 +- s), s = the bootstrap's relative std (runs resampled
within each budget), the backtest score and the seed spread (where measured) in quadrature,
as the fit policy's (analysis/prediction.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pretrain.analysis.backtest import split
from pretrain.analysis.isoflop_fit import budgets, groups, usable
from pretrain.analysis.laws import Law
from pretrain.analysis.optimal import Frontier, Surface, fit_frontier, surface_of
from pretrain.analysis.policy import (
    EXPONENT_RANGE,
    FLOOR_MARGIN,
    MIN_FIT_RUNS,
    TOP_SPAN,
    degenerate,
    fittable,
)
from pretrain.analysis.prediction import interval
from pretrain.analysis.runs import RunPoint

APPROACHES = ("2", "3")
MIN_BUDGETS = 4    # the frontier's 3 constants and one budget to spare
MAX_CUT_STEPS = 12   # 2^(12/2) = 64, as the fit policy's


def fit_approach(which: str, points: Sequence[RunPoint],
                 start: tuple[float, float] | None = None) -> Frontier | Surface:
    """Approach ``which`` fitted to ``points`` (ValueError where it cannot be)."""
    if which == "2":
        return fit_frontier(usable(budgets(points)))
    return surface_of(points, start)


def refusal(which: str, points: Sequence[RunPoint], model: Frontier | Surface,
            noise: float = math.nan) -> str | None:
    """Why approach ``which``'s fit is not to be believed beyond its runs, or None
    (``noise``: the seed spread, where measured)."""
    lo, hi = EXPONENT_RANGE
    if isinstance(model, Frontier):
        found = usable(budgets(points))
        low = min(b.loss for b in found)
        if not lo <= model.b <= hi:
            return (f"the frontier's exponent b = {model.b:.3g} is outside [{lo:g}, {hi:g}], "
                    "where measured language models lie")
        if model.e >= low * (1 - FLOOR_MARGIN):
            return (f"the frontier's floor E = {model.e:.4g} is at its lowest optimum "
                    f"({low:.4g}): the budgets do not see a floor")
        return None
    tpp = np.log([p.tokens_per_param for p in points])
    if float(np.std(tpp)) < 0.1:
        return ("every run has about the same tokens per parameter: L(N, D) cannot tell N "
                "from D")
    return degenerate(Law("chinchilla", model.constants()), points, noise=noise)


def iso_structure(points: Sequence[RunPoint]) -> str | None:
    """Why the runs have no usable iso-FLOP structure for approach 2, or None."""
    found = budgets(points)
    ok = usable(found)
    if len(ok) >= MIN_BUDGETS:
        return None
    reasons: dict[str, int] = {}
    for b in found:
        if b.problem:
            key = b.problem.split(",")[0] if "vertex" in b.problem else b.problem
            reasons[key] = reasons.get(key, 0) + 1
    why = "; ".join(f"{k} at {v} budget(s)" for k, v in reasons.items())
    return (f"{len(ok)} budget(s) with an iso-FLOP minimum, approach 2 needs {MIN_BUDGETS}"
            + (f" ({why})" if why else " (no budget has 3 or more runs)"))


@dataclass
class Cut:
    """One cut of the backtest: the largest budget fitted and each approach's errors on the
    top budgets (or rungs) above it."""

    flops: float
    errors: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"cut_flops": self.flops, "errors": self.errors}


def _iso_cuts(points: Sequence[RunPoint], approaches: Sequence[str]) -> list[Cut]:
    gs = groups(points)
    found = budgets(points)
    top = max(b.flops for b in found)
    targets = [b for b in usable(found) if b.flops >= top / TOP_SPAN]
    cuts, seen = [], set()
    for j in range(1, len(gs)):
        below = [p for g in gs[:j] for p in g]
        ok = usable(budgets(below))
        # one cut per distinct set of vertices, none more than 64x below the top
        if len(ok) < MIN_BUDGETS or len(ok) in seen or top / ok[-1].flops > 2 ** (
                MAX_CUT_STEPS / 2):
            continue
        seen.add(len(ok))
        cut = Cut(ok[-1].flops)
        above = [b for b in targets if b.flops > cut.flops * (1 + 1e-9)]
        if not above:
            continue
        for which in approaches:
            cut.errors[which] = _errors(which, below, [(b.flops, b.best.loss) for b in above])
        cuts.append(cut)
    return cuts


def _errors(which: str, fit_set: Sequence[RunPoint], at: Sequence[tuple[float, float]]
            ) -> list[float]:
    try:
        model = fit_approach(which, fit_set)
    except ValueError:
        return [math.nan for _ in at]
    return [model.at(c)[0] / measured - 1.0 for c, measured in at]


def _rung_cuts(points: Sequence[RunPoint]) -> list[Cut]:
    """Approach 3 alone, on a ladder without budgets: its L(N, D) at the top rungs."""
    top = max(p.flops for p in points)
    cuts, seen = [], set()
    for k in range(2, MAX_CUT_STEPS + 1):
        below, rest = split(points, 2 ** (k / 2))
        if not rest or not fittable(below) or len(below) < MIN_FIT_RUNS:
            break
        if len(below) in seen:
            continue
        seen.add(len(below))
        try:
            law = surface_of(below).law
        except ValueError:
            continue
        tops = [p for p in rest if p.flops >= top / TOP_SPAN]
        cut = Cut(max(p.flops for p in below))
        cut.errors["3"] = [float(law.predict(p.n_params, p.tokens)) / p.loss - 1.0
                           for p in tops]
        cuts.append(cut)
    return cuts


def score(cuts: Sequence[Cut], which: str) -> float:
    """The mean over cuts of the top's mean |error|; NaN where no cut scored it."""
    per = [float(np.mean(np.abs(c.errors[which]))) for c in cuts
           if which in c.errors and c.errors[which]]
    per = [v for v in per if math.isfinite(v)]
    return float(np.mean(per)) if per else math.nan


@dataclass
class Choice:
    """Each approach's fit to the whole ladder (or why not), its backtest score, and the one
    chosen (None: refused, with the reasons)."""

    models: dict[str, Frontier | Surface]
    refused: dict[str, str]
    scores: dict[str, float]
    cuts: list[Cut]
    chosen: str | None

    @property
    def why_not(self) -> str:
        return "; ".join(f"approach {k}: {v}" for k, v in sorted(self.refused.items()))

    def as_dict(self) -> dict:
        return {"chosen": self.chosen, "scores": self.scores, "refused": self.refused,
                "constants": {k: m.constants() for k, m in self.models.items()},
                "backtest": [c.as_dict() for c in self.cuts]}


def choose(points: Sequence[RunPoint], noise: float = math.nan) -> Choice:
    """Fit both approaches to the ladder, refuse the degenerate ones, backtest the rest and
    choose the lower score (an approach the backtest could not score is chosen only when
    it is the one left)."""
    models, refused = {}, {}
    no_iso = iso_structure(points)
    if no_iso:
        refused["2"] = f"no usable iso-FLOP structure: {no_iso}"
    for which in [a for a in APPROACHES if a not in refused]:
        try:
            models[which] = fit_approach(which, points)
        except ValueError as e:
            refused[which] = f"not fitted: {e}"
            continue
        why = refusal(which, points, models[which], noise)
        if why:
            refused[which] = why
    live = [a for a in APPROACHES if a not in refused]
    cuts = (_iso_cuts(points, live) if not no_iso else
            _rung_cuts(points) if live else [])
    scores = {a: score(cuts, a) for a in live}
    ranked = sorted(live, key=lambda a: (not math.isfinite(scores[a]),
                                         scores[a] if math.isfinite(scores[a]) else 0.0, a))
    return Choice(models, refused, scores, cuts, ranked[0] if ranked else None)


@dataclass
class Optimum:
    """The answer at one budget: loss, N and D at the optimum, the interval, the approach
    and its score; the measured best run at that budget where one is held out."""

    flops: float
    loss: float
    n_params: float
    tokens: float
    interval: tuple[float, float]
    bootstrap: tuple[float, float]
    approach: str
    score: float
    measured: RunPoint | None = None
    # every approach's (loss, N, D) here, the one not chosen included: how far they differ
    by_approach: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def error(self) -> float | None:
        return None if self.measured is None else self.loss / self.measured.loss - 1.0

    @property
    def covered(self) -> bool | None:
        if self.measured is None:
            return None
        return self.interval[0] <= self.measured.loss <= self.interval[1]

    @property
    def width(self) -> float:
        return (self.interval[1] - self.interval[0]) / self.loss

    def as_dict(self) -> dict:
        m = self.measured
        return {"flops": self.flops, "loss": self.loss, "n_params": self.n_params,
                "tokens": self.tokens, "interval": list(self.interval),
                "bootstrap": list(self.bootstrap), "width": self.width,
                "approach": self.approach, "backtest_score": self.score,
                "measured": None if m is None else {"name": m.name, "loss": m.loss,
                                                    "n_params": m.n_params,
                                                    "tokens": m.tokens},
                "error": self.error, "covered": self.covered,
                "by_approach": {k: dict(zip(("loss", "n_params", "tokens"), v, strict=True))
                                for k, v in self.by_approach.items()}}


def resample(points: Sequence[RunPoint], rng: np.random.Generator) -> list[RunPoint]:
    """The runs resampled with replacement within each budget (each group of
    analysis/isoflop_fit.groups; a ladder without budgets is resampled whole)."""
    out = []
    for g in groups(points) if budgets(points) else [list(points)]:
        out += [g[i] for i in rng.integers(0, len(g), len(g))]
    return out


def _bootstrap(choice: Choice, points: Sequence[RunPoint], resamples: int, seed: int
               ) -> list[Frontier | Surface]:
    which = choice.chosen
    model = choice.models[which]
    start = (model.law.alpha, model.law.beta) if isinstance(model, Surface) else None
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(resamples):
        pts = resample(points, rng)
        try:
            out.append(fit_approach(which, pts, start))
        except ValueError:
            continue
    return out


def held_out_best(heldout: Sequence[RunPoint], flops: float, rel_tol: float = 0.1
                  ) -> RunPoint | None:
    """The lowest-loss held-out run of budget ``flops`` (its ``budget`` column, else its C,
    within ``rel_tol``), or None."""
    def budget_of(p: RunPoint) -> float:
        return float(p.fields["budget"]) if p.fields.get("budget") else p.flops

    near = [p for p in heldout if abs(math.log(budget_of(p) / flops)) <= math.log1p(rel_tol)]
    return min(near, key=lambda p: p.loss) if near else None


def predict_optimal(points: Sequence[RunPoint], at: Sequence[float],
                    heldout: Sequence[RunPoint] = (), resamples: int = 100, seed: int = 0,
                    noise: float = math.nan) -> tuple[Choice, list[Optimum]]:
    """The chosen approach's optimum at each budget of ``at``, with its interval; none
    when both approaches are refused."""
    choice = choose(points, noise)
    if choice.chosen is None:
        return choice, []
    model = choice.models[choice.chosen]
    laws = _bootstrap(choice, points, resamples, seed) if resamples > 0 else []
    s = choice.scores[choice.chosen]
    out = []
    for c in at:
        loss, n, d = model.at(c)
        boot, wide = interval(loss, np.array([m.at(c)[0] for m in laws]), s, noise)
        out.append(Optimum(c, loss, n, d, wide, boot, choice.chosen, s,
                           held_out_best(heldout, c),
                           {k: m.at(c) for k, m in choice.models.items()
                            if k not in choice.refused}))
    return choice, out
