"""``tools/scaling_law.py``'s reports beside the fits: the seed spread (the noise floor),
``--diagnose`` (residuals, each size left out, the counts of N compared), the fit with E held
fixed (pretrain/analysis/fit_checks.py), ``--backtest R`` (analysis/backtest.py), the iso-FLOP
minima and ``--chinchilla``'s published optimum."""

from __future__ import annotations

from collections.abc import Callable

from pretrain.analysis.fit_checks import (
    e_profile,
    leave_size_out,
    residuals,
    seed_groups,
    seed_spread,
    sizes_of,
)
from pretrain.analysis.runs import COUNTS, RunPoint
from pretrain.analysis.scaling import (
    CHINCHILLA,
    FitReport,
    isoflop_bracketed,
    isoflop_groups,
    isoflop_minimum,
    isoflop_problem,
)


def report_seed_spread(points: list[RunPoint], fit: dict) -> None:
    """The seed-to-seed spread of the runs repeated at another seed: the noise floor."""
    rel, groups = seed_spread(points)
    if not groups:
        return
    fit["seed_spread"] = {"relative": rel, "groups": groups}
    pairs = seed_groups(points)
    sizes = sorted({g[0].n_params for g in pairs})
    print(f"\nseed spread: {100 * rel:.2f}% (pooled std of log loss over {groups} (N, D) points "
          f"run at {max(len(g) for g in pairs)} seeds, sizes N = "
          + ", ".join(f"{n:.4g}" for n in sizes) + "): the noise floor; no prediction of one "
          f"run can claim to be closer than about {100 * rel:.2g}%, and the intervals below "
          "include it")


def report_e_profile(points: list[RunPoint], predict: list[tuple[float, float]],
                     fit: dict) -> None:
    """How much the fit, and each ``--predict`` point, moves when E is held fixed."""
    print("L(N, D) with E held fixed (a fraction of the lowest loss): the fit's rms residual, "
          "and the --predict points")
    fit["e_profile"] = []
    for e, law, rms in e_profile(points):
        preds = [float(law.predict(n, d)) for n, d in predict]
        fit["e_profile"].append({"E": e, "alpha": law.alpha, "beta": law.beta, "rms": rms,
                                 "predict": preds})
        print(f"  E = {e:.4g}: alpha {law.alpha:.3f}, beta {law.beta:.3f}, rms {100 * rms:.2f}%"
              + "".join(f", {x:.4g}" for x in preds))


def report_diagnosis(points: list[RunPoint], chinchilla: FitReport | None, count: str,
                     fit: dict, collect: Callable[[str], list[RunPoint]]) -> None:
    """``--diagnose``: where the fit misses (residuals by size and by tokens/param), how
    each size is predicted by the others, and which count of N predicts the largest size
    best when it is left out (the ladder's own one-step extrapolation); ``collect(count)``:
    the same runs with N in another count."""
    if chinchilla is None:
        return
    res = residuals(chinchilla.law, points)
    print("\ndiagnosis: residuals of L(N, D), measured / fitted - 1, mean by size and by "
          "tokens/param:")
    for n in sizes_of(points):
        r = [x for p, x in res if abs(p.n_params - n) <= 1e-9 * n]
        print(f"  N = {n:>10.4g}: {100 * sum(r) / len(r):+6.2f}%  ({len(r)} runs)")
    by_tpp: dict[float, list[float]] = {}
    for p, x in res:
        by_tpp.setdefault(round(p.tokens / p.n_params, 1), []).append(x)
    for t in sorted(by_tpp):
        print(f"  D/N = {t:>6g}: {100 * sum(by_tpp[t]) / len(by_tpp[t]):+6.2f}%  "
              f"({len(by_tpp[t])} runs)")
    print("each size left out of the fit and predicted by the rest (predicted / measured - 1):")
    loso = []
    for n in sizes_of(points):
        try:
            _, errs = leave_size_out(points, n)
        except ValueError as e:
            print(f"  N = {n:>10.4g}: not fitted ({e})")
            continue
        mean = sum(e for _, e in errs) / len(errs)
        worst = max(errs, key=lambda pe: abs(pe[1]))
        loso.append({"n_params": n, "mean": mean, "worst": worst[1]})
        print(f"  N = {n:>10.4g}: mean {100 * mean:+6.2f}%, worst {100 * worst[1]:+6.2f}% "
              f"(D = {worst[0].tokens:.3g})")
    fit["leave_size_out"] = loso
    print("the largest size left out, by count of N (mean |error| of its runs):")
    fit["count_check"] = {}
    for c in COUNTS:
        pts = collect(c)
        if not pts:
            continue
        try:
            _, errs = leave_size_out(pts, sizes_of(pts)[-1])
        except ValueError as e:
            print(f"  {c:>13}: not fitted ({e})")
            continue
        mae = sum(abs(e) for _, e in errs) / len(errs)
        fit["count_check"][c] = mae
        print(f"  {c:>13}: {100 * mae:.2f}%" + ("  <- --count" if c == count else ""))


def _print_backtest(bt, points: list[RunPoint], spread: float, tolerance: float) -> None:
    import math

    top_c = max(p.flops for p in points)
    fitted = bt.results[0].fitted if bt.results else 0
    print(f"\nbacktest at {bt.ratio:g}x: fitted on the runs at C <= {bt.cut:.4g} (1/{bt.ratio:g} "
          f"of {top_c:.4g}), predicting the rest; top rungs: C >= {top_c / 2:.4g}; error = "
          "predicted / measured - 1 (seed spread "
          + (f"{100 * spread:.2f}%)" if math.isfinite(spread) else "not measured)"))
    print(f"  {'candidate':<38} {'fitted':>6} {'top mean':>9} {'top |err|':>9} {'all |err|':>9}")
    for r in bt.results:
        if r.problem:
            print(f"  {r.form:<38} not fitted: {r.problem}")
            continue
        print(f"  {r.form:<38} {fitted if r.fitted is None else r.fitted:>6} "
              f"{100 * r.top_mean:>+8.2f}% {100 * r.top_mae:>8.2f}% {100 * r.mae:>8.2f}%"
              + ("  <- best" if r is bt.best else "")
              + (f"  (degenerate: {r.degenerate})" if r.degenerate else ""))
    best = bt.best
    verdict = (f"SUPPORTED: {best.form} predicts the top rungs from {bt.ratio:g}x below "
               f"within {100 * best.top_mae:.2f}% (tolerance {100 * tolerance:g}%)"
               if bt.supported else
               f"NOT SUPPORTED: no candidate predicts the top rungs from {bt.ratio:g}x below "
               f"within {100 * tolerance:g}% (best: {best.form}, {100 * best.top_mae:.2f}%)"
               if best else "NOT SUPPORTED: no candidate fitted")
    print(f"  {verdict}: a held-out run at {bt.ratio:g}x the largest rung is "
          + ("within what this ladder has shown it can predict" if bt.supported else
             "an extrapolation this ladder cannot make on itself; its prediction is not a result"))


def report_backtest(points: list[RunPoint], ratio: float, predict: list[tuple[float, float]],
                    fit: dict, tolerance: float, bootstrap: int = 100) -> None:
    """``--backtest R``: each candidate of the fit policy fitted to the runs at or under 1/R
    of the largest compute and scored on the rest (pretrain/analysis/backtest.py), with the
    verdict at R; then the policy's choice over every ratio the ladder allows, and each
    ``--predict`` point by it. Recorded in ``fit["backtest"]``, ``fit["policy"]`` and, for
    tools/ladder_check.py, ``fit["chosen"]``."""
    from pretrain.analysis.backtest import backtest
    from pretrain.tools.fit_policy import report_policy

    spread = fit.get("seed_spread", {}).get("relative", float("nan"))
    bt = backtest(points, ratio, tolerance=tolerance, noise=spread)
    _print_backtest(bt, points, spread, tolerance)
    fit["backtest"] = bt.as_dict()
    report_policy(points, [], predict, fit, bootstrap, spread)
    for entry in fit["policy"]["predict"]:
        entry["supported"] = bt.supported
    fit["backtest"]["predict"] = fit["policy"]["predict"]


def report_isoflop(points: list[RunPoint], fit: dict) -> None:
    """Warn where a budget's best run is at the edge of its sizes; print (and record in
    ``fit``) each budget's parabola minimum."""
    for g in isoflop_groups(points):
        if len(g) >= 3 and not isoflop_bracketed(g):
            side = "below" if min(g, key=lambda p: p.loss) is g[0] else "above"
            print(f"\nwarning: at C = {g[0].flops:.3g} the best size is the "
                  f"{'smallest' if side == 'below' else 'largest'} run: the iso-FLOP valley lies "
                  f"{side} the sizes run ({g[0].n_params:.3g}..{g[-1].n_params:.3g}); "
                  "extend the sweep that way")
    groups = [g for g in isoflop_groups(points) if len(g) >= 3]
    if not groups:
        return
    print("\niso-FLOP minima (parabola in log N, approach 2):")
    fit["isoflop_minima"] = []
    for g in groups:
        minimum, why = isoflop_minimum(g), isoflop_problem(g)
        if minimum is None:
            print(f"  C = {g[0].flops:.3g}: none: {why}")
            fit["isoflop_minima"].append({"flops": g[0].flops, "none": why})
            continue
        n_opt, loss = minimum
        print(f"  C = {g[0].flops:.3g}: N_opt = {n_opt:.3g}, loss {loss:.4f}")
        fit["isoflop_minima"].append({"flops": g[0].flops, "n_opt": n_opt, "loss": loss})


def print_chinchilla(budgets: list[float]) -> list[dict]:
    """Compute-optimal N and D from the published fit (Hoffmann et al. 2022, approach 3)."""
    law = CHINCHILLA
    print(f"Chinchilla approach 3 (Hoffmann et al. 2022): L(N, D) = {law.E} + {law.A}/N^"
          f"{law.alpha} + {law.B}/D^{law.beta}; optimum under C = 6ND")
    rows = []
    for c in budgets:
        n, d = law.optimal(c)
        row = {"flops": c, "n_opt": float(n), "d_opt": float(d),
               "tokens_per_param": float(d / n), "loss": float(law.optimal_loss(c))}
        rows.append(row)
        print(f"  C = {c:.3g}: N = {n:.3g} params, D = {d:.3g} tokens "
              f"({d / n:.1f} tokens/param), predicted loss {row['loss']:.3f}")
    return rows
