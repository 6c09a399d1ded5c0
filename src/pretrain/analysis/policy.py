"""The fit policy: which law, which count of N and which runs predict beyond a ladder's top,
chosen by the ladder's own backtest and never by a held-out run (issue 61,
docs/ladder/published.md).

A ladder predicts a run R x above its largest compute. Before it does, it can make the same
kind of extrapolation on itself: fit each candidate to its runs at or under 1/r of its largest
compute and predict its top rungs (analysis/backtest.py), for every r the ladder allows. The
candidate that does that best is the one used; its backtest error widens the interval.

The candidates (``candidates``):

- **forms** (analysis/laws.py): ``chinchilla`` (E + A/N^alpha + B/D^beta) and ``shared``
  (one exponent, Gadre et al. 2024's form);
- **counts of N**: every parameter, and the non-embedding ones or the per-token FLOPs / 6
  where the runs record them (Kaplan et al. 2020 count non-embedding parameters);
- **data**: every run, or only runs of at least ``MIN_TPP`` tokens per parameter (at 5 tokens
  a parameter, a quarter of Chinchilla's, a run is still in its warm-up transient: the
  shortest runs of Gadre et al.'s ladder sit off the law the longer ones follow), or, where
  the targets are known, only the runs in a target's **data regime**: at most 2-4x its
  tokens per parameter (``REGIME``; one fit per target, or per group of targets with the same
  bound). One L(N, D) with a fixed beta does not describe a size trained from 5 to 2,000
  tokens a parameter (Gemstones' ladder: its 50M models at 2,000 tokens a parameter pull the
  fit 4-6% above its 1-2B models at 55-110); a target at 100 is predicted from the runs of
  its own regime.

A fit is refused as degenerate (``degenerate``) when its irreducible loss reaches the lowest
loss of its own runs, an exponent leaves the range measured language models span, or its rms
residual is far above the runs' noise: such a fit can print any number far out, and the
policy names it and uses the next candidate instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.analysis.fitting import fit, rms_residual
from pretrain.analysis.laws import FORMS as LAW_FORMS
from pretrain.analysis.laws import Law
from pretrain.analysis.runs import RunPoint

FORMS = ("chinchilla", "shared")
COUNT_ORDER = ("total", "non_embedding", "flops")
MIN_TPP = 10.0           # the data filter: runs with at least this many tokens per parameter
MIN_FIT_RUNS = 6         # the most constants of a candidate form (5) plus one
MIN_DOF = 2              # runs beyond a form's constants: with fewer the fit can pass
                         # through its runs along a valley of equal fits (the OLMo ladder's
                         # Chinchilla form on 6 runs moves by 4 points with the optimizer's
                         # start), and nothing is left to judge it by
TOP_SPAN = 2.0           # the top rungs: within this factor of the largest compute
FLOOR_MARGIN = 0.005     # E within 0.5% of the lowest loss is at the data's floor
EXPONENT_RANGE = (0.02, 1.0)  # measured LM exponents: 0.05-0.5 (Hoffmann, Kaplan, Gadre...)
MAX_RMS = 0.03           # rms residual above 3% (or 3x the seed spread): not the runs' law
TOLERANCE = 0.02         # the backtest's "supported": top rungs within 2% (issue 55)
# the sizes a form needs to determine its constants: in E + A/N^alpha + B/D^beta, the runs
# of each size fix B, beta and that size's E + A/N^alpha; with two sizes, E, A and alpha are
# two equations for three unknowns (a valley of exact fits: rw_original's Chinchilla fit at
# 32x reaches alpha 0.30 or 0.98 with the same objective, by the BLAS kernels alone); the
# shared exponent's alpha is fixed by D, leaving E and A to two sizes. The same holds for the
# token counts, the two roles swapped (Gemstones' 22.6x cut: two token counts, beta 0.4 or 1.2)
SIZES_NEEDED = {"chinchilla": 3, "shared": 2}
REGIME = 2.0             # the data-regime filter: a target is fitted from the runs of at most the
                         # first power of 2 at or above twice its tokens per parameter
KEEP = 4                 # descents from the grid's best starts (tools/fit_stability.py checks
                         # that twice as many change no decision)


@dataclass(frozen=True)
class Candidate:
    """One way to fit: a form, a count of N, and the least tokens per parameter kept."""

    form: str
    count: str = "total"
    min_tpp: float = 0.0
    regime: bool = False      # only the runs of each target's data regime (``cap``)

    @property
    def name(self) -> str:
        data = f"tpp>={self.min_tpp:g}" if self.min_tpp else "all runs"
        if self.regime:
            data = f"tpp<={REGIME:g}-{2 * REGIME:g}x the target's"
        return f"{self.form}, N {self.count}, {data}"

    @staticmethod
    def cap(target: RunPoint) -> float:
        """The most tokens per parameter a run fitted for ``target`` may have: the first
        power of 2 at or above REGIME x the target's (a coarse grid, so that targets share
        fits and no jitter of the inputs moves a run across it)."""
        return 2.0 ** math.ceil(math.log2(REGIME * target.tokens_per_param) - 1e-6)

    def runs(self, points: Sequence[RunPoint], target: RunPoint | None = None
             ) -> list[RunPoint]:
        """The runs among ``points`` this candidate fits (for ``target``, when it keeps
        only a target's data regime)."""
        cap = math.inf
        if self.regime:
            if target is None:
                raise ValueError(f"{self.name}: the fit depends on the target; name one")
            cap = self.cap(target) * (1 + 1e-6)
        return [p for p in points if p.count(self.count) is not None
                and self.min_tpp * (1 - 1e-6) <= p.tokens_per_param <= cap]

    def groups(self, points: Sequence[RunPoint], targets: Sequence[RunPoint]
               ) -> list[tuple[list[RunPoint], list[RunPoint]]]:
        """(the runs fitted, the targets that fit predicts): one group, or one per bound
        of the data regime."""
        if not self.regime:
            return [(self.runs(points), list(targets))]
        by: dict[float, list[RunPoint]] = {}
        for t in targets:
            by.setdefault(self.cap(t), []).append(t)
        return [(self.runs(points, ts[0]), ts) for _, ts in sorted(by.items())]

    def arrays(self, points: Sequence[RunPoint]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.array([p.count(self.count) for p in points], float),
                np.array([p.tokens for p in points], float),
                np.array([p.loss for p in points], float))

    @property
    def constants(self) -> int:
        return len(LAW_FORMS[self.form].params)

    def fit(self, points: Sequence[RunPoint], keep: int | None = None,
            target: RunPoint | None = None):
        """The form fitted to this candidate's runs among ``points`` (for ``target``, when
        the runs depend on it; ``keep`` descents from the best starts of the grid, KEEP
        unless given)."""
        return self.fit_runs(self.runs(points, target), keep)

    def fit_runs(self, runs: Sequence[RunPoint], keep: int | None = None):
        """The form fitted to exactly ``runs`` (one group of ``groups``)."""
        return fit(self.form, *self.arrays(runs), keep=keep or KEEP)

    def predict(self, law: Law, p: RunPoint) -> float:
        return float(law.predict(p.count(self.count), p.tokens))


def candidates(points: Sequence[RunPoint], forms: Sequence[str] = FORMS,
               targets: Sequence[RunPoint] = ()) -> list[Candidate]:
    """Every candidate the runs allow: the counts every run records, each filter where it
    leaves a fittable ladder and removes at least one run (the data regime only where the
    ``targets`` are known; of ``forms``: FORMS, or more for tools/leave_one_out.py)."""
    counts = [c for c in COUNT_ORDER if all(p.count(c) is not None for p in points)]
    out = []
    for form in forms:
        for count in counts:
            out.append(Candidate(form, count))
            kept = Candidate(form, count, MIN_TPP).runs(points)
            if len(kept) < len(points) and fittable(kept):
                out.append(Candidate(form, count, MIN_TPP))
            regime = Candidate(form, count, regime=True)
            groups = regime.groups(points, targets)
            if (targets and any(len(kept) < len(points) for kept, _ in groups)
                    and all(fittable(kept) for kept, _ in groups)):
                out.append(regime)
    return out


def fittable(points: Sequence[RunPoint]) -> bool:
    """Enough runs to fit L(N, D): MIN_FIT_RUNS, two sizes, two tokens per parameter."""
    sizes = {round(math.log(p.n_params), 3) for p in points}
    tpp = {round(math.log(p.tokens_per_param), 2) for p in points}
    return len(points) >= MIN_FIT_RUNS and len(sizes) >= 2 and len(tpp) >= 2


def degenerate(law: Law, runs: Sequence[RunPoint], count: str = "total",
               noise: float = math.nan) -> str | None:
    """Why a fit is not to be believed beyond its runs, or None: fewer than MIN_DOF runs
    beyond its constants or fewer sizes (or token counts) than SIZES_NEEDED, its floor at (or within
    FLOOR_MARGIN of) the lowest loss of its runs, an exponent outside EXPONENT_RANGE, or an
    rms residual above MAX_RMS (or 3x the seed spread ``noise`` where it is measured)."""
    constants = len(LAW_FORMS[law.form].params)
    if len(runs) < constants + MIN_DOF:
        return (f"{len(runs)} runs for its {constants} constants: fewer than {MIN_DOF} to "
                "spare, so the runs do not determine the fit")
    need = SIZES_NEEDED.get(law.form, 0)
    for what, values in (("sizes", [p.count(count) for p in runs]),
                         ("token counts", [p.tokens for p in runs])):
        distinct = len({round(math.log(v), 3) for v in values})
        if distinct < need:
            return (f"its runs have {distinct} {what} for a form that needs {need}: the runs "
                    "do not determine the fit")
    low = min(p.loss for p in runs)
    if law.floor is not None and law.floor >= low * (1 - FLOOR_MARGIN):
        return (f"its irreducible loss {law.floor:.4g} is at the lowest loss of its own runs "
                f"({low:.4g}): the runs do not see a floor, and the fit bends to any number "
                "beyond them")
    lo, hi = EXPONENT_RANGE
    for k, v in law.exponents().items():
        if not lo <= abs(v) <= hi:
            return (f"its exponent {k} = {v:.3g} is outside [{lo:g}, {hi:g}], where measured "
                    "language models lie")
    n = np.array([p.count(count) for p in runs], float)
    rms = rms_residual(law, n, [p.tokens for p in runs], [p.loss for p in runs])
    bound = max(MAX_RMS, 3 * noise) if math.isfinite(noise) else MAX_RMS
    if rms > bound:
        return (f"its rms residual {100 * rms:.2g}% is above {100 * bound:.2g}% (the runs' "
                "noise): the form does not describe these runs")
    return None
