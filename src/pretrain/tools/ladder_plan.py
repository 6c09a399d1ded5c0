"""``tools/ladder.py --plan``: compose every size, measure its speed, state the design and
check it (pretrain/analysis/ladder_design.py). Runs no training."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from pretrain.analysis.ladder_design import (
    CHINCHILLA_TPP,
    Design,
    Size,
    optimal_params,
    plan_runs,
    problems,
    render,
    trained_tokens,
)
from pretrain.config.paths import REPO
from pretrain.errors import UserError


def compose_size(recipe: str, width: int, overrides: list[str]) -> tuple[Size, dict, object]:
    """A size as train.py would run it: its dry-run plan's counts and LR."""
    from pretrain.config.compose import compose_config
    from pretrain.decision.resolve import dry_run

    cfg = compose_config([f"+recipe={recipe}", f"model.d_model={width}", *overrides])
    with contextlib.redirect_stdout(io.StringIO()):  # dry_run prints the plan as JSON
        plan = dry_run(cfg)
    size = Size(width=width, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
                n_params=int(plan["n_params"]),
                n_params_non_embedding=int(plan["n_params_non_embedding"]),
                flops_per_token=int(plan["flops_per_token"]), lr=float(plan["lr"]),
                batch_tokens=int(plan["global_batch_tokens"]))
    return size, plan, cfg


def measure(recipe: str, width: int, threads: int, overrides: list[str]) -> float:
    """Training tokens/s of one size at ``threads`` threads: tools/bench.py's trainer step
    (20 steps after 5 of warm-up), in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, str(REPO / "tools" / "bench.py"), f"+recipe={recipe}",
           f"model.d_model={width}", *overrides, "--steps", "20", "--warmup", "5",
           "--modes", "trainer", "--json"]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"measuring width {width} failed (exit {out.returncode}):\n"
                         + out.stderr[-2000:])
    return float(json.loads(lines[-1])["tokens_per_s"])


class Rates:
    """Measured tokens/s per (threads, width), kept in a JSON file when one is given."""

    def __init__(self, path: Path | None, recipe: str, overrides: list[str], enabled: bool):
        self.path, self.recipe, self.overrides, self.enabled = path, recipe, overrides, enabled
        self.table: dict = json.loads(path.read_text()) if path and path.exists() else {}

    def get(self, width: int, threads: int) -> float | None:
        key = str(threads)
        got = self.table.get(self.recipe, {}).get(key, {}).get(str(width))
        if got is None and self.enabled:
            print(f"measuring width {width} at {threads} thread(s) ...", flush=True)
            got = measure(self.recipe, width, threads, self.overrides)
            self.table.setdefault(self.recipe, {}).setdefault(key, {})[str(width)] = got
            if self.path:
                self.path.write_text(json.dumps(self.table, indent=1, sort_keys=True))
        return got


def target_tpp(args: argparse.Namespace) -> tuple[float, str]:
    """The held-out run's tokens/param: given, a fit's compute-optimal split, or 20."""
    if args.target_tpp:
        return args.target_tpp, "--target-tpp"
    if args.fit:
        fit = json.loads(args.fit.read_text())
        pred = fit.get("chinchilla_law", {}).get("predictions", {})
        if "n_opt" not in pred:
            raise UserError(f"--fit {args.fit}: no compute-optimal split in it (fit with "
                             "--target-flops, and enough runs for L(N, D))")
        n, d = pred["n_opt"]["value"], pred["d_opt"]["value"]
        return d / n, f"the compute-optimal split of {args.fit}"
    return CHINCHILLA_TPP, "Chinchilla's 20: no fit yet"


def heldout_size(recipe: str, largest: Size, n_target: float, overrides: list[str]
                 ) -> Size:
    """The width on the recipe's rule whose parameter count is nearest ``n_target`` (in
    log), searched upward from the largest rung in steps of 8."""
    best, width, misses = None, largest.width, 0
    while misses < 40:
        width += 8
        try:
            size = compose_size(recipe, width, overrides)[0]
        except Exception:  # a width the rule refuses (heads that do not divide it)
            misses += 1
            continue
        if best is None or abs(math.log(size.n_params / n_target)) < abs(
                math.log(best.n_params / n_target)):
            best = size
        if size.n_params > n_target:
            break
    if best is None:
        raise UserError(f"no width above {largest.width} composes with recipe {recipe}")
    return best


def plan_main(args: argparse.Namespace) -> int:
    sizes_w = sorted(int(s) for s in args.sizes.split(",") if s)
    seed_w = sorted(int(s) for s in args.seed_sizes.split(",") if s)
    missing = set(seed_w) - set(sizes_w)
    if missing:
        raise UserError(f"--seed-sizes {sorted(missing)} are not in --sizes")
    overrides = [o for o in args.overrides if not o.startswith("runs_dir=")]
    rates = Rates(args.rates, args.recipe, overrides, not args.no_measure)
    composed = [compose_size(args.recipe, w, overrides) for w in sizes_w]
    cfg = composed[-1][2]
    budgets = sorted(float(b) for b in cfg.checkpoint.branch_tokens_per_param)
    multiples = sorted(set(budgets + [float(cfg.budget.tokens_per_param)]))
    batch_tokens = cfg.train.global_batch_size * cfg.model.seq_len
    sizes = [Size(**{**vars(s), "tokens_per_s": rates.get(s.width, 1)})
             for s, _, _ in composed]
    runs = plan_runs(sizes, multiples, cfg.schedule.decay_fraction, batch_tokens, seed_w,
                     args.seed)
    tpp, tpp_from = target_tpp(args)
    c_max = max(r.compute for r in runs)
    c_target = args.ratio * c_max
    largest = max(sizes, key=lambda s: s.n_params)
    held = heldout_size(args.recipe, largest, optimal_params(c_target, tpp), overrides)
    held = Size(**{**vars(held), "tokens_per_s": rates.get(held.width, args.heldout_threads)})
    held_tokens = trained_tokens(held, c_target / (6.0 * held.n_params) / held.n_params,
                                 held.batch_tokens or batch_tokens)
    plan = composed[-1][1]
    sources = [{"name": s["name"], "weight": max(s.get("weights") or [0.0]),
                "data_tokens": s.get("data_tokens")} for s in plan.get("data_sources") or []]
    if not sources and plan.get("data_tokens"):
        sources = [{"name": cfg.data.name, "weight": 1.0, "data_tokens": plan["data_tokens"]}]
    design = Design(
        sizes=sizes, multiples=multiples, decay_fraction=cfg.schedule.decay_fraction,
        batch_tokens=batch_tokens, seed_widths=seed_w, ratio=args.ratio,
        target_tpp=held_tokens / held.n_params, target_tpp_from=tpp_from, heldout=held,
        heldout_compute=6.0 * held.n_params * held_tokens, heldout_tokens=held_tokens,
        heldout_seconds=held_tokens / held.tokens_per_s if held.tokens_per_s else None,
        heldout_threads=args.heldout_threads, jobs=max(args.jobs, 1), sources=sources,
        runs=runs, budget_seconds=args.core_hours * 3600 if args.core_hours else None,
        budget_flops=args.flops, min_steps=int(args.min_steps or 0))
    par = cfg.model.parametrization
    par_text = (f"muP from base width {cfg.model.base_width}: one LR for every width"
                if par == "mup" else f"{par}: the recipe's LR rule per size")
    print(render(design, args.recipe, par_text))
    if not plan.get("data_sources") and not plan.get("data_tokens"):
        print("  (data not prepared at data.root: epochs unknown; prepare it first)")
    found = problems(design)
    if found:
        print("\nrefused: this design cannot do what a ladder is for:", file=sys.stderr)
        for p in found:
            print(f"  - {p}", file=sys.stderr)
        return 2
    print("\nchecks: identifiable (sizes, span, heads, embedding share, multiples bracket the "
          "held-out run), within the budget, < 1 epoch of every source")
    return 0
