"""``tools/scaling_law.py``'s fit policy: which rows are the ladder and which are held out,
the candidates' backtests, the choice, and the predictions with their intervals
(pretrain/analysis/policy.py, prediction.py; docs/ladder/published.md).

    python tools/scaling_law.py --points ../shared/ladders/gadre2024/runs.csv \\
        --select dataset=rpj --max-flops 2.04e19 --heldout 'rpj-open_lm_7b-1.0' --policy
"""

from __future__ import annotations

import argparse
import math
import re

from pretrain.analysis.policy import candidates
from pretrain.analysis.prediction import Choice, Prediction, choose, predict, refusal
from pretrain.analysis.runs import RunPoint
from pretrain.analysis.scaling import FitReport
from pretrain.errors import UserError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("the ladder and its held-out runs (tables from elsewhere too)")
    g.add_argument("--select", action="append", default=[], metavar="COLUMN=VALUE",
                   help="keep only the runs whose CSV column equals VALUE (e.g. dataset=rpj), "
                        "repeatable")
    g.add_argument("--max-flops", type=float, metavar="C",
                   help="the ladder: the runs at or under C = 6ND (the rest are left out "
                        "unless held out)")
    g.add_argument("--ladder", metavar="REGEX",
                   help="the ladder: the runs whose name matches REGEX (whole name)")
    g.add_argument("--heldout", action="append", default=[], metavar="REGEX",
                   help="runs to predict, not fit, by name (whole name), repeatable: each "
                        "one's prediction, error and interval printed and in fit.json")
    g.add_argument("--policy", action="store_true",
                   help="choose the law, the count of N and the runs by the ladder's own "
                        "backtest (docs/ladder/published.md) and predict with it")
    g.add_argument("--loo", nargs="*", metavar="LADDER",
                   help="the policy chosen leave-one-ladder-out over the ladders of "
                        "docs/ladder/published/ladders.toml (or those named): each ladder "
                        "predicted by the variant the others choose (tools/leave_one_out.py)")


def _match(pattern: str, name: str) -> bool:
    return re.fullmatch(pattern, name) is not None


def select(points: list[RunPoint], args: argparse.Namespace
           ) -> tuple[list[RunPoint], list[RunPoint]]:
    """(ladder, held out) by ``--select``, ``--heldout``, ``--max-flops`` and ``--ladder``;
    each selection that matches nothing is an error that names it."""
    for cond in args.select:
        col, sep, value = cond.partition("=")
        if not sep:
            raise UserError(f"--select {cond!r}: write COLUMN=VALUE, e.g. dataset=rpj")
        kept = [p for p in points if p.fields.get(col) == value]
        if not kept:
            have = sorted({p.fields[col] for p in points if col in p.fields})
            raise UserError(f"--select {cond}: no run has {col} = {value!r}"
                            + (f" (the values: {', '.join(have[:12])})" if have else
                               f" (no run has a column {col!r})"))
        points = kept
    heldout = [p for p in points if any(_match(h, p.name) for h in args.heldout)]
    for h in args.heldout:
        if not any(_match(h, p.name) for p in points):
            raise UserError(f"--heldout {h!r}: no run's name matches it (whole name; e.g. "
                            f"{points[-1].name!r})")
    ladder = [p for p in points if p not in heldout]
    if args.max_flops:
        ladder = [p for p in ladder if p.flops <= args.max_flops]
    if args.ladder:
        ladder = [p for p in ladder if _match(args.ladder, p.name)]
    if not ladder:
        raise UserError("the selection leaves no run to fit: check --select, --max-flops and "
                        "--ladder")
    return ladder, heldout


def print_choice(choice: Choice) -> None:
    rs = ", ".join(f"{r:.3g}" for r in choice.ratios) or "none"
    print(f"\nfit policy: each candidate backtested at {rs}x (fitted to the runs at or under "
          "1/r of the largest compute, scored on the top rungs within 2x of it); score = "
          "mean over r of the top rungs' mean |error|")
    for s in choice.scored:
        chosen = choice.chosen is not None and s.candidate == choice.chosen.candidate
        mark = "  <- chosen" if chosen else ""
        score = f"{100 * s.score:6.2f}%" if math.isfinite(s.score) else "     - "
        print(f"  {s.candidate.name:<38} {score}{mark}")
        if s.refused:
            print(f"      refused: {s.refused}")
    if choice.chosen is None:
        print("  NO PREDICTION: every candidate was refused; the ladder does not hold a law "
              "that carries beyond it")
    else:
        law = choice.chosen.law
        print(f"  chosen: {choice.chosen.candidate.name}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in law.constants.items()))


def print_predictions(preds: list[Prediction], title: str) -> None:
    if not preds:
        return
    print(f"\n{title} (interval: the bootstrap's spread, the backtest score and the seed "
          "spread where measured, in quadrature):")
    for p in preds:
        line = (f"  {p.name[-40:]:<40} N {p.n_params:.4g} D {p.tokens:.4g}: {p.loss:.4f} "
                f"[{p.interval[0]:.4f}, {p.interval[1]:.4f}] (width {100 * p.width:.1f}%)")
        if p.measured is not None:
            line += (f"; measured {p.measured:.4f}, error {100 * p.error:+.2f}%, "
                     + ("inside" if p.covered else "OUTSIDE") + " the interval")
        print(line)
    known = [p for p in preds if p.measured is not None]
    if known:
        errs = [abs(p.error) for p in known]
        print(f"  held out: mean |error| {100 * sum(errs) / len(errs):.2f}%, worst "
              f"{100 * max(errs):.2f}%, {sum(bool(p.covered) for p in known)} of {len(known)} "
              "inside their interval")


def report_policy(ladder: list[RunPoint], heldout: list[RunPoint],
                  at: list[tuple[float, float]], fit: dict, resamples: int,
                  noise: float = math.nan) -> Choice:
    """Choose by backtest, predict the held-out runs and the ``--predict`` points; recorded
    in ``fit["policy"]``."""
    points = [RunPoint(f"N={n:.4g},D={d:.4g}", n, d, 6 * n * d, math.nan) for n, d in at]
    # a count of N is a candidate only where every target has it (a --predict point gives N
    # in --count's units alone, a table's held-out row may give its non-embedding count too)
    targets = [*heldout, *points]
    cands = [c for c in candidates(ladder, targets=targets)
             if all(t.count(c.count) is not None for t in targets)]
    choice = choose(ladder, cands, noise=noise, targets=targets)
    print_choice(choice)
    why = refusal(choice)
    held, asked = [], []
    if why and choice.chosen is not None:
        print(f"  REFUSED, not a prediction: {why}")
    elif not why:
        held = predict(choice, ladder, heldout, resamples, noise=noise)
        asked = predict(choice, ladder, points, resamples, noise=noise)
    print_predictions(held, "held-out runs, predicted by the chosen candidate")
    print_predictions(asked, "--predict points")
    fit["policy"] = {**choice.as_dict(), "ladder": [p.name for p in ladder],
                     "heldout": [p.as_dict() for p in held],
                     "predict": [p.as_dict() for p in asked], "refused": why}
    if choice.chosen is not None and not why:  # what tools/ladder_check.py predicts with
        c = choice.chosen
        fit["chosen"] = {**c.law.as_dict(), "count": c.candidate.count,
                         "min_tokens_per_param": c.candidate.min_tpp,
                         "data_regime": c.candidate.regime,
                         "runs": len(c.candidate.groups(ladder, targets)[-1][0]),
                         "score": c.score}
    return choice


def refusals(points: list[RunPoint], reports: dict[str, FitReport | None], fit: dict
             ) -> dict[str, str]:
    """Why each fitted law is degenerate (pretrain/analysis/policy.degenerate), by law;
    recorded beside each law in ``fit``."""
    from pretrain.analysis.laws import Law
    from pretrain.analysis.policy import degenerate
    from pretrain.analysis.scaling import ChinchillaLaw, compute_frontier

    noise = fit.get("seed_spread", {}).get("relative", float("nan"))
    out = {}
    for name, rep in reports.items():
        if rep is None:
            continue
        form = "chinchilla" if isinstance(rep.law, ChinchillaLaw) else "compute"
        runs = points if form == "chinchilla" else compute_frontier(points)
        why = degenerate(Law(form, dict(vars(rep.law))), runs, noise=noise)
        if why:
            out[name] = why
            fit["chinchilla_law" if form == "chinchilla" else "compute_law"]["refused"] = why
    return out


def instead(law: str, refused: dict[str, str], fit: dict) -> str:
    """What is used in place of a refused law, in words."""
    chosen = (fit.get("policy") or {}).get("chosen")
    if law == "L(N, D)" and chosen:
        return f"used instead: the fit policy's choice, {chosen['candidate']} (above)"
    if law == "L(N, D)" and "L(C)" not in refused and "compute_law" in fit:
        return "used instead: L(C), the compute frontier's fit (below)"
    return "no fit of these runs holds; add runs nearer each budget's optimum"
