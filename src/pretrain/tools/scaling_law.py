"""Fit scaling laws to a sweep's finished runs, predict a larger run, draw the plots.

    python tools/scaling_law.py runs/sweeps/ladder-tiny                 # fit + plots
    python tools/scaling_law.py runs/sweeps/isoflop-tiny runs/sweeps/ladder-tiny \\
        --target-flops 1e15 --out runs/scaling
    python tools/scaling_law.py --chinchilla 5.76e23 1e24               # no runs needed
    python tools/scaling_law.py --hparams runs/sweeps/hparam-tiny       # lr(C), batch(C)
    python tools/scaling_law.py --transfer runs/sweeps/transfer-tiny    # best lr per width
    python tools/scaling_law.py --points tests/data/chinchilla_besiroglu2024.csv \
        --exclude-highest-loss 5 --out runs/chinchilla                  # published runs

``--hparams``: the best learning rate and batch of each compute budget of an LR x batch sweep
(recipes/hparam-tiny.yaml), smoothed by a quadratic in (log lr, log batch) per budget, then
lr = a C^b and batch = c C^d by least squares in log-log, with C = M x D in DeepSeek's
convention (the plan's ``hparam_compute``); printed next to DeepSeek's published constants,
with the override line that makes a recipe use the fitted laws. Writes ``hparams.json``.

Otherwise it reads every run directory under the given folders that holds ``result.json``
(written only when a run finished its budget) and ``plan.json``; N is the plan's ``n_params``,
D the tokens trained, C = 6 N D (``pretrain.budget.compute.run_compute``: the plan's
``compute``, the C of ``budget=flops``; not its ``total_flops``, the hardware work). Fits
L(C) = a C^b + c (needs 3+ runs) and L(N, D) = E + A/N^alpha + B/D^beta (needs 6+ runs at
different tokens per parameter: an iso-FLOP sweep, not a pure 20-tokens-per-param ladder),
each with a Huber objective on log loss (Hoffmann et al. 2022, analysis/fitting.py) and a
bootstrap over runs for the error bars; a degenerate fit is refused, not printed as a
prediction. A cooldown branch (``checkpoint.branch_from``) is one point of its own D, so a
WSD ladder plus its branches (recipes/ladder-tiny-wsd.yaml, ladder-tiny-cooldown.yaml) fits
L(N, D); a run that never decayed (constant LR, kept only to branch from) is left out.
``--metric val_bpb`` fits bits per byte (result.json's ``final_val_bpb``;
docs/bits-per-byte.md) instead of the loss in nats per token. ``--points FILE.csv`` adds runs
from elsewhere (columns n_params, tokens, loss; name, a group, non-embedding counts
optional), such as Chinchilla's own, as Besiroglu et al. 2024 extracted them, or the
published ladders of docs/ladder/published.md; ``--select``, ``--max-flops``, ``--ladder``
and ``--heldout`` say which rows are the ladder and which are predicted, ``--policy`` chooses
the law by the ladder's own backtest (tools/fit_policy.py), ``--predict-optimal C`` the loss, N
and D at budget C's compute optimum (tools/fit_optimal.py). Warns when the target's tokens
(L(C)'s at the ladder's tokens per parameter, L(N, D)'s D_opt) exceed the corpus the runs
read (their plans' ``data_tokens``): more than one epoch, which the fit of fresh-data runs
cannot predict. Writes ``fit.json``, ``loss_vs_compute.png`` and
``isoflop.png`` into ``--out`` (default: ``<first folder>/scaling_law``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pretrain.analysis.fit_checks import with_seed_spread
from pretrain.analysis.policy import TOLERANCE
from pretrain.analysis.runs import (
    COUNTS,
    RunPoint,
    read_points,
    without_highest_losses,
    without_short_runs,
)
from pretrain.analysis.scaling import (
    FitReport,
    compute_frontier,
    report_chinchilla_law,
    report_compute_law,
)
from pretrain.errors import UserError, cli
from pretrain.errors import report as report_error  # `report` is a local name here
from pretrain.tools.fit_metrics import METRICS, metric_arg, metric_key, metric_problem
from pretrain.tools.fit_reports import (
    report_backtest,
    report_diagnosis,
    report_e_profile,
    report_seed_spread,
)


def print_runs(points: list[RunPoint], metric: str = "loss") -> None:
    print(f"{'run':<48} {'N':>10} {'D':>10} {'C':>10} {metric:>7}")
    for p in sorted(points, key=lambda p: p.flops):
        name = p.name if len(p.name) <= 48 else "..." + p.name[-45:]
        print(f"{name:<48} {p.n_params:>10.4g} {p.tokens:>10.4g} {p.flops:>10.4g} "
              f"{p.loss:>7.4f}")


def print_report(title: str, rep: FitReport) -> None:
    print(f"{title}  (± bootstrap std over {len(rep.samples)} resamples of the runs, "
          "[95% interval])")
    for k, est in rep.constants.items():
        print(f"  {k:>6} = {est}")
    for k, est in rep.predictions.items():
        print(f"  {k:>6} : {est}")
    for w in rep.warnings:
        print(f"  warning: {w}")


def fit_laws(points: list[RunPoint], target: float, bootstrap: int, seed: int, fit: dict
             ) -> tuple[FitReport | None, FitReport | None]:
    """Fit and print L(C) and L(N, D), each into ``fit`` when it could be fitted."""
    compute = chinchilla = None
    try:
        compute = report_compute_law(points, target, bootstrap, seed)
        print_report(f"\nL(C) = a C^b + c, fitted to the best run of each of "
                     f"{len(compute_frontier(points))} budgets", compute)
        fit["compute_law"] = compute.as_dict()
    except ValueError as e:
        print(f"\nL(C): not fitted: {e}")
    try:
        chinchilla = report_chinchilla_law(points, target, max(bootstrap // 2, 0), seed)
        print_report("\nL(N, D) = E + A/N^alpha + B/D^beta", chinchilla)
        fit["chinchilla_law"] = chinchilla.as_dict()
    except ValueError as e:  # NotIdentifiable, or a fit that did not converge
        print(f"\nL(N, D): not fitted: {e}")
    return compute, chinchilla


def report_target_data(points: list[RunPoint], target: float, chinchilla: FitReport | None,
                       fit: dict) -> None:
    """Warn where the target's tokens exceed the corpus the runs were fitted on (epochs >
    1; pretrain/analysis/target_data.py); record the epochs in ``fit``."""
    from pretrain.analysis.target_data import target_epochs

    d_opt = (chinchilla.predictions["d_opt"].value if chinchilla and chinchilla.predictions
             else None)
    record, warnings = target_epochs(points, target, d_opt)
    if record:
        fit["target_data"] = record
        print("\ntarget data: " + ", ".join(
            f"{law} {d:,.0f} tokens = {record['target_epochs'][law]:.3g} epochs"
            for law, d in record["target_tokens"].items())
              + f" of the {record['corpus_tokens']:,.0f}-token corpus")
    for w in warnings:
        print(f"warning: {w}")


def report_extrapolation(points: list[RunPoint], target: float,
                         reports: dict[str, FitReport | None], fit: dict,
                         args: argparse.Namespace) -> None:
    """The target's prediction by each fitted law, and L(N, D)'s at each ``--predict N,D``,
    each with its verdict, supported or extrapolated, from one function
    (pretrain/analysis/extrapolation.verdict): L(N, D)'s target is the point (N_opt, D_opt),
    judged as a ``--predict`` of that point would be. Recorded in ``fit``."""
    from pretrain.analysis.extrapolation import Bounds, predict_at, verdict

    bounds = Bounds(max_interval=args.max_interval, max_ratio=args.max_ratio,
                    max_size_ratio=args.max_size_ratio)
    tokens = fit.get("target_data", {}).get("target_tokens", {})
    fit["extrapolation"] = {}
    from pretrain.tools.fit_policy import instead, refusals

    refused = refusals(points, reports, fit)
    print(f"\nprediction at the target C = {target:.4g}:")
    for law, rep in reports.items():
        if rep is None or "loss" not in rep.predictions:
            continue
        if law in refused:
            print(f"  {law}: REFUSED, not a prediction: the fit is degenerate: {refused[law]}; "
                  + instead(law, refused, fit))
        if law == "L(C)":
            est, n, opt = rep.predictions["loss"], None, ""
            why = verdict(points, law, est, target, tokens.get(law), None, bounds)
        else:
            n, d = rep.predictions["n_opt"].value, rep.predictions["d_opt"].value
            est, opt = predict_at(rep, n, d), f", N_opt {n:.4g}, D_opt {d:.4g}"
            why = verdict(points, law, est, target, d, n, bounds)
        if law in refused:
            fit["extrapolation"][law] = [f"refused: {refused[law]}"] + why
            continue
        fit["extrapolation"][law] = why
        print(f"  {law}: loss {est}{opt}")
        print_verdict(why, bounds, "    ")
    chinchilla = reports.get("L(N, D)")
    if args.predict and chinchilla is not None and "L(N, D)" not in refused:
        report_points(points, chinchilla, args.predict, bounds, fit)


def print_verdict(why: list[str], bounds, indent: str) -> None:
    print(indent + ("EXTRAPOLATED past what the fit supports, not a result:" if why else
                    f"supported ({bounds.describe()})"))
    for w in why:
        print(f"{indent}  - {w}")


def report_points(points: list[RunPoint], chinchilla: FitReport,
                  at: list[tuple[float, float]], bounds, fit: dict) -> None:
    """L(N, D) at each ``--predict`` point, with its interval (and the seed spread's) and
    its verdict; recorded in ``fit["predict"]``."""
    from pretrain.analysis.extrapolation import predict_at, verdict

    spread = fit.get("seed_spread", {}).get("relative", float("nan"))
    fit["predict"] = []
    print("\nL(N, D) at the given points (± bootstrap std [95% interval]):")
    for n, d in at:
        est = predict_at(chinchilla, n, d)
        why = verdict(points, "L(N, D)", est, 6 * n * d, d, n, bounds)
        entry = {"n_params": n, "tokens": d, "flops": 6 * n * d, "loss": vars(est),
                 "extrapolation": why}
        fit["predict"].append(entry)
        print(f"  N = {n:.4g}, D = {d:.4g} (C = {6 * n * d:.4g}): loss {est}"
              + (" -- EXTRAPOLATED:" if why else " -- supported"))
        if spread == spread:  # measured: the interval a run at another seed falls in
            wide = vars(with_seed_spread(est, spread))
            entry["loss_with_seeds"] = wide
            print(f"      with the seed spread ({100 * spread:.2g}%): ± {wide['std']:.2g} "
                  f"[{wide['low']:.4g}, {wide['high']:.4g}]")
        for w in why:
            print(f"      - {w}")


def cooldown_points(dirs: list[Path], key: str = METRICS["val_loss"], count: str = "total",
                    quiet: bool = False) -> list[RunPoint]:
    """The finished runs under ``dirs`` that cooled down, cooldown branches included, each
    an (N, D) point (analysis/branches.py; N in ``count``); a run that never decayed is
    named and left out. ``key``: the result.json metric that is the point's loss."""
    from pretrain.analysis.branches import collect_cooldowns, describe

    collected = collect_cooldowns(dirs, key, count)
    if (collected.branches or collected.stable) and not quiet:
        print("\n".join(describe(collected)))
    return collected.points


def collect_points(args: argparse.Namespace, count: str, quiet: bool = False
                   ) -> list[RunPoint]:
    """The cooled-down runs of ``args.dirs`` with N in ``count``, less those shorter than
    ``--min-steps`` (each named unless ``quiet``)."""
    points = cooldown_points(args.dirs, metric_key(args.metric), count, quiet)
    points, short = without_short_runs(points, args.min_steps)
    for p in short if not quiet else ():
        print(f"left out (--min-steps {args.min_steps}): {p.name}, {p.steps} steps")
    return points


def run_point(run: Path, count: str) -> tuple[float, float]:
    """(N, D) of a run from its plan.json (it may still be training): N in ``count``."""
    from pretrain.analysis.runs import plan_params

    path = run / "plan.json"
    if not path.exists():
        raise UserError(f"--predict-run {run}: no plan.json there (a run writes it at start)")
    plan = json.loads(path.read_text())
    return plan_params(plan, count), float(plan["tokens"])


def _point(text: str) -> tuple[float, float]:
    from pretrain.analysis.extrapolation import parse_point

    try:
        return parse_point(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# What N counts in the fits unless --count says otherwise (docs/benchmarks.md, "A ladder
# that predicts": the count that predicted the byte ladder's largest size best).
DEFAULT_COUNT = "total"


def add_bounds(ap: argparse.ArgumentParser) -> None:
    """The bounds past which a prediction is called extrapolated (analysis/extrapolation.py)."""
    ap.add_argument("--max-interval", type=float, default=0.05, metavar="FRACTION",
                    help="call a prediction extrapolated when its 95%% bootstrap interval is "
                         "wider than this fraction of the loss (default 0.05)")
    ap.add_argument("--max-ratio", type=float, default=100.0, metavar="X",
                    help="call a prediction extrapolated when the target is more than X "
                         "times the largest run's compute (default 100)")
    ap.add_argument("--max-size-ratio", type=float, default=3.0, metavar="X",
                    help="call a prediction extrapolated when its N (the target's N_opt, or "
                         "a --predict point's) is more than X times the largest size run "
                         "(default 3)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path, help="folders holding finished runs")
    ap.add_argument("--chinchilla", nargs="+", type=float, metavar="C",
                    help="print compute-optimal N and D from the published Chinchilla fit")
    ap.add_argument("--target-flops", type=float,
                    help="budget C = 6ND to predict, as a plan's 'compute' (default: 10x the "
                         "largest run)")
    ap.add_argument("--out", type=Path, help="where fit.json and the PNGs go")
    ap.add_argument("--bootstrap", type=int, default=200, help="resamples (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hparams", action="store_true",
                    help="fit lr(C) and batch(C) to an LR x batch sweep instead")
    ap.add_argument("--transfer", action="store_true", help="best LR per width instead")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--points", type=Path, action="append", default=[], metavar="CSV",
                    help="runs from a CSV file (n_params, tokens, loss), repeatable")
    ap.add_argument("--exclude-highest-loss", type=int, default=0, metavar="K",
                    help="leave out the K runs with the highest loss before fitting")
    ap.add_argument("--metric", type=metric_arg, default="val_loss",
                    help="what is fitted: the final validation loss (nats per token, the "
                         "default), bits per byte (result.json's final_val_bpb), or a task's "
                         "bits per byte of the correct answer (task/<name>/bpb)")
    ap.add_argument("--predict", type=_point, action="append", default=[], metavar="N,D",
                    help="also print L(N, D) at this point with its interval, repeatable")
    ap.add_argument("--predict-run", type=Path, action="append", default=[], metavar="DIR",
                    help="also predict the run in DIR (its plan.json's N in --count and "
                         "tokens), e.g. a held-out run still training; repeatable")
    ap.add_argument("--count", choices=COUNTS, default=DEFAULT_COUNT,
                    help="what N counts: every parameter (total), the non-embedding ones, or "
                         f"the per-token training FLOPs / 6 (flops); default {DEFAULT_COUNT}")
    ap.add_argument("--min-steps", type=int, default=0, metavar="S",
                    help="leave out runs of fewer than S optimizer steps (still in their "
                         "warm-up transient; the byte ladder uses 10x its warmup, 200)")
    ap.add_argument("--min-params", type=float, default=0.0, metavar="N",
                    help="leave out runs of fewer than N parameters (in --count): sizes the "
                         "backtest or --diagnose shows are off the law")
    ap.add_argument("--diagnose", action="store_true",
                    help="residuals by size and tokens/param, each size left out of the fit "
                         "and predicted, and every count compared on the largest size")
    ap.add_argument("--backtest", type=float, metavar="R",
                    help="fit each candidate form to the runs at or under 1/R of the largest "
                         "compute, predict the rest, and say whether a held-out run at R x "
                         "the largest rung is supported (the top rungs within "
                         "--backtest-tolerance); --predict points use the best form")
    ap.add_argument("--backtest-tolerance", type=float, default=TOLERANCE, metavar="FRACTION",
                    help="the top rungs' mean |error| a supported backtest allows "
                         f"({TOLERANCE:g})")
    add_bounds(ap)
    from pretrain.tools.fit_optimal import add_arguments as add_optimal
    from pretrain.tools.fit_policy import add_arguments

    add_arguments(ap)
    add_optimal(ap)
    return ap


def fitted_points(args: argparse.Namespace) -> list[RunPoint]:
    """The runs of the folders and CSV files, less those left out by --min-steps,
    --exclude-highest-loss and --min-params (each named); ``args.predict`` gains the
    --predict-run points."""
    points = collect_points(args, args.count)
    args.predict = list(args.predict) + [run_point(r, args.count) for r in args.predict_run]
    points = without_highest_losses(points + [p for f in args.points for p in read_points(f)],
                                    args.exclude_highest_loss)
    for p in points:
        if p.n_params < args.min_params:
            print(f"left out (--min-params {args.min_params:g}): {p.name}, N = {p.n_params:.4g}")
    return [p for p in points if p.n_params >= args.min_params]


def selected_points(args: argparse.Namespace) -> tuple[list[RunPoint], list[RunPoint]]:
    """(ladder, held out): ``fitted_points`` split by --select, --heldout, --max-flops and
    --ladder (tools/fit_policy.py)."""
    from pretrain.tools.fit_policy import select

    points = fitted_points(args)
    if not points:
        return [], []
    return select(points, args)


def fit_and_report(points: list[RunPoint], heldout: list[RunPoint], target: float,
                   fit: dict, args: argparse.Namespace) -> tuple:
    """Every fit and report of the runs into ``fit``, in the order printed: the seed
    spread, --backtest, the fit policy (--policy, held-out runs, or L(N, D) degenerate),
    L(C) and L(N, D), the target, the iso-FLOP minima, --predict-optimal, --diagnose."""
    from pretrain.tools.fit_policy import refusals, report_policy
    from pretrain.tools.fit_reports import report_isoflop

    report_seed_spread(points, fit)
    spread = fit.get("seed_spread", {}).get("relative", float("nan"))
    resamples = max(args.bootstrap // 2, 0)
    if args.backtest:
        try:
            report_backtest(points, args.backtest, args.predict, fit, args.backtest_tolerance,
                            resamples)
        except ValueError as e:
            raise UserError(str(e)) from None
    if heldout or (args.policy and "policy" not in fit):  # --backtest ran it on no held-out
        report_policy(points, heldout, args.predict, fit, resamples, spread)
    compute, chinchilla = fit_laws(points, target, args.bootstrap, args.seed, fit)
    if "policy" not in fit and chinchilla is not None and refusals(
            points, {"L(N, D)": chinchilla}, fit):
        print("\nL(N, D) is degenerate on these runs: the fit policy chooses another")
        report_policy(points, [], args.predict, fit, resamples, spread)
    report_target_data(points, target, chinchilla, fit)
    report_extrapolation(points, target, {"L(C)": compute, "L(N, D)": chinchilla}, fit, args)
    report_isoflop(points, fit)
    if args.predict_optimal:
        from pretrain.tools.fit_optimal import report_optimal

        report_optimal(points, heldout, args.predict_optimal, fit, resamples, spread)
    if args.diagnose:
        report_diagnosis(points, chinchilla, args.count, fit,
                         lambda count: collect_points(args, count, quiet=True))
        report_e_profile(points, args.predict, fit)
    return compute, chinchilla


@cli
def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    from pretrain.tools.fit_sweeps import sweep_report

    report = sweep_report(ap, args)
    if report is not None:
        return report
    if args.chinchilla:
        from pretrain.tools.fit_reports import print_chinchilla

        print_chinchilla(args.chinchilla)
        if not args.dirs:
            return 0
    if args.loo is not None:
        from pretrain.tools.leave_one_out import main_loo

        return main_loo(args.loo, max(args.bootstrap // 2, 0))
    if not args.dirs and not args.points:
        ap.error("give one or more folders of runs, --points CSV, or --chinchilla C")

    problem = metric_problem(args.dirs, args.metric, bool(args.points))
    if problem:
        return report_error(problem)
    points, heldout = selected_points(args)
    if not points:
        print(f"no finished runs (result.json + plan.json) under {', '.join(map(str, args.dirs))}",
              file=sys.stderr)
        return 1
    target = args.target_flops or 10 * max(p.flops for p in points)
    out = args.out or (args.dirs[0] if args.dirs else Path("runs")) / "scaling_law"
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(points)} finished runs (C = 6ND with N = {args.count}"
          + (", the plan's 'compute'" if args.count == "total" else "")
          + f"), fitting {metric_key(args.metric)}")
    print_runs(points, args.metric)

    fit: dict = {"metric": metric_key(args.metric), "count": args.count,
                 "runs": [vars(p) for p in points], "target_flops": target}
    compute, chinchilla = fit_and_report(points, heldout, target, fit, args)
    # the numbers first: a plot that cannot be drawn must not lose them
    (out / "fit.json").write_text(json.dumps(fit, indent=2))
    print(f"\nfit: {out / 'fit.json'}")
    if not args.no_plots:
        from pretrain.analysis.scaling_plot import plot_isoflop, plot_loss_vs_compute

        paths = [plot_loss_vs_compute(points, compute, chinchilla, target,
                                      out / "loss_vs_compute.png"),
                 plot_isoflop(points, chinchilla, out / "isoflop.png")]
        print("plots: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
