"""Whether the fit policy's decisions are a property of the runs or of the arithmetic: the
policy (analysis/prediction.py) run again with the inputs jittered by a relative 1e-9, and
with twice the optimizer's starts, must choose the same candidate, refuse the same ones and
predict the same figures (issue 68). The BLAS kernels are the third perturbation: OpenBLAS
reads OPENBLAS_CORETYPE when it loads, so each setting is its own process
(``python -m pretrain.tools.fit_stability``; tests/test_fit_stability.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from pretrain.analysis import policy
from pretrain.analysis.prediction import choose, predict
from pretrain.analysis.runs import RunPoint
from pretrain.errors import cli

FIGURE_TOLERANCE = 5e-4  # a figure may move by 0.05 percentage points, no more (issue 68)


def jittered(points: Sequence[RunPoint], rel: float, seed: int = 0) -> list[RunPoint]:
    """The runs with N (every count), D and the loss each scaled by 1 + rel * a standard
    normal draw."""
    rng = np.random.default_rng(seed)
    out = []
    for p in points:
        f = 1 + rel * rng.standard_normal(3)
        n, d = p.n_params * f[0], p.tokens * f[1]
        out.append(dataclasses.replace(
            p, n_params=n, tokens=d, flops=p.flops * f[0] * f[1], loss=p.loss * f[2],
            counts={k: v * f[0] for k, v in p.counts.items()}))
    return out


def decisions(points: Sequence[RunPoint], targets: Sequence[RunPoint], keep: int | None = None
              ) -> dict:
    """The policy's decisions on a ladder: the candidate chosen, those refused, every live
    candidate's score and the chosen one's prediction at each target (no bootstrap)."""
    saved = policy.KEEP
    policy.KEEP = keep or saved
    try:
        choice = choose(points, targets=targets)
    finally:
        policy.KEEP = saved
    s = choice.chosen
    return {"chosen": s.candidate.name if s else None,
            "refused": sorted(x.candidate.name for x in choice.scored if x.refused),
            "scores": {x.candidate.name: x.score for x in choice.scored if not x.refused},
            "predictions": {p.name: p.error for p in predict(choice, points, targets, 0)}}


def differences(a: dict, b: dict, tolerance: float = FIGURE_TOLERANCE) -> list[str]:
    """What differs between two ``decisions``: a choice, a refusal, or a score or error
    that moved by more than ``tolerance``."""
    out = [f"{k}: {a[k]} vs {b[k]}" for k in ("chosen", "refused") if a[k] != b[k]]
    for k in ("scores", "predictions"):
        for name in sorted(set(a[k]) | set(b[k])):
            x, y = a[k].get(name, math.nan), b[k].get(name, math.nan)
            if not abs(x - y) <= tolerance:
                out.append(f"{k} {name}: {100 * x:+.3f}% vs {100 * y:+.3f}%")
    return out


def summary(name: str, d: dict) -> str:
    """One line of ``decisions``: the choice, its score, the refusals and the errors."""
    scores = d["scores"]
    chosen = d["chosen"]
    head = (f"{chosen} (score {100 * scores[chosen]:.4f}%)" if chosen else "nothing")
    errors = " ".join(f"{100 * e:+.4f}%" for e in d["predictions"].values())
    return f"{name}: chose {head}; {len(d['refused'])} refused; held-out errors {errors}"


@cli
def main(argv: list[str] | None = None) -> int:
    """Print ``decisions`` of the published ladders (docs/ladder/published.md), one line each
    (or JSON), to compare across OPENBLAS_CORETYPE settings: ``OPENBLAS_CORETYPE=Haswell
    python -m pretrain.tools.fit_stability rw_original``."""
    import argparse
    import json

    from pretrain.tools.ladders_manifest import ladder_and_targets, read_manifest

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("ladders", nargs="*", default=list(read_manifest())[:4])
    ap.add_argument("--json", action="store_true", help="the decisions as JSON")
    ap.add_argument("--jitter", type=float, default=0.0, metavar="REL",
                    help="scale N, D and the loss by 1 + REL x a normal draw (seed 0)")
    ap.add_argument("--keep", type=int, metavar="K", help="descents per fit (policy.KEEP)")
    args = ap.parse_args(argv)
    out = {}
    for name in args.ladders:
        ladder, targets = ladder_and_targets(name)
        out[name] = decisions(jittered(ladder, args.jitter) if args.jitter else ladder,
                              targets, args.keep)
    print(json.dumps(out) if args.json else "\n".join(summary(k, v) for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
