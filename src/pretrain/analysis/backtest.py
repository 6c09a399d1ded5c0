"""The backtest a ladder passes before it predicts: fit the runs at or under 1/R of the
largest compute, predict the rest, for each candidate form (issue 55, docs/ladder/README.md).

Why: a held-out run at R x the ladder's largest compute is an extrapolation by R; the ladder
can make that same extrapolation on itself, from its bottom rungs to its top ones, with no
extra runs. A ladder whose law cannot do that within the tolerance (2%) cannot be trusted to
do it once more beyond its top: the byte ladder of issue 48 predicted its own top rungs 19%
high from 30x below, and then missed its held-out run by 10.4%. Choosing E or the form by
leaving out one size (1.4x in N) says nothing about 30x; choosing them by this test does,
and never by the held-out run.

The forms (each fitted with the Huber objective on log loss, as analysis/scaling.py):

    chinchilla      E + A/N^alpha + B/D^beta, E free            (Hoffmann et al. 2022)
    E=<f>min        the same with E held at f x the lowest loss (f = 0, 0.25, 0.5, 0.75)
    shared          E + A/N^a + B/D^a: one exponent             (Gadre et al. 2024's form)
    kaplan          ((Nc/N)^(aN/aD) + Dc/D)^aD                   (Kaplan et al. 2020, eq. 1.5)
    broken          E + A N^-alpha (1 + N/Nb)^-delta + B/D^beta: the N exponent bends from
                    alpha to alpha + delta around Nb (a smoothly broken power law,
                    Caballero et al. 2023), for small sizes in another regime

The top rungs are the predicted runs within 2x of the largest compute: the runs R/2..R above
what was fitted, which is the extrapolation a held-out run at R makes. The verdict is on
their mean absolute error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import HUBER_DELTA, fit_chinchilla_law

TOLERANCE = 0.02        # the 2%: what "supported" means
TOP_SPAN = 2.0          # the top rungs: within this factor of the largest compute
MIN_FIT_RUNS = 6        # L(N, D) has five constants: at least six runs, two sizes, two D/N
E_FRACTIONS = (0.0, 0.25, 0.5, 0.75)


@dataclass(frozen=True)
class FittedForm:
    """A fitted law: its form's name, its constants, and L(N, D)."""

    form: str
    constants: dict[str, float]
    predict: Callable[[np.ndarray, np.ndarray], np.ndarray] = field(repr=False, compare=False)


def _huber_fit(residual: Callable[[np.ndarray], np.ndarray], starts: Sequence[Sequence[float]],
               bounds: tuple[Sequence[float], Sequence[float]], keep: int = 4) -> np.ndarray:
    """scipy's least squares with the Huber loss (delta as Hoffmann et al.) on residuals of
    log loss, from the ``keep`` starts of lowest initial cost (screened as
    analysis/scaling.py screens its grid); the best optimum found."""
    from scipy.optimize import least_squares

    lo, hi = np.asarray(bounds[0], float) + 1e-9, np.asarray(bounds[1], float) - 1e-9
    clipped = [np.clip(np.asarray(s, float), lo, hi) for s in starts]
    with np.errstate(all="ignore"):
        costs = [float(np.sum(np.square(residual(s)))) for s in clipped]
    order = [i for i in np.argsort(costs) if math.isfinite(costs[i])][:keep]
    best, best_cost = None, math.inf
    for s in (clipped[i] for i in order):
        try:
            res = least_squares(residual, s, bounds=bounds, loss="huber", f_scale=HUBER_DELTA,
                                max_nfev=4000, xtol=1e-12, ftol=1e-12)
        except ValueError:  # a start where the form is not finite
            continue
        if np.all(np.isfinite(res.fun)) and res.cost < best_cost:
            best, best_cost = res.x, res.cost
    if best is None:
        raise ValueError("the fit did not converge from any start")
    return best


def _arrays(points: Sequence[RunPoint]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.array([p.n_params for p in points], float), np.array([p.tokens for p in points], float),
            np.array([p.loss for p in points], float))


def fit_chinchilla(points: Sequence[RunPoint], fixed_e: float | None = None,
                   name: str = "chinchilla") -> FittedForm:
    n, d, loss = _arrays(points)
    law = fit_chinchilla_law(n, d, loss, fixed_e=fixed_e)
    return FittedForm(name, {"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha,
                             "beta": law.beta}, law.predict)


def fit_shared(points: Sequence[RunPoint]) -> FittedForm:
    n, d, loss = _arrays(points)
    ln, ld, ll = np.log(n), np.log(d), np.log(loss)
    e_hi = math.log(loss.min())

    def model(t, ln_, ld_):
        a, b, e, x = t
        return np.exp(a - x * ln_) + np.exp(b - x * ld_) + np.exp(e)

    starts = [[a, b, e, x] for a in (2.0, 6.0) for b in (2.0, 6.0) for e in (e_hi - 3, e_hi - 0.7)
              for x in (0.2, 0.4)]
    t = _huber_fit(lambda t: np.log(model(t, ln, ld)) - ll, starts,
                   ([-10, -10, -12, 0.01], [60, 60, e_hi, 3.0]))
    return FittedForm("shared", {"E": math.exp(t[2]), "A": math.exp(t[0]), "B": math.exp(t[1]),
                                 "a": float(t[3])},
                      lambda n_, d_: model(t, np.log(n_), np.log(d_)))


def fit_kaplan(points: Sequence[RunPoint]) -> FittedForm:
    n, d, loss = _arrays(points)
    ln, ld, ll = np.log(n), np.log(d), np.log(loss)

    def log_model(t, ln_, ld_):
        lnc, ldc, an, ad = t
        return ad * np.logaddexp((an / ad) * (lnc - ln_), ldc - ld_)

    starts = [[lnc, ldc, an, ad] for lnc in (5.0, 15.0) for ldc in (5.0, 15.0)
              for an in (0.1, 0.3) for ad in (0.1, 0.3)]
    t = _huber_fit(lambda t: log_model(t, ln, ld) - ll, starts,
                   ([-20, -20, 0.005, 0.005], [80, 80, 3.0, 3.0]))
    return FittedForm("kaplan", {"Nc": math.exp(t[0]), "Dc": math.exp(t[1]), "alpha_N": float(t[2]),
                                 "alpha_D": float(t[3])},
                      lambda n_, d_: np.exp(log_model(t, np.log(n_), np.log(d_))))


def fit_broken(points: Sequence[RunPoint]) -> FittedForm:
    n, d, loss = _arrays(points)
    ln, ld, ll = np.log(n), np.log(d), np.log(loss)
    e_hi = math.log(loss.min())

    def model(t, ln_, ld_):
        a, b, e, alpha, beta, lnb, delta = t
        n_term = np.exp(a - alpha * ln_ - delta * np.logaddexp(0.0, ln_ - lnb))
        return n_term + np.exp(b - beta * ld_) + np.exp(e)

    mid = float(np.median(ln))
    starts = [[a, b, e, al, be, lnb, de] for a in (2.0, 6.0) for b in (2.0, 6.0)
              for e in (e_hi - 3, e_hi - 0.7) for al in (0.1, 0.3) for be in (0.3,)
              for lnb in (mid,) for de in (-0.1, 0.2)]
    t = _huber_fit(lambda t: np.log(model(t, ln, ld)) - ll, starts,
                   ([-10, -10, -12, 0.0, 0.01, float(ln.min()) - 2, -1.0],
                    [60, 60, e_hi, 3.0, 3.0, float(ln.max()) + 2, 2.0]))
    return FittedForm("broken", {"E": math.exp(t[2]), "A": math.exp(t[0]), "B": math.exp(t[1]),
                                 "alpha": float(t[3]), "beta": float(t[4]), "Nb": math.exp(t[5]),
                                 "delta": float(t[6])},
                      lambda n_, d_: model(t, np.log(n_), np.log(d_)))


def law_from_constants(form: str, c: dict[str, float]) -> Callable[[float, float], float]:
    """L(N, D) of a fitted form from the constants it recorded (fit.json), to predict from a
    committed fit without refitting."""
    if form == "chinchilla" or form.startswith("E="):
        return lambda n, d: c["E"] + c["A"] / n ** c["alpha"] + c["B"] / d ** c["beta"]
    if form == "shared":
        return lambda n, d: c["E"] + c["A"] / n ** c["a"] + c["B"] / d ** c["a"]
    if form == "kaplan":
        return lambda n, d: ((c["Nc"] / n) ** (c["alpha_N"] / c["alpha_D"]) + c["Dc"] / d) \
            ** c["alpha_D"]
    if form == "broken":
        return lambda n, d: (c["E"] + c["A"] * n ** -c["alpha"] * (1 + n / c["Nb"]) ** -c["delta"]
                             + c["B"] / d ** c["beta"])
    raise ValueError(f"unknown form {form!r}; the forms: {', '.join(forms())}")


def forms() -> dict[str, Callable[[Sequence[RunPoint]], FittedForm]]:
    """Every candidate form by name, each a fit of runs -> FittedForm."""
    out: dict[str, Callable[[Sequence[RunPoint]], FittedForm]] = {"chinchilla": fit_chinchilla}
    for f in E_FRACTIONS:
        name = f"E={f:g}min"
        out[name] = lambda pts, f=f, name=name: fit_chinchilla(
            pts, fixed_e=f * min(p.loss for p in pts), name=name)
    out.update(shared=fit_shared, kaplan=fit_kaplan, broken=fit_broken)
    return out


# -- the backtest ---------------------------------------------------------------------------


def fittable(points: Sequence[RunPoint]) -> bool:
    """Enough runs to fit L(N, D): MIN_FIT_RUNS, two sizes, two tokens per parameter."""
    sizes = {round(math.log(p.n_params), 3) for p in points}
    tpp = {round(math.log(p.tokens / p.n_params), 2) for p in points}
    return len(points) >= MIN_FIT_RUNS and len(sizes) >= 2 and len(tpp) >= 2


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
        fit = [p for p in pts if p.flops <= x * (1 + 1e-9)]
        rest = [p for p in pts if p.flops > x * (1 + 1e-9)]
        if rest and fittable(fit):
            best = max(best, top / x)
    return best


@dataclass
class FormResult:
    form: str
    fitted: int
    errors: list[tuple[RunPoint, float]]   # each predicted run: predicted / measured - 1
    top: list[tuple[RunPoint, float]]      # the top rungs among them
    problem: str | None = None

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
        return {"form": self.form, "fitted_runs": self.fitted, "problem": self.problem,
                "top_mean": self.top_mean, "top_mean_abs": self.top_mae, "mean_abs": self.mae,
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
                "forms": [r.as_dict() for r in self.results]}


def backtest(points: Sequence[RunPoint], ratio: float, names: Sequence[str] | None = None,
             tolerance: float = TOLERANCE) -> Backtest:
    """Fit each form to the runs with C <= C_max / ratio, predict the others."""
    if ratio <= 1:
        raise ValueError(f"--backtest {ratio:g}: the ratio must be above 1")
    top_c = max(p.flops for p in points)
    cut = top_c / ratio * (1 + 1e-9)
    fit = [p for p in points if p.flops <= cut]
    rest = sorted((p for p in points if p.flops > cut), key=lambda p: p.flops)
    if not rest or not fittable(fit):
        can = max_ratio([p.flops for p in points], [p.n_params for p in points],
                        [p.tokens for p in points])
        raise ValueError(f"--backtest {ratio:g}: {len(fit)} runs at or under C = {cut:.3g} "
                         f"(1/{ratio:g} of the largest, {top_c:.3g}); L(N, D) needs "
                         f"{MIN_FIT_RUNS}+ runs of 2+ sizes and 2+ tokens/param there. These runs "
                         f"allow a backtest up to {can:.3g}x")
    results = []
    for name, fit_form in forms().items():
        if names and name not in names:
            continue
        try:
            law = fit_form(fit)
        except ValueError as e:
            results.append(FormResult(name, len(fit), [], [], problem=str(e)))
            continue
        errs = [(p, float(law.predict(np.array(p.n_params), np.array(p.tokens))) / p.loss - 1.0)
                for p in rest]
        top = [(p, e) for p, e in errs if p.flops >= top_c / TOP_SPAN]
        results.append(FormResult(name, len(fit), errs, top))
    return Backtest(ratio, cut / (1 + 1e-9), results, tolerance)


def rms_residual(law: FittedForm, points: Sequence[RunPoint]) -> float:
    """The rms of measured / fitted - 1 over the runs: how well the form describes them."""
    n, d, loss = _arrays(points)
    return float(np.sqrt(np.mean((loss / law.predict(n, d) - 1.0) ** 2)))


def predict_with_interval(points: Sequence[RunPoint], form: str, n: float, d: float,
                          resamples: int = 100, seed: int = 0) -> dict:
    """The chosen form fitted to every run, its prediction at (N, D), and the 95% interval
    of a bootstrap over runs (resamples that cannot be fitted are skipped)."""
    fit_form = forms()[form]
    law = fit_form(points)
    value = float(law.predict(np.array(n), np.array(d)))
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(resamples):
        pick = [points[i] for i in rng.integers(0, len(points), len(points))]
        if not fittable(pick):
            continue
        try:
            samples.append(float(fit_form(pick).predict(np.array(n), np.array(d))))
        except ValueError:
            continue
    lo, hi = (np.percentile(samples, [2.5, 97.5]).tolist() if len(samples) >= 10
              else [math.nan, math.nan])
    return {"form": form, "constants": law.constants, "loss": value, "bootstrap": [lo, hi],
            "resamples": len(samples), "rms": rms_residual(law, points)}
