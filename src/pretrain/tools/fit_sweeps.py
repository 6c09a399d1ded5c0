"""``tools/scaling_law.py --hparams`` and ``--transfer``: reports on sweeps of hyperparameters
rather than of sizes (pretrain/analysis/hparam_fit.py, transfer.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def hparam_report(dirs: list[Path], out: Path | None) -> int:
    """``--hparams``: fit lr(C) and batch(C) to a sweep, print them beside DeepSeek's."""
    from pretrain.analysis.hparam_fit import (
        collect_sweep,
        fit_hparam_laws,
        group_by_compute,
        override_line,
    )
    from pretrain.budget.hparams import DEEPSEEK

    points = [p for d in dirs for p in collect_sweep(d)]
    if not points:
        print(f"no finished runs with hparam_compute in plan.json under "
              f"{', '.join(map(str, dirs))}", file=sys.stderr)
        return 1
    groups = group_by_compute(points)
    print(f"{len(points)} finished runs at {len(groups)} compute budgets "
          "(C = M x D, DeepSeek non-embedding FLOPs)")
    for g in groups:
        print(f"  C = {g[0].compute:.4g}: {len(g)} runs")
        for p in sorted(g, key=lambda p: (p.batch_tokens, p.lr)):
            print(f"    batch {p.batch_tokens:>9,.0f} tokens  lr {p.lr:<9.3g} loss {p.loss:.4f}")
    try:
        laws, optima = fit_hparam_laws(points)
    except ValueError as e:
        print(f"\nnot fitted: {e}")
        return 1
    print("\nbest of each budget (quadratic in log lr, log batch where convex and inside the "
          "grid, else the best run):")
    for o in optima:
        print(f"  C = {o.compute:.4g}: lr {o.lr:.4g}, batch {o.batch_tokens:,.0f} tokens, "
              f"loss {o.loss:.4f} ({o.how}, {o.runs} runs; DeepSeek: lr "
              f"{DEEPSEEK.lr(o.compute):.4g}, batch {DEEPSEEK.batch_tokens(o.compute):,.0f})")
        for axis in o.edges:
            print(f"    warning: the best {axis} is at the edge of the grid: the optimum may "
                  f"lie beyond it; extend the sweep's {axis} values that way")
    print(f"\n{'':>8} {'fitted':>22}   {'DeepSeek (Bi et al. 2024)':>26}")
    print(f"{'lr':>8} {str(laws.lr):>22}   {str(DEEPSEEK.lr):>26}")
    print(f"{'batch':>8} {str(laws.batch_tokens):>22}   {str(DEEPSEEK.batch_tokens):>26}  "
          "(tokens)")
    if len(optima) < 3:
        print(f"warning: {len(optima)} budgets: the line goes through them exactly; "
              "3 or more give a fit that can be checked")
    line = override_line(laws)
    print(f"\noverrides for a recipe:\n  {line}")
    out = out or dirs[0] / "scaling_law"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hparams.json").write_text(json.dumps({
        "lr": vars(laws.lr), "batch_tokens": vars(laws.batch_tokens),
        "published": {"lr": vars(DEEPSEEK.lr), "batch_tokens": vars(DEEPSEEK.batch_tokens),
                      "source": DEEPSEEK.source},
        "optima": [vars(o) for o in optima], "runs": [vars(p) for p in points],
        "override": line}, indent=2))
    print(f"fit: {out / 'hparams.json'}")
    return 0


def sweep_report(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """``--transfer`` (the best LR per width of a width x LR sweep, pretrain/analysis/
    transfer.py) or ``--hparams``: a report on folders of runs; None when neither."""
    if not (args.transfer or args.hparams):
        return None
    if not args.dirs:
        ap.error(f"--{'transfer' if args.transfer else 'hparams'} needs folders of runs")
    if args.transfer:
        from pretrain.analysis.transfer import transfer_report

        return transfer_report(args.dirs, args.out, not args.no_plots)
    return hparam_report(args.dirs, args.out)


