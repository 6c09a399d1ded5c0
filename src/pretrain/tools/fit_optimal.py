"""``tools/scaling_law.py --predict-optimal C``: the loss, N and D at the compute optimum of
budget C = 6ND, by Hoffmann et al.'s approach 2 (the iso-FLOP frontier) or 3 (L(N, D)'s
optimum), chosen by the ladder's own backtest (pretrain/analysis/optimal_choice.py); one
line per budget, or one line refusing.

    python tools/scaling_law.py --points docs/ladder/published/TABLE.csv --max-flops 4e17 \\
        --predict-optimal 6.4e18 --heldout NAME-OF-BEST-RUN --no-plots --out /tmp/opt
"""

from __future__ import annotations

import argparse
import math

from pretrain.analysis.optimal_choice import Choice, Optimum, predict_optimal
from pretrain.analysis.runs import RunPoint


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--predict-optimal", type=float, action="append", default=[], metavar="C",
                    help="the loss, N and D at the compute optimum of budget C (FLOPs, 6ND), "
                         "by the iso-FLOP frontier (approach 2) or L(N, D)'s optimum "
                         "(approach 3), whichever the ladder's backtest scores better; "
                         "repeatable")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%" if math.isfinite(x) else "n/a"


def print_choice(choice: Choice) -> None:
    cuts = ", ".join(f"{c.flops:.3g}" for c in choice.cuts) or "none"
    print(f"\ncompute-optimal loss: backtest fitted at or under each cut ({cuts}), scored on "
          "the best run of the top budgets above it (or the top rungs)")
    for which in ("2", "3"):
        if which in choice.refused:
            print(f"  approach {which}: refused: {choice.refused[which]}")
        else:
            mark = "  <- chosen" if which == choice.chosen else ""
            print(f"  approach {which}: backtest score {_pct(choice.scores[which])}{mark}")


def line(o: Optimum) -> str:
    """The one line of a budget's answer."""
    text = (f"C={o.flops:.3g}: loss {o.loss:.4f} [{o.interval[0]:.4f}, {o.interval[1]:.4f}] at "
            f"N={o.n_params:.3g}, D={o.tokens:.3g} (approach {o.approach}, backtest score "
            f"{_pct(o.score)})")
    if o.measured is not None:
        text += (f"; measured best run {o.measured.name} {o.measured.loss:.4f}, error "
                 f"{100 * o.error:+.2f}%, " + ("inside" if o.covered else "OUTSIDE")
                 + " the interval")
    return text


def report_optimal(points: list[RunPoint], heldout: list[RunPoint], at: list[float],
                   fit: dict, resamples: int, noise: float = math.nan) -> list[Optimum]:
    """Choose, predict and print each budget of ``at``; recorded in ``fit["optimal"]``."""
    choice, found = predict_optimal(points, at, heldout, resamples, noise=noise)
    print_choice(choice)
    fit["optimal"] = {**choice.as_dict(), "budgets": [o.as_dict() for o in found]}
    if choice.chosen is None:
        for c in at:
            print(f"C={c:.3g}: REFUSED, not a prediction: {choice.why_not}")
        fit["optimal"]["budgets"] = [{"flops": c, "refused": choice.why_not} for c in at]
        return []
    for o in found:
        print(line(o))
    return found
