"""Every scaling-law form, defined once: its formula in log space with the analytic Jacobian,
its constants, its search box and its grid of starts.

A form is fitted by pretrain/analysis/fitting.py (the one fitter) and evaluated here (the one
formula); the backtest, tools/scaling_law.py, ladder_check and the plots all go through
``Law.predict``, so a law written here is the law everywhere.

The forms, each a sum of exponentials of parameters linear in log N and log D (so each has
an exact Jacobian, and the fit does not depend on the optimizer's finite differences: the
OLMo ladder's fit moves by 2-4 points without one, Bhagia et al. 2024's notebooks):

    chinchilla   E + A/N^alpha + B/D^beta               Hoffmann et al. 2022, approach 3
    shared       E + A/N^alpha + B/D^alpha              one exponent: Gadre et al. 2024's
                                                        E + (a M^eta + b M^-eta) C^-alpha is
                                                        this form reparametrized
    no_floor     A/N^alpha + B/D^beta                   E held at 0: no irreducible loss
    broken       E + A N^-alpha (1 + N/Nb)^-delta + B/D^beta
                                                        the N exponent bends from alpha to
                                                        alpha + delta around Nb (a smoothly
                                                        broken power law, Caballero et al. 2023)
    compute      a C^b + c, C = 6 N D                   the GPT-4 report's L(C): fitted to a
                                                        compute frontier only

Parameters are fitted as logs of the scale constants (a = log A, ...), as Hoffmann et al.
did, so the box is the same for any units of N and D.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pretrain.budget.compute import FLOPS_PER_PARAM_TOKEN

# log_model(theta, ln_n, ln_d) -> (log L, d log L / d theta as runs x params)
LogModel = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Form:
    """One law's formula: the fitted parameters' names, the model in log space with its
    Jacobian, how fitted parameters map to named constants, the box and the starts."""

    name: str
    params: tuple[str, ...]
    log_model: LogModel
    constants: Callable[[np.ndarray], dict[str, float]]
    theta: Callable[[dict[str, float]], np.ndarray]
    bounds: Callable[[float], tuple[list[float], list[float]]]  # (lowest loss) -> (lo, hi)
    starts: Callable[[float, np.ndarray, np.ndarray], np.ndarray]  # (low, ln N, ln D)
    floor: str | None = "E"  # the constant that is the irreducible loss, if any

    def predict(self, constants: dict[str, float], n, d) -> np.ndarray:
        ln_n, ln_d = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
        value, _ = self.log_model(self.theta(constants), np.atleast_1d(ln_n),
                                  np.atleast_1d(ln_d), jac=False)
        out = np.exp(value)
        return out.reshape(np.broadcast(ln_n, ln_d).shape)


def _sum_of_terms(terms: list[np.ndarray], grads: list[np.ndarray] | None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """log(sum of terms) and, when ``grads`` (d sum / d theta, one array a parameter) are
    given, its Jacobian. ``+ 0.0``: bit for bit what summing each term's zero-padded
    gradient gave (-0.0 became 0.0), without building them (a fit evaluates this some
    10^5 times)."""
    total = functools.reduce(operator.add, terms)  # in order, as summing the stack did
    if grads is None:
        return np.log(total), None
    # runs x params in C order, as np.stack(grads, 1) was: the fit sums its columns over
    # the runs, and numpy sums a C-ordered axis 0 in another order than an F-ordered one
    if total.ndim != 1:  # not a fit's runs
        return np.log(total), (np.stack(grads, 1) + 0.0) / total[:, None]
    jac = np.empty((len(total), len(grads)))
    np.divide((np.array(grads) + 0.0).T, total[:, None], out=jac)
    return np.log(total), jac


# Each model takes theta either as one vector (a fit step: values and Jacobian) or as
# columns of many (theta.T[..., None]: the grid screened at once, values only).


def _chinchilla_model(theta, ln_n, ln_d, jac=True):
    a, b, e, alpha, beta = theta
    ta, tb, te = np.exp(a - alpha * ln_n), np.exp(b - beta * ln_d), np.exp(e) + 0 * ln_n
    if not jac:
        return _sum_of_terms([ta, tb, te], None)
    return _sum_of_terms([ta, tb, te], [ta, tb, te, -ta * ln_n, -tb * ln_d])


def _shared_model(theta, ln_n, ln_d, jac=True):
    a, b, e, alpha = theta
    ta, tb, te = np.exp(a - alpha * ln_n), np.exp(b - alpha * ln_d), np.exp(e) + 0 * ln_n
    if not jac:
        return _sum_of_terms([ta, tb, te], None)
    return _sum_of_terms([ta, tb, te], [ta, tb, te, -ta * ln_n - tb * ln_d])


def _no_floor_model(theta, ln_n, ln_d, jac=True):
    a, b, alpha, beta = theta
    ta, tb = np.exp(a - alpha * ln_n), np.exp(b - beta * ln_d)
    if not jac:
        return _sum_of_terms([ta, tb], None)
    return _sum_of_terms([ta, tb], [ta, tb, -ta * ln_n, -tb * ln_d])


def _broken_model(theta, ln_n, ln_d, jac=True):
    a, b, e, alpha, beta, lnb, delta = theta
    soft = np.logaddexp(0.0, ln_n - lnb)            # log(1 + N/Nb)
    ta = np.exp(a - alpha * ln_n - delta * soft)
    tb, te = np.exp(b - beta * ln_d), np.exp(e) + 0 * ln_n
    if not jac:
        return _sum_of_terms([ta, tb, te], None)
    sig = np.exp(ln_n - lnb - soft)                 # N/Nb / (1 + N/Nb)
    return _sum_of_terms([ta, tb, te], [ta, tb, te, -ta * ln_n, -tb * ln_d,
                                        ta * delta * sig, -ta * soft])


LN6 = math.log(FLOPS_PER_PARAM_TOKEN)


def _compute_model(theta, ln_n, ln_d, jac=True):
    a, b, c = theta                                 # a C^b + c with a = exp(a)
    ln_c = LN6 + ln_n + ln_d
    p, pc = np.exp(a + b * ln_c), c + 0 * ln_c
    if not jac:
        return _sum_of_terms([p, pc], None)
    return _sum_of_terms([p, pc], [p, p * ln_c, np.ones_like(p)])


def _grid(*axes) -> np.ndarray:
    return np.array(list(itertools.product(*axes)), float)


def _scale_axes() -> tuple[np.ndarray, np.ndarray]:
    return np.arange(0, 30, 5.0), np.arange(0, 30, 5.0)


def _e_axis(low: float) -> np.ndarray:
    return np.log(low * np.array([0.1, 0.3, 0.5, 0.7, 0.9]))


FORMS: dict[str, Form] = {
    "chinchilla": Form(
        "chinchilla", ("a", "b", "e", "alpha", "beta"), _chinchilla_model,
        lambda t: {"E": math.exp(t[2]), "A": math.exp(t[0]), "B": math.exp(t[1]),
                   "alpha": float(t[3]), "beta": float(t[4])},
        lambda c: np.array([math.log(c["A"]), math.log(c["B"]), math.log(max(c["E"], 1e-300)),
                            c["alpha"], c["beta"]]),
        lambda low: ([-10, -10, -10, 0.01, 0.01], [60, 60, math.log(low), 3.0, 3.0]),
        # Hoffmann et al.'s grid, section D.2 (alpha = 0 left out: degenerate)
        lambda low, ln_n, ln_d: _grid(*_scale_axes(), np.arange(-1, 1.5, 0.5),
                                      np.arange(0.5, 2.5, 0.5), np.arange(0.5, 2.5, 0.5))),
    "shared": Form(
        "shared", ("a", "b", "e", "alpha"), _shared_model,
        lambda t: {"E": math.exp(t[2]), "A": math.exp(t[0]), "B": math.exp(t[1]),
                   "alpha": float(t[3])},
        lambda c: np.array([math.log(c["A"]), math.log(c["B"]), math.log(max(c["E"], 1e-300)),
                            c["alpha"]]),
        lambda low: ([-10, -10, -10, 0.01], [60, 60, math.log(low), 3.0]),
        lambda low, ln_n, ln_d: _grid(*_scale_axes(), _e_axis(low), np.arange(0.1, 1.6, 0.2))),
    "no_floor": Form(
        "no_floor", ("a", "b", "alpha", "beta"), _no_floor_model,
        lambda t: {"E": 0.0, "A": math.exp(t[0]), "B": math.exp(t[1]), "alpha": float(t[2]),
                   "beta": float(t[3])},
        lambda c: np.array([math.log(c["A"]), math.log(c["B"]), c["alpha"], c["beta"]]),
        lambda low: ([-10, -10, 0.001, 0.001], [60, 60, 3.0, 3.0]),
        lambda low, ln_n, ln_d: _grid(*_scale_axes(), [0.02, 0.05, 0.1, 0.3, 0.6],
                                      [0.02, 0.05, 0.1, 0.3, 0.6]), floor=None),
    "broken": Form(
        "broken", ("a", "b", "e", "alpha", "beta", "ln_nb", "delta"), _broken_model,
        lambda t: {"E": math.exp(t[2]), "A": math.exp(t[0]), "B": math.exp(t[1]),
                   "alpha": float(t[3]), "beta": float(t[4]), "Nb": math.exp(t[5]),
                   "delta": float(t[6])},
        lambda c: np.array([math.log(c["A"]), math.log(c["B"]), math.log(max(c["E"], 1e-300)),
                            c["alpha"], c["beta"], math.log(c["Nb"]), c["delta"]]),
        lambda low: ([-10, -10, -10, 0.0, 0.01, -50, -1.0], [60, 60, math.log(low), 3.0, 3.0,
                                                              80, 2.0]),
        # the break starts among the sizes trained
        lambda low, ln_n, ln_d: _grid([2.0, 6.0, 12.0], [2.0, 6.0, 12.0], _e_axis(low)[[0, 3]],
                                      [0.1, 0.3], [0.3], np.quantile(ln_n, [0.25, 0.5, 0.75]),
                                      [-0.1, 0.2])),
    "compute": Form(
        "compute", ("a", "b", "c"), _compute_model,
        lambda t: {"a": math.exp(t[0]), "b": float(t[1]), "c": float(t[2])},
        lambda c: np.array([math.log(c["a"]), c["b"], c["c"]]),
        lambda low: ([-60, -1.0, 0.0], [60, 0.0, low]),
        # a's starts put a C^b at a fraction of the loss at the runs' mean C
        lambda low, ln_n, ln_d: np.array([
            [math.log(low * f) - b * (LN6 + float(np.mean(ln_n + ln_d))), b, low * g]
            for f in (0.05, 0.2, 0.5, 1.0, 2.0) for b in (-1.0, -0.5, -0.25, -0.1, -0.05, -0.02)
            for g in (0.0, 0.3, 0.6, 0.8, 0.95)]), floor="c"),
}


@dataclass(frozen=True)
class Law:
    """A fitted law: the form's name and its constants (what fit.json records)."""

    form: str
    constants: dict[str, float]

    def predict(self, n, d) -> np.ndarray:
        """The loss at N parameters and D tokens (L(C) reads C = 6 N D)."""
        return FORMS[self.form].predict(self.constants, n, d)

    @property
    def floor(self) -> float | None:
        key = FORMS[self.form].floor
        return None if key is None else self.constants[key]

    def exponents(self) -> dict[str, float]:
        return {k: v for k, v in self.constants.items() if k in ("alpha", "beta", "b")}

    def as_dict(self) -> dict:
        return {"form": self.form, "constants": dict(self.constants)}


def law_from_dict(record: dict) -> Law:
    """A Law from what ``Law.as_dict`` wrote (fit.json's ``chosen``)."""
    form = record["form"]
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; the forms: {', '.join(FORMS)}")
    return Law(form, {k: float(v) for k, v in record["constants"].items()})
