"""Run a WSD ladder with its cooldown branches, then fit and predict: one command.

    python tools/ladder.py --sizes 12,16,20,24 --target-flops 1.95e13 \\
        --predict 400112,8121344 -- data.root=/work/data-shared runs_dir=runs/ladder

For a ladder recipe R (default ``ladder-mix``) with a cooldown recipe ``R-cooldown``
(recipes/ladder-mix.yaml, ladder-mix-cooldown.yaml), it runs:

1. one long WSD run per size: ``python train.py -m +recipe=R model.d_model=<sizes>``, each
   storing the branch points of the recipe's ``checkpoint.branch_tokens_per_param``;
2. the cooldown branches of each size: ``python train.py -m +recipe=R-cooldown
   model.d_model=<sizes> budget.tokens_per_param=<those budgets>``;
3. ``tools/scaling_law.py <runs_dir>/sweeps/R <runs_dir>/sweeps/R-cooldown`` with the
   target and points given: L(N, D), the compute-optimal N and D at the target with bootstrap
   intervals, and whether the prediction is supported or extrapolated.

``--jobs J`` runs the sizes in J streams at once (each one thread, ``OMP_NUM_THREADS=1``
unless set), the sizes dealt out largest first to the stream with the least work; each
stream runs its sources, then their branches. Overrides after ``--`` go to every run (a
data root, ``runs_dir``); they must not change what the runs train, or the branches will not
find their sources (the run directories are named by the sizes alone). The flags of the
fit (``--target-flops``, ``--predict``, ``--bootstrap``, ``--max-interval``, ``--max-ratio``,
``--out``, ``--no-plots``) go to tools/scaling_law.py. ``--dry-run`` prints the commands and
runs nothing; ``--fit-only`` fits the runs already there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pretrain.config.paths import REPO


def branch_budgets(recipe: str) -> list[float]:
    """The tokens per parameter of the recipe's branch points (its cooldown budgets), as
    the recipe composes (its defaults included)."""
    from pretrain.config.compose import compose_config

    if not (REPO / "recipes" / f"{recipe}.yaml").exists():
        raise SystemExit(f"--recipe {recipe}: no recipes/{recipe}.yaml")
    budgets = compose_config([f"+recipe={recipe}"]).checkpoint.branch_tokens_per_param
    if not budgets:
        raise SystemExit(f"recipes/{recipe}.yaml sets no checkpoint.branch_tokens_per_param: "
                         "a ladder recipe stores branch points for its cooldown branches")
    if not (REPO / "recipes" / f"{recipe}-cooldown.yaml").exists():
        raise SystemExit(f"--recipe {recipe}: no recipes/{recipe}-cooldown.yaml for the branches")
    return [float(b) for b in budgets]


def streams(sizes: list[int], jobs: int) -> list[list[int]]:
    """Sizes dealt into ``jobs`` streams, largest first to the least loaded (work ~ d^2)."""
    out: list[list[int]] = [[] for _ in range(min(jobs, len(sizes)))]
    for d in sorted(sizes, reverse=True):
        min(out, key=lambda s: sum(x * x for x in s)).append(d)
    return out


def _fmt(x: float) -> str:
    return f"{x:g}"


def stream_commands(recipe: str, sizes: list[int], budgets: list[float],
                    overrides: list[str]) -> list[list[str]]:
    """The two train.py commands of one stream: its sources, then their branches."""
    d = "model.d_model=" + ",".join(map(str, sizes))
    train = [sys.executable, str(REPO / "train.py"), "-m"]
    return [train + [f"+recipe={recipe}", d, *overrides],
            train + [f"+recipe={recipe}-cooldown", d,
                     "budget.tokens_per_param=" + ",".join(map(_fmt, budgets)), *overrides]]


def run_streams(plan: list[list[list[str]]], env: dict) -> int:
    """Run the streams at once, each its commands in order; the first failure's code."""
    procs = [(cmds, subprocess.Popen(cmds[0], env=env, cwd=REPO)) for cmds in plan]
    rc = 0
    for cmds, proc in procs:
        code = proc.wait()
        for cmd in cmds[1:]:
            if code:
                break
            code = subprocess.run(cmd, env=env, cwd=REPO).returncode
        rc = rc or code
    return rc


def runs_dir(overrides: list[str]) -> Path:
    for o in overrides:
        if o.startswith("runs_dir="):
            return Path(o.split("=", 1)[1])
    return REPO / "runs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", required=True, help="widths (model.d_model), e.g. 12,16,20,24")
    ap.add_argument("--recipe", default="ladder-mix")
    ap.add_argument("--jobs", type=int, default=1, help="streams run at once (default 1)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--fit-only", action="store_true", help="fit the finished runs only")
    for flag in ("--target-flops", "--bootstrap", "--max-interval", "--max-ratio", "--out"):
        ap.add_argument(flag, help=f"tools/scaling_law.py {flag}")
    ap.add_argument("--predict", action="append", default=[], metavar="N,D",
                    help="tools/scaling_law.py --predict, repeatable")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("overrides", nargs="*", help="after --: overrides for every run")
    args = ap.parse_args(argv)
    fit_args = [x for flag in ("target_flops", "bootstrap", "max_interval", "max_ratio", "out")
                if getattr(args, flag) is not None
                for x in (f"--{flag.replace('_', '-')}", getattr(args, flag))]
    fit_args += [x for p in args.predict for x in ("--predict", p)]
    fit_args += ["--no-plots"] if args.no_plots else []
    sizes = [int(s) for s in args.sizes.split(",") if s]
    budgets = branch_budgets(args.recipe)
    plan = [stream_commands(args.recipe, s, budgets, args.overrides)
            for s in streams(sizes, max(args.jobs, 1))]
    sweeps = runs_dir(args.overrides) / "sweeps"
    fit = [str(sweeps / args.recipe), str(sweeps / f"{args.recipe}-cooldown"), *fit_args]
    for i, cmds in enumerate(plan):
        for cmd in cmds:
            print(f"stream {i}: " + " ".join(cmd[1:]), flush=True)
    print("fit: tools/scaling_law.py " + " ".join(fit), flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    if args.jobs > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    rc = 0 if args.fit_only else run_streams(plan, env)
    if rc:
        print(f"a ladder run failed (exit {rc}): not fitting; rerun the same command to "
              "resume", file=sys.stderr)
        return rc
    from pretrain.tools.scaling_law import main as scaling_law

    return scaling_law(fit)


if __name__ == "__main__":
    sys.exit(main())
