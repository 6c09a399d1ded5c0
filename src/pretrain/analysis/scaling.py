"""Scaling-law fits of measured sweeps: L(C) = a C^b + c and L(N, D) = E + A/N^alpha + B/D^beta.

Why these two forms: L(C) is what the GPT-4 report (OpenAI 2023) fitted to predict the
final loss of a large run from small ones; L(N, D) is Hoffmann et al. 2022 ("Chinchilla",
approach 3), which also says how to split a compute budget C = 6 N D between parameters and
tokens. Both are fitted as Hoffmann et al. did: a Huber loss (delta 1e-3) on the residual of
log loss, so a few diverged or unlucky runs do not drag the fit, bounded parameters, and
L-BFGS-B started from the best points of a grid of initialisations (the objective has many
local minima). Uncertainty comes from a bootstrap over runs, the only honest error bar when
the runs themselves are the samples.

Units: N is ``plan.json``'s ``n_params_active`` (every parameter, as Hoffmann et al., for a
dense model; those one token uses for a mixture of experts), D the
tokens trained, C = 6 N D (``budget.run_compute``). Other counts of N (``COUNTS``): the
non-embedding parameters (Kaplan et al. 2020), or the per-token training FLOPs over 6
(``flops``: PaLM's 6 N_matmul + 12 L d T, attention and the output matmul included, so
C = 6 N D is the FLOPs the run did; DeepSeek's M is the same idea without the output layer).
At widths of tens, attention is half of a token's FLOPs and the embedding a quarter of the
parameters, and the counts disagree on how much bigger one size is than the next.

Needs scipy (the ``analysis`` extra): ``pip install -e '.[analysis]'``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pretrain.analysis.fitting import HUBER_DELTA, fit
from pretrain.analysis.fitting import bootstrap as refit_resamples
from pretrain.analysis.laws import FORMS
from pretrain.analysis.runs import RunPoint
from pretrain.budget.compute import FLOPS_PER_PARAM_TOKEN
from pretrain.errors import UserError

__all__ = ["HUBER_DELTA"]


# -- L(C) = a C^b + c -----------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeLaw:
    """L(C) = a * C**b + c (b < 0): loss against training compute, irreducible loss c
    (laws.FORMS["compute"], C = 6 N D)."""

    a: float
    b: float
    c: float

    def predict(self, flops: float | np.ndarray) -> np.ndarray:
        # the one formula: laws.FORMS["compute"] at N = C / 6, D = 1
        c = np.asarray(flops, dtype=float) / FLOPS_PER_PARAM_TOKEN
        return FORMS["compute"].predict(vars(self), c, np.ones_like(c))


def fit_compute_law(flops: Sequence[float], loss: Sequence[float],
                    delta: float = HUBER_DELTA, keep: int = 8,
                    starts: np.ndarray | None = None) -> ComputeLaw:
    """Fit L(C) with the Huber objective on log loss (analysis/fitting.py)."""
    c_arr = np.asarray(flops, float)
    if len(c_arr) < 3:
        raise ValueError(f"L(C) has 3 constants: need at least 3 runs, got {len(c_arr)}")
    law = fit("compute", c_arr / FLOPS_PER_PARAM_TOKEN, np.ones_like(c_arr), loss,
              delta=delta, keep=keep, starts=starts).law
    return ComputeLaw(**law.constants)


def _compute_law_theta(law: ComputeLaw) -> np.ndarray:
    return FORMS["compute"].theta(vars(law))


# -- L(N, D) = E + A/N^alpha + B/D^beta ------------------------------------------------------


@dataclass(frozen=True)
class ChinchillaLaw:
    """L(N, D) = E + A / N**alpha + B / D**beta (Hoffmann et al. 2022, approach 3)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def predict(self, n: float | np.ndarray, d: float | np.ndarray) -> np.ndarray:
        return FORMS["chinchilla"].predict(vars(self), n, d)  # the one formula

    def optimal(self, flops: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Compute-optimal (N, D) under C = 6 N D: minimising L along that constraint gives
        N = G (C/6)^(beta/(alpha+beta)), D = (C/6)^(alpha/(alpha+beta)) / G with
        G = (alpha A / (beta B))^(1/(alpha+beta)) (Hoffmann et al. 2022, eq. 4)."""
        c6 = np.asarray(flops, float) / FLOPS_PER_PARAM_TOKEN
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / s)
        return g * c6 ** (self.beta / s), c6 ** (self.alpha / s) / g

    def optimal_loss(self, flops: float | np.ndarray) -> np.ndarray:
        n, d = self.optimal(flops)
        return self.predict(n, d)


# Hoffmann et al. 2022, section 3.3 / eq. 10: approach 3's fit of their 400+ runs.
CHINCHILLA = ChinchillaLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def fit_chinchilla_law(n_params: Sequence[float], tokens: Sequence[float],
                       loss: Sequence[float], delta: float = HUBER_DELTA, keep: int = 10,
                       starts: np.ndarray | None = None,
                       fixed_e: float | None = None) -> ChinchillaLaw:
    """Fit L(N, D) as Hoffmann et al. did (analysis/fitting.py): the Huber loss of
    log L(N, D) - log loss over (log A, log B, log E, alpha, beta) from their grid of starts;
    ``fixed_e``: E held at that value (the profile of the fit along E)."""
    n, d, l_arr = (np.asarray(v, float) for v in (n_params, tokens, loss))
    check_identifiable(n, d)
    fixed = None
    if fixed_e is not None:
        fixed = {"e": min(max(math.log(max(fixed_e, 1e-30)), -10.0), math.log(l_arr.min()))}
    law = fit("chinchilla", n, d, l_arr, delta=delta, keep=keep, starts=starts,
              fixed=fixed).law
    return ChinchillaLaw(**law.constants)


def _chinchilla_theta(law: ChinchillaLaw) -> np.ndarray:
    return FORMS["chinchilla"].theta(vars(law))


class NotIdentifiable(UserError, ValueError):
    """The runs cannot separate the constants of L(N, D)."""


def check_identifiable(n: np.ndarray, d: np.ndarray) -> None:
    """L(N, D) needs runs at different tokens per parameter: along D = k N (a pure
    Chinchilla ladder) A/N^alpha and B/D^beta are the same kind of curve and trade off
    freely. An iso-FLOP sweep, or a ladder plus one, gives the spread."""
    if len(n) < 6:
        raise NotIdentifiable(f"L(N, D) has 5 constants: need at least 6 runs, got {len(n)}")
    spread = float(np.std(np.log(d / n)))
    if spread < 0.1:
        raise NotIdentifiable(
            f"every run has about the same tokens per parameter (std of log(D/N) = {spread:.3f})"
            ", so A/N^alpha and B/D^beta cannot be told apart; add runs at other ratios, e.g. an"
            " iso-FLOP sweep (budget=flops) at one or more compute budgets"
        )


# -- bootstrap ------------------------------------------------------------------------------


@dataclass
class Estimate:
    """A point estimate with its bootstrap spread: a 95% percentile interval, and the
    standard deviation (for scale constants such as A, a: the geometric one, a factor)."""

    value: float
    std: float
    low: float
    high: float
    geometric: bool = False

    def __str__(self) -> str:
        spread = f"x/ {self.std:.3g}" if self.geometric else f"± {self.std:.2g}"
        return f"{self.value:.4g} {spread} [{self.low:.4g}, {self.high:.4g}]"


def _estimate(value: float, samples: np.ndarray, geometric: bool = False) -> Estimate:
    s = samples[np.isfinite(samples)]
    if geometric:
        s = s[s > 0]
    if len(s) < 2:
        return Estimate(value, math.nan, math.nan, math.nan, geometric)
    low, high = np.percentile(s, [2.5, 97.5])
    std = float(np.exp(np.std(np.log(s)))) if geometric else float(np.std(s))
    return Estimate(value, std, float(low), float(high), geometric)


@dataclass
class FitReport:
    """Fitted constants and predictions of one law, each with its bootstrap spread."""

    law: ComputeLaw | ChinchillaLaw
    constants: dict[str, Estimate]
    predictions: dict[str, Estimate] = field(default_factory=dict)
    samples: list = field(default_factory=list)  # the bootstrap laws, for bands in plots
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"law": type(self.law).__name__, **asdict(self.law),
                "constants": {k: asdict(v) for k, v in self.constants.items()},
                "predictions": {k: asdict(v) for k, v in self.predictions.items()},
                "bootstrap_samples": len(self.samples), "warnings": self.warnings}


def bound_warnings(law: ComputeLaw | ChinchillaLaw) -> list[str]:
    """Constants that ended on a bound of the search: the runs did not determine them, and
    predictions that lean on them are extrapolations of the bounds, not of the data."""
    out = []
    if isinstance(law, ComputeLaw):
        if law.b <= -0.999 or law.b >= -1e-6:  # the bound it is on, not its last bits
            out.append(f"b = {-1 if law.b <= -0.999 else 0} is on a bound of [-1, 0]: the runs "
                       "do not fix it")
        if law.c <= 1e-9:
            out.append("c = 0: no irreducible loss is visible in these runs (a pure power law)")
        return out
    if law.E < 1e-3:
        out.append(f"E = {law.E:.2g} is on its lower bound: the runs do not constrain the "
                   "irreducible loss, so N_opt and D_opt are not trustworthy")
    for name in ("alpha", "beta"):
        v = getattr(law, name)
        if v <= 0.0101 or v >= 2.99:
            out.append(f"{name} = {v:.3g} is on a bound of [0.01, 3]: the runs do not fix it")
    return out


def interval_warnings(rep: FitReport) -> list[str]:
    """Predictions whose bootstrap interval leaves out the full-data estimate (beyond
    rounding): the fit moves a lot when runs are resampled, so the point is not to be
    trusted on its own."""
    out = []
    for k, est in rep.predictions.items():
        if not (np.isfinite(est.low) and np.isfinite(est.high)):
            continue
        tol = 1e-9 * max(abs(est.value), 1.0)
        if est.value < est.low - tol or est.value > est.high + tol:
            out.append(f"the bootstrap 95% interval of {k} [{est.low:.4g}, {est.high:.4g}] "
                       f"leaves out the fit's own value {est.value:.4g}: the fit is unstable "
                       "under resampling of these runs; add runs, and read the interval")
    return out


def compute_frontier(points: Sequence[RunPoint]) -> list[RunPoint]:
    """The lowest-loss run of each compute budget. L(C) describes the best loss a budget
    buys (the GPT-4 report fitted it to its compute-efficient runs); the off-optimum runs
    of an iso-FLOP sweep would drag it up. A ladder has one run per budget: all kept."""
    return [min(g, key=lambda p: p.loss) for g in isoflop_groups(points)]


def report_compute_law(points: Sequence[RunPoint], target_flops: float | None = None,
                       n_boot: int = 200, seed: int = 0) -> FitReport:
    """Fit L(C) to the compute frontier of the runs; bootstrap the constants and the loss
    predicted at the target."""
    points = compute_frontier(points)
    c_arr = np.array([p.flops for p in points])
    loss = np.array([p.loss for p in points])
    law = fit_compute_law(c_arr, loss)
    resampled = refit_resamples(
        "compute", c_arr / FLOPS_PER_PARAM_TOKEN, np.ones_like(c_arr), loss,
        _compute_law_theta(law), n_boot, seed,
        usable=lambda idx: len(np.unique(c_arr[idx])) >= 3)
    laws = [ComputeLaw(**x.constants) for x in resampled]
    constants = {k: _estimate(getattr(law, k), np.array([getattr(s, k) for s in laws]),
                              geometric=k == "a") for k in ("a", "b", "c")}
    rep = FitReport(law, constants, samples=laws, warnings=bound_warnings(law))
    if len(points) == 3:
        rep.warnings.append(
            "3 budgets for 3 constants: the curve passes through every run, and the "
            "bootstrap cannot measure its uncertainty (every usable resample is the same 3 "
            "runs); add budgets before trusting the prediction")
    if target_flops:
        rep.predictions["loss"] = _estimate(
            float(law.predict(target_flops)), np.array([s.predict(target_flops) for s in laws]))
    rep.warnings += interval_warnings(rep)
    return rep


def report_chinchilla_law(points: Sequence[RunPoint], target_flops: float | None = None,
                          n_boot: int = 100, seed: int = 0) -> FitReport:
    """Fit L(N, D); bootstrap the constants, and at the target budget the compute-optimal
    N, D and the loss there."""
    n, d, loss = (np.array([getattr(p, k) for p in points], float)
                  for k in ("n_params", "tokens", "loss"))
    law = fit_chinchilla_law(n, d, loss)

    def usable(idx: np.ndarray) -> bool:
        return len(idx) >= 6 and float(np.std(np.log(d[idx] / n[idx]))) >= 0.1

    resampled = refit_resamples("chinchilla", n, d, loss, _chinchilla_theta(law), n_boot,
                                seed, usable=usable)
    laws = [ChinchillaLaw(**x.constants) for x in resampled]
    constants = {k: _estimate(getattr(law, k), np.array([getattr(s, k) for s in laws]),
                              geometric=k in ("A", "B")) for k in ("E", "A", "B", "alpha", "beta")}
    rep = FitReport(law, constants, samples=laws, warnings=bound_warnings(law))
    if target_flops:
        n_opt, d_opt = law.optimal(target_flops)
        opts = [s.optimal(target_flops) for s in laws]
        rep.predictions["n_opt"] = _estimate(float(n_opt), np.array([o[0] for o in opts]), True)
        rep.predictions["d_opt"] = _estimate(float(d_opt), np.array([o[1] for o in opts]), True)
        rep.predictions["loss"] = _estimate(
            float(law.optimal_loss(target_flops)),
            np.array([s.optimal_loss(target_flops) for s in laws]))
    rep.warnings += interval_warnings(rep)
    return rep


# -- iso-FLOP groups (Hoffmann et al. approach 2) ------------------------------------------


def isoflop_groups(points: Sequence[RunPoint], rel_tol: float = 0.1) -> list[list[RunPoint]]:
    """Runs grouped by compute budget (within ``rel_tol``), smallest budget first. Step
    rounding makes runs of one iso-FLOP sweep differ slightly in C."""
    groups: list[list[RunPoint]] = []
    for p in sorted(points, key=lambda p: p.flops):
        if groups and math.log(p.flops / groups[-1][0].flops) <= math.log1p(rel_tol):
            groups[-1].append(p)
        else:
            groups.append([p])
    return [sorted(g, key=lambda p: p.n_params) for g in groups]


def isoflop_bracketed(group: Sequence[RunPoint]) -> bool:
    """Whether a budget's lowest loss is at an inner size: the valley is inside the sizes
    run. When it is not (the smallest or the largest model wins), the sweep says which way
    N_opt lies but not where, and L(N, D) fitted to it extrapolates."""
    best = min(range(len(group)), key=lambda i: group[i].loss)
    return 0 < best < len(group) - 1


def isoflop_minimum(group: Sequence[RunPoint]) -> tuple[float, float] | None:
    """(N, loss) at the vertex of a parabola in log N through one budget's runs
    (approach 2); None where ``isoflop_problem`` says why there is no minimum."""
    if isoflop_problem(group) is not None:
        return None
    x = np.log([p.n_params for p in group])
    k2, k1, k0 = np.polyfit(x, [p.loss for p in group], 2)
    xv = -k1 / (2 * k2)
    return float(np.exp(xv)), float(k0 - k1 * k1 / (4 * k2))


def isoflop_problem(group: Sequence[RunPoint]) -> str | None:
    """Why a budget's runs have no iso-FLOP minimum, or None: fewer than 3 sizes, a parabola
    in log N that does not open upward, or its vertex outside the sizes trained (the valley
    then lies beyond them, and the vertex is the parabola's guess, not the runs': the byte
    ladder's fit.json once listed N_opt = 1.4e-06 and a loss of -1.58)."""
    if len({p.n_params for p in group}) < 3:
        return "fewer than 3 sizes"
    x = np.log([p.n_params for p in group])
    k2, k1, _ = np.polyfit(x, [p.loss for p in group], 2)
    if k2 <= 0:
        return "the parabola in log N opens downward: no valley among these sizes"
    xv = -k1 / (2 * k2)
    if not x.min() <= xv <= x.max():
        return (f"the parabola's vertex, N = {math.exp(xv):.3g}, lies outside the sizes trained "
                f"({math.exp(x.min()):.3g}..{math.exp(x.max()):.3g}): extend the sweep that way")
    return None
