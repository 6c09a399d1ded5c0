"""Check the committed ladder (docs/ladder/): re-predict any (N, D) from its fit, compare a
rung rerun anywhere with its committed figure, and export a ladder's runs as runs.csv.

    python tools/ladder_check.py predict 1278560,41453568          # from docs/ladder/fit.json
    python tools/ladder_check.py rung runs/sweeps/ladder-pinned/model.d_model=24
    python tools/ladder_check.py export RUNS_DIR [RUNS_DIR ...] --out docs/ladder/runs.csv

``predict`` evaluates the form the backtest chose (fit.json's ``chosen``), fitted to every
committed run, at each point, with no refit. ``rung`` finds the committed run of the same
width, seed and tokens in runs.csv and says whether the rerun lands within the seed spread
(fit.json's ``seed_spread``): exit 0 when it does, 1 when not.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.errors import UserError, cli

LADDER = REPO / "docs" / "ladder"
COLUMNS = ("set", "width", "seed", "tokens_per_param", "n_params", "tokens", "steps", "batch",
           "lr", "beta2", "flops", "final_val_loss", "final_val_bpb", "run")


def run_row(run: Path, label: str = "ladder") -> dict:
    """One finished run as a runs.csv row (its plan.json, result.json and Hydra config)."""
    for f in ("plan.json", "result.json"):
        if not (run / f).exists():
            raise UserError(f"{run}: no {f}; a finished run holds plan.json and result.json")
    plan = json.loads((run / "plan.json").read_text())
    result = json.loads((run / "result.json").read_text())
    seed, betas = _seed_and_betas(run / ".hydra" / "config.yaml")
    n, d = int(plan["n_params"]), int(result.get("tokens", plan["tokens"]))
    return {"set": label, "width": plan.get("width"), "seed": seed,
            "tokens_per_param": round(d / n, 2), "n_params": n, "tokens": d,
            "steps": result.get("steps"), "batch": plan.get("global_batch_tokens"),
            "lr": plan.get("lr"), "beta2": round(float(betas[1]), 6) if betas else None,
            "flops": 6.0 * n * d,
            "final_val_loss": result["final_val_loss"],
            "final_val_bpb": result.get("final_val_bpb"), "run": run.name}


def _seed_and_betas(path: Path) -> tuple[int | None, list | None]:
    """train.seed and optim.betas of a run's saved config, its interpolations resolved."""
    if not path.exists():
        return None, None
    from omegaconf import OmegaConf

    from pretrain.config.naming import register_resolvers

    register_resolvers()
    cfg = OmegaConf.load(path)
    return OmegaConf.select(cfg, "train.seed"), list(OmegaConf.select(cfg, "optim.betas") or [])


def read_runs(path: Path) -> list[dict]:
    if not path.exists():
        raise UserError(f"{path}: no such file; the committed runs are docs/ladder/runs.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def load_fit(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path}: no such file; the committed fit is docs/ladder/fit.json")
    return json.loads(path.read_text())


def cmd_predict(args: argparse.Namespace) -> int:
    from pretrain.analysis.extrapolation import parse_point
    from pretrain.analysis.laws import law_from_dict

    fit = load_fit(args.fit)
    chosen = fit.get("chosen")
    if not chosen:
        raise UserError(f"{args.fit} records no chosen law (no candidate held): nothing to "
                        "predict with")
    law = law_from_dict(chosen)
    print(f"{args.fit}: {chosen['form']} (N {chosen.get('count', 'total')}) fitted to "
          f"{chosen['runs']} runs, the fit policy's choice (docs/ladder/published.md)")
    for text in args.points:
        try:
            n, d = parse_point(text)
        except ValueError as e:
            raise UserError(f"{text!r}: {e}") from None
        print(f"  N = {n:.6g}, D = {d:.6g} (C = {6 * n * d:.4g}): loss "
              f"{float(law.predict(n, d)):.4f}")
    return 0


def cmd_rung(args: argparse.Namespace) -> int:
    row = run_row(args.run)
    fit = load_fit(args.fit)
    spread = fit.get("seed_spread", {}).get("relative")
    if not spread:
        raise UserError(f"{args.fit} records no seed spread: nothing to compare a rerun with")
    match = [r for r in read_runs(args.runs) if int(r["width"]) == int(row["width"])
             and str(r["seed"]) == str(row["seed"]) and int(r["tokens"]) == int(row["tokens"])]
    if not match:
        raise UserError(f"{args.run}: no committed run of width {row['width']}, seed "
                        f"{row['seed']} and {row['tokens']:,} tokens in {args.runs}")
    committed = float(match[0]["final_val_loss"])
    rel = math.log(row["final_val_loss"] / committed)
    ok = abs(rel) <= spread
    print(f"{args.run}: final_val_loss {row['final_val_loss']:.4f}, committed {committed:.4f} "
          f"({match[0]['run']}): {100 * rel:+.2f}%, seed spread {100 * spread:.2f}%: "
          + ("within it" if ok else "OUTSIDE it"))
    return 0 if ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    rows = []
    for root in args.dirs:
        for result in sorted(Path(root).rglob("result.json")):
            if (result.parent / "plan.json").exists():
                rows.append(run_row(result.parent, args.label))
    if not rows:
        raise UserError(f"no finished runs under {', '.join(map(str, args.dirs))}")
    rows.sort(key=lambda r: (r["width"], str(r["seed"]), r["tokens"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} runs -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="L(N, D) from the committed fit")
    p.add_argument("points", nargs="+", metavar="N,D")
    p.add_argument("--fit", type=Path, default=LADDER / "fit.json")
    p.set_defaults(func=cmd_predict)
    r = sub.add_parser("rung", help="a rerun rung against its committed figure")
    r.add_argument("run", type=Path)
    r.add_argument("--runs", type=Path, default=LADDER / "runs.csv")
    r.add_argument("--fit", type=Path, default=LADDER / "fit.json")
    r.set_defaults(func=cmd_rung)
    e = sub.add_parser("export", help="finished runs as runs.csv rows")
    e.add_argument("dirs", nargs="+", type=Path)
    e.add_argument("--out", type=Path, default=LADDER / "runs.csv")
    e.add_argument("--label", default="ladder")
    e.set_defaults(func=cmd_export)
    return ap


@cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
