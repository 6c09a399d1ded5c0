"""When a scaling-law prediction extrapolates past what its fit supports.

A fitted law prints a number for any target; whether the runs support that number is a
separate question, and the tool answers it beside the number (tools/scaling_law.py): a
prediction with any of these warnings is printed as *extrapolated*, not as a result.

- **Too few sizes or token counts**: fewer than ``MIN_DISTINCT`` (3) distinct N, or D for
  L(N, D): no run tests the trend the prediction follows. (Fewer runs than the form has
  constants is refused by the fit itself, and exactly as many, 3 budgets for L(C), is
  pretrain/analysis/scaling.py's warning.)
- **A wide bootstrap interval**: the 95% interval of the predicted loss wider than
  ``max_interval`` (default 5%) of the loss, or no interval at all (no bootstrap, or too few
  usable resamples): the runs do not pin the prediction down to that bound.
- **Far in compute**: the target more than ``max_ratio`` (default 100x) the largest run's
  compute. Ladders predict reliably a few steps of scale out (OLMo's ladders: 7B/13B from
  runs up to 1B); how far is a judgement, stated as a flag.
- **Far in size**: the point's N more than ``max_size_ratio`` (default 3x) the largest size
  run: the N term is extrapolated (the byte ladder's held-out run at 4.7x its largest size
  missed by 10%, docs/benchmarks.md).
- **Tokens beyond the corpus**: more than one epoch of the smallest corpus a run read
  (pretrain/analysis/target_data.py).

One function, ``verdict``, gives every point its verdict: the target (L(N, D)'s at its
compute-optimal (N_opt, D_opt), with the loss's interval at that point) and each
``--predict N,D`` (a held-out run's point, which need not be the compute-optimal one), so
the same (N, D) gets the same verdict whichever way it was asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import ChinchillaLaw, Estimate, FitReport, _estimate
from pretrain.analysis.target_data import corpus_tokens

MIN_DISTINCT = 3
MAX_INTERVAL = 0.05  # relative width of the loss's 95% bootstrap interval
MAX_RATIO = 100.0  # target compute / the largest run's compute
MAX_SIZE_RATIO = 3.0  # a point's N / the largest size run's


@dataclass(frozen=True)
class Bounds:
    """What a prediction may lean on before it is called an extrapolation."""

    max_interval: float = MAX_INTERVAL
    max_ratio: float = MAX_RATIO
    min_distinct: int = MIN_DISTINCT
    max_size_ratio: float = MAX_SIZE_RATIO

    def describe(self) -> str:
        """What a supported prediction met, for the verdict line."""
        return (f">= {self.min_distinct} sizes, 95% interval <= {100 * self.max_interval:.3g}%, "
                f"<= {self.max_ratio:.3g}x the largest run, N <= {self.max_size_ratio:.3g}x the "
                "largest size, < 1 epoch")


def _distinct(values: Sequence[float], rel_tol: float = 0.01) -> int:
    """How many values differ from each other by more than ``rel_tol`` (step rounding
    makes runs of one size or budget differ slightly)."""
    count, last = 0, None
    for v in sorted(values):
        if last is None or v > last * (1 + rel_tol):
            count, last = count + 1, v
    return count


def support_warnings(points: Sequence[RunPoint], law: str, bounds: Bounds = Bounds()
                     ) -> list[str]:
    """Too few sizes, token counts or runs for ``law`` ("L(C)" or "L(N, D)")."""
    out = []
    sizes = _distinct([p.n_params for p in points])
    if sizes < bounds.min_distinct:
        out.append(f"{law}: {sizes} distinct model size(s) (N): fewer than "
                   f"{bounds.min_distinct}, so no run tests the size trend the prediction "
                   "extrapolates; add sizes")
    if law == "L(N, D)":
        tokens = _distinct([p.tokens for p in points])
        if tokens < bounds.min_distinct:
            out.append(f"{law}: {tokens} distinct token count(s) (D): fewer than "
                       f"{bounds.min_distinct}; add budgets (cooldown branches)")
    return out


def interval_bound_warnings(est: Estimate | None, law: str, bounds: Bounds = Bounds()
                            ) -> list[str]:
    """The predicted loss's 95% bootstrap interval is missing or wider than the bound."""
    if est is None:
        return []
    if not (math.isfinite(est.low) and math.isfinite(est.high)):
        return [f"{law}: the predicted loss has no bootstrap interval (no resamples, or too "
                "few could be fitted): nothing says how far to trust it"]
    width = (est.high - est.low) / est.value
    if width > bounds.max_interval:
        return [f"{law}: the predicted loss's 95% interval [{est.low:.4g}, {est.high:.4g}] "
                f"is {100 * width:.1f}% of the loss, wider than the "
                f"{100 * bounds.max_interval:.3g}%"
                " bound (--max-interval): the runs do not determine it"]
    return []


def compute_ratio_warnings(points: Sequence[RunPoint], target_flops: float,
                           bounds: Bounds = Bounds()) -> list[str]:
    """The target is more than ``max_ratio`` times the largest run's compute."""
    largest = max(p.flops for p in points)
    ratio = target_flops / largest
    if ratio <= bounds.max_ratio:
        return []
    return [f"the target C = {target_flops:.3g} is {ratio:.3g}x the largest run "
            f"({largest:.3g}), beyond the {bounds.max_ratio:.3g}x bound (--max-ratio): an "
            "extrapolation no run of the ladder supports; add a larger size"]


def size_ratio_warnings(points: Sequence[RunPoint], n_params: float,
                        bounds: Bounds = Bounds()) -> list[str]:
    """The point's N is more than ``max_size_ratio`` times the largest size run."""
    largest = max(p.n_params for p in points)
    ratio = n_params / largest
    if ratio <= bounds.max_size_ratio:
        return []
    return [f"N = {n_params:.4g} is {ratio:.3g}x the largest size run ({largest:.4g}), beyond "
            f"the {bounds.max_size_ratio:.3g}x bound (--max-size-ratio): the N term is "
            "extrapolated; add a larger size"]


def epoch_warnings(points: Sequence[RunPoint], tokens: float, law: str) -> list[str]:
    """The point's tokens are more than one epoch of the corpus the runs read."""
    corpus = corpus_tokens(points)
    if not corpus or tokens <= corpus:
        return []
    return [f"{law}: its {tokens:,.0f} tokens are {tokens / corpus:.3g} epochs of the corpus "
            f"({corpus:,.0f} tokens; the fit predicts fresh data)"]


def verdict(points: Sequence[RunPoint], law: str, est: Estimate | None, flops: float,
            tokens: float | None = None, n_params: float | None = None,
            bounds: Bounds = Bounds()) -> list[str]:
    """Every reason the prediction ``est`` by ``law`` at compute ``flops`` (and, where the
    law names them, ``tokens`` D and size ``n_params`` N) is past what the fit supports;
    empty: supported. The one verdict of the target and of every ``--predict`` point."""
    out = (support_warnings(points, law, bounds) + interval_bound_warnings(est, law, bounds)
           + compute_ratio_warnings(points, flops, bounds))
    if n_params is not None:
        out += size_ratio_warnings(points, n_params, bounds)
    if tokens is not None:
        out += epoch_warnings(points, tokens, law)
    return out


def predict_at(rep: FitReport, n_params: float, tokens: float) -> Estimate:
    """L(N, D) of the fit at one (N, D), with the bootstrap's spread."""
    law = rep.law
    if not isinstance(law, ChinchillaLaw):
        raise TypeError("predict_at needs the L(N, D) fit")
    samples = np.array([float(s.predict(n_params, tokens)) for s in rep.samples])
    return _estimate(float(law.predict(n_params, tokens)), samples)


def parse_point(text: str) -> tuple[float, float]:
    """``N,D`` (e.g. ``4.0e5,8.1e6``) as (N, D)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--predict takes N,D (two numbers, e.g. 4e5,8e6), got {text!r}")
    n, d = (float(x) for x in parts)
    if n <= 0 or d <= 0:
        raise ValueError(f"--predict: N and D must be positive, got {text!r}")
    return n, d
