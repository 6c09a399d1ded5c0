"""The fit policy chosen leave-one-ladder-out (issue 68, docs/ladder/published.md): for each
ladder of docs/ladder/published/ladders.toml, the policy's free choices are fixed on the
other ladders' held-out runs, and then predict the one left out.

    python tools/scaling_law.py --loo                  # every ladder of the manifest

The free choices are a few discrete variants (``VARIANTS``): which forms and counts of N the
candidates may use, whether the tokens-per-parameter filter is offered, and how far the
backtest cuts that score them reach, whether the prediction is divided by the backtest's
signed error at the target's distance, and the backtest score above which a ladder is
refused (5% or 10%). Each variant is evaluated on each ladder once (its choice depends on that
ladder's runs alone); for the ladder left out, the variant with the lowest mean |error| over
the other ladders' held-out runs is used, a run it refuses counting as a miss of
``REFUSED_AS`` there, and the interval's backtest term is scaled so that it would have covered
``COVERAGE`` of the other ladders' runs. A ladder is refused, in one line and not as a
prediction, when no candidate survives or the chosen one's own backtest score is above the
variant's threshold: a ladder that misses its own top rungs by that much from below has shown
it cannot carry its law further.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pretrain.analysis.optimal_choice import Optimum, predict_optimal
from pretrain.analysis.prediction import (
    REFUSE_SCORE,
    Choice,
    Prediction,
    Scored,
    choose,
    pick,
    predict,
    refusal,
)
from pretrain.analysis.runs import RunPoint

STRICT = 0.05         # the other refusal threshold the variants offer (prediction.REFUSE_SCORE)
REFUSED_AS = 0.05     # a refused run counts as a miss this large when variants are compared
COVERAGE = 0.9        # the share of held-out runs an interval is sized to cover


@dataclass(frozen=True)
class Variant:
    """One setting of the policy's free choices."""

    name: str
    forms: tuple[str, ...] = ("chinchilla", "shared")
    counts: tuple[str, ...] = ("total", "non_embedding", "flops")
    data_filter: bool = True          # offer the tokens-per-parameter filter
    max_ratio: float = math.inf       # the farthest backtest cut scored (and refused at)
    corrected: bool = False           # divide by 1 + the backtest's signed error at the
                                      # target's distance, where the backtest reached it
    refuse_score: float = STRICT      # refuse the ladder above this backtest score
    regime: bool = False              # offer the data-regime candidates
    optimal: bool = False             # a target that is the best run of its budget: the
                                      # compute-optimal loss there (--predict-optimal)

    def admits(self, s: Scored) -> bool:
        c = s.candidate
        return (c.form in self.forms and c.count in self.counts
                and (self.data_filter or not c.min_tpp) and (self.regime or not c.regime))


VARIANTS = (   # the broadest first: a tie on the other ladders keeps the ladder's own choice
    Variant("with the data regime, cuts to 64x, refused over 10%, optimal targets by the "
            "frontier", regime=True, refuse_score=REFUSE_SCORE, optimal=True),
    Variant("every candidate, cuts to 64x, refused over 10%, optimal targets by the frontier",
            refuse_score=REFUSE_SCORE, optimal=True),
    Variant("with the data regime, cuts to 64x, refused over 10%", regime=True,
            refuse_score=REFUSE_SCORE),
    Variant("with the data regime, cuts to 64x", regime=True),
    Variant("with the data regime, cuts to 8x", regime=True, max_ratio=8.0),
    Variant("every candidate, cuts to 64x"),
    Variant("every candidate, cuts to 64x, bias-corrected", corrected=True),
    Variant("every candidate, cuts to 8x", max_ratio=8.0),
    Variant("shared exponent only", forms=("shared",)),
    Variant("Chinchilla's form only", forms=("chinchilla",)),
    Variant("N total, every run (no filter)", counts=("total",), data_filter=False),
    Variant("every candidate, cuts to 64x, refused over 10%", refuse_score=REFUSE_SCORE),
    Variant("every candidate, cuts to 64x, bias-corrected, refused over 10%", corrected=True,
            refuse_score=REFUSE_SCORE),
    Variant("every candidate, cuts to 8x, refused over 10%", max_ratio=8.0,
            refuse_score=REFUSE_SCORE),
)


def restrict(full: Choice, variant: Variant) -> Choice:
    """``full`` (every candidate backtested at every cut) as ``variant`` chooses: its
    candidates, scored and refused at its cuts only."""
    rs = [r for r in full.ratios if r <= variant.max_ratio * (1 + 1e-9)]
    scored = []
    for s in full.scored:
        if not variant.admits(s):
            continue
        s = replace(s, by_ratio={r: v for r, v in s.by_ratio.items() if r in rs},
                    signed={r: v for r, v in s.signed.items() if r in rs})
        if s.refused and s.refused.startswith("fitted to the"):
            # refused at a cut: only a cut the variant scores refuses it
            failed = [(bt.ratio, bt.results[i]) for bt in full.backtests
                      for i, res in enumerate(bt.results)
                      if res.candidate == s.candidate and res.degenerate and bt.ratio in rs]
            s = replace(s, refused=(f"fitted to the {failed[0][1].fitted} runs under 1/"
                                    f"{failed[0][0]:.3g} of the top, {failed[0][1].degenerate}"
                                    if failed else None))
        scored.append(s)
    return Choice(rs, scored, pick(scored), full.backtests)


@dataclass
class Outcome:
    """A variant on one ladder: its choice, and the predictions or why it refused."""

    choice: Choice
    predictions: list[Prediction]
    refused: str | None
    scale: float = 1.0    # the backtest score's factor in the interval (interval_scale)
    how: list[str] = field(default_factory=list)   # each prediction's candidate or approach
    scores: list[float] = field(default_factory=list)  # the backtest score in its interval

    def score_of(self) -> list[float]:
        """Each prediction's backtest score (the chosen candidate's, unless set)."""
        return self.scores or [self.choice.chosen.score] * len(self.predictions)

    def errors(self, n_targets: int) -> list[float]:
        if self.refused:
            return [REFUSED_AS] * n_targets
        return [abs(p.error) for p in self.predictions]


def bias(signed: dict[float, float], distance: float) -> float:
    """The backtest's signed top-rung error at an extrapolation of ``distance`` (a target at
    R x the ladder's top is the top rungs' distance of the cut at r = R sqrt(2): they span
    r/2..r), interpolated in log r; 0 beyond the cuts backtested (no evidence there)."""
    rs = sorted(signed)
    r = distance * math.sqrt(2)
    if not rs or not rs[0] / 1.01 <= r <= rs[-1] * 1.01:
        return 0.0
    return float(np.interp(math.log(r), [math.log(x) for x in rs], [signed[x] for x in rs]))


def corrected(p: Prediction, factor: float) -> Prediction:
    return replace(p, loss=p.loss * factor, bootstrap=(p.bootstrap[0] * factor,
                                                       p.bootstrap[1] * factor),
                   interval=(p.interval[0] * factor, p.interval[1] * factor))


def outcome(choice: Choice, ladder: Sequence[RunPoint], targets: Sequence[RunPoint],
            resamples: int = 0, variant: Variant = Variant(""),
            optimal: dict[str, Optimum] | None = None) -> Outcome:
    """``variant``'s predictions of ``targets`` (``optimal``: the compute-optimal answer
    at the budget of each target that is its budget's best run, used by a variant that
    takes it), or why it refuses the ladder."""
    s = choice.chosen
    opt = {name: o for name, o in (optimal or {}).items() if variant.optimal}
    why = refusal(choice, variant.refuse_score)
    if why and not all(t.name in opt for t in targets):
        return Outcome(choice, [], why)
    rest = [t for t in targets if t.name not in opt]
    preds = predict(choice, ladder, rest, resamples) if rest else []
    if variant.corrected and rest:
        top = max(p.flops for p in ladder)
        preds = [corrected(p, 1 / (1 + bias(s.signed, t.flops / top)))
                 for p, t in zip(preds, rest, strict=True)]
    by = dict(zip((t.name for t in rest), preds, strict=True))
    out = Outcome(choice, [], None)
    for t in targets:
        if t.name in opt:
            o = opt[t.name]
            out.predictions.append(Prediction(t.name, o.n_params, o.tokens, o.loss,
                                              o.bootstrap, o.interval, t.loss))
            out.how.append(f"approach {o.approach} at C = {o.flops:.3g}")
            out.scores.append(o.score)
        else:
            out.predictions.append(by[t.name])
            out.how.append(s.candidate.name)
            out.scores.append(s.score)
    return out


def optimum_of(entry_optimal: Sequence[tuple[float, str]], ladder: Sequence[RunPoint],
               targets: Sequence[RunPoint], resamples: int) -> dict[str, Optimum]:
    """The compute-optimal answer (--predict-optimal) at the budget of each held-out run the
    manifest names as its budget's best; none where both approaches are refused."""
    names = {t.name for t in targets}
    wanted = [(c, run) for c, run in entry_optimal if run in names]
    if not wanted:
        return {}
    _, found = predict_optimal(ladder, [c for c, _ in wanted], resamples=resamples)
    return {run: o for (_, run), o in zip(wanted, found, strict=False)}


def select_variant(outcomes: dict[str, list[Outcome]], n_targets: dict[str, int],
                   left_out: str) -> int:
    """The variant with the lowest mean |error| over every held-out run of the ladders
    other than ``left_out`` (refused runs at REFUSED_AS); ties go to the earlier variant
    (VARIANTS lists the broadest first: where the other ladders cannot tell two apart, the
    left-out ladder's own backtest keeps the wider choice)."""
    means = []
    for v in range(len(next(iter(outcomes.values())))):
        errs = [e for name, outs in outcomes.items() if name != left_out
                for e in outs[v].errors(n_targets[name])]
        means.append(float(np.mean(errs)) if errs else math.inf)
    return int(np.argmin(means))


def leave_one_out(ladders: dict[str, tuple[list[RunPoint], list[RunPoint]]],
                  resamples: int = 100, log=print,
                  optimal: dict[str, Sequence[tuple[float, str]]] | None = None
                  ) -> list[tuple[str, str, Outcome]]:
    """(ladder, variant chosen on the others, its outcome there) for each ladder
    (``optimal``: each ladder's (budget, best run) pairs of the manifest)."""
    fulls, optima = {}, {}
    for name, (ladder, targets) in ladders.items():
        log(f"  backtesting {name} ({len(ladder)} runs)", flush=True)
        fulls[name] = choose(ladder, targets=targets)
        optima[name] = optimum_of((optimal or {}).get(name, ()), ladder, targets, 0)
    outcomes = {name: [outcome(restrict(fulls[name], v), *ladders[name], variant=v,
                               optimal=optima[name]) for v in VARIANTS] for name in ladders}
    n_targets = {name: len(t) for name, (_, t) in ladders.items()}
    out = []
    for name, (ladder, targets) in ladders.items():
        v = select_variant(outcomes, n_targets, name)
        opt = (optima[name] if not resamples  # the same fits as above: not made twice
               else optimum_of((optimal or {}).get(name, ()), ladder, targets, resamples))
        o = outcome(restrict(fulls[name], VARIANTS[v]), ladder, targets, resamples,
                    VARIANTS[v], opt)
        out.append((name, VARIANTS[v].name, widened(o, interval_scale(outcomes, v, name))))
    return out


def interval_scale(outcomes: dict[str, list[Outcome]], v: int, left_out: str) -> float:
    """How far the backtest score must be scaled for the interval to cover COVERAGE of the
    other ladders' held-out runs (variant ``v``, no bootstrap: the score alone, at the
    conformal quantile), at least 1: the interval's width is chosen leave-one-out too."""
    ratios = [abs(p.error) / score for name, outs in outcomes.items()
              if name != left_out and not (o := outs[v]).refused
              for p, score in zip(o.predictions, o.score_of(), strict=True)]
    if not ratios:
        return 1.0
    # split conformal prediction's quantile: the ceil((n + 1) q)-th smallest of n, so that
    # a new run is covered with probability >= q, not q less the n runs' optimism
    k = min(len(ratios), math.ceil((len(ratios) + 1) * COVERAGE))
    return max(1.0, float(sorted(ratios)[k - 1]))


def widened(o: Outcome, k: float) -> Outcome:
    """``o`` with the backtest score's part of each interval scaled by ``k`` (the bootstrap's
    part, the rest of the width, kept)."""
    if o.refused or k == 1.0:
        return o
    preds = []
    for p, score in zip(o.predictions, o.score_of(), strict=True):
        rel = (p.interval[1] - p.loss) / p.loss
        rel = math.sqrt(max(rel * rel - score * score, 0.0) + (k * score) ** 2)
        preds.append(replace(p, interval=(p.loss * (1 - rel), p.loss * (1 + rel))))
    return replace(o, predictions=preds, scale=k)


def print_table(rows: list[tuple[str, str, Outcome]],
                ladders: dict[str, tuple[list[RunPoint], list[RunPoint]]]) -> dict:
    """The leave-one-out table and its headline; returns the headline's numbers."""
    print("\n| ladder | variant (chosen on the others) | candidate | target | compute ratio "
          "| prediction | interval (width) | measured | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    errs, covered, widths, refused = [], 0, [], 0
    for name, vname, o in rows:
        ladder, targets = ladders[name]
        if o.refused:
            refused += len(targets)
            print(f"| {name} | {vname} | REFUSED: {o.refused} | {len(targets)} runs | | | | | |")
            continue
        top = max(p.flops for p in ladder)
        how_ = o.how or [o.choice.chosen.candidate.name] * len(o.predictions)
        for p, t, how in zip(o.predictions, targets, how_, strict=True):
            cand = f"{how} (interval x{o.scale:.2g})"
            errs.append(p.error)
            covered += bool(p.covered)
            widths.append(p.width)
            print(f"| {name} | {vname} | {cand} | {t.name} | {t.flops / top:.3g}x | "
                  f"{p.loss:.4f} | {p.interval[0]:.4f}-{p.interval[1]:.4f} "
                  f"({100 * p.width:.1f}%) | {p.measured:.4f} | {100 * p.error:+.2f}% |")
    n = len(errs)
    head = {"runs": n, "refused": refused, "mean_abs": float(np.mean(np.abs(errs))) if n else
            math.nan, "worst": float(np.max(np.abs(errs))) if n else math.nan,
            "covered": covered, "width_mean": float(np.mean(widths)) if n else math.nan,
            "width_range": (min(widths), max(widths)) if n else (math.nan, math.nan)}
    if n:
        print(f"\nleave-one-ladder-out: {n} held-out runs of {len(rows)} ladders predicted, "
              f"{refused} refused; mean |error| {100 * head['mean_abs']:.2f}%, worst "
              f"{100 * head['worst']:.2f}%; {covered} of {n} inside their interval "
              f"({100 * covered / n:.0f}%), widths {100 * head['width_range'][0]:.1f}-"
              f"{100 * head['width_range'][1]:.1f}% (mean {100 * head['width_mean']:.1f}%)")
    else:
        print(f"\nleave-one-ladder-out: no run predicted, {refused} refused")
    return head


def main_loo(names: Sequence[str] = (), resamples: int = 100) -> int:
    """``tools/scaling_law.py --loo [NAME ...]``: the leave-one-out table of the manifest's
    ladders (every ladder when no name is given)."""
    from pretrain.tools.ladders_manifest import ladder_and_targets, read_manifest

    entries = read_manifest()
    unknown = [n for n in names if n not in entries]
    if unknown:
        from pretrain.errors import UserError

        raise UserError(f"--loo {' '.join(unknown)}: not in the manifest (the ladders: "
                        f"{', '.join(entries)})")
    ladders = {n: ladder_and_targets(entries[n]) for n in (names or entries)}
    print(f"leave-one-ladder-out over {len(ladders)} ladders; the variants: "
          + "; ".join(v.name for v in VARIANTS))
    optimal = {n: entries[n].optimal for n in ladders}
    print_table(leave_one_out(ladders, resamples, optimal=optimal), ladders)
    return 0
