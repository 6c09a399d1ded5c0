"""Run a WSD ladder with its cooldown branches, then fit and predict: one command.

    python tools/ladder.py --sizes 16,24,32,48,60,72 --seed-sizes 16,72 --jobs 2 \\
        --min-steps 200 --target-flops 3.18e14 -- data.root=data/ladder-bytes

For a ladder recipe R (default ``ladder-bytes``) with a cooldown recipe ``R-cooldown``
(recipes/ladder-bytes.yaml, ladder-bytes-cooldown.yaml), it runs:

1. one long WSD run per size: ``python train.py -m +recipe=R model.d_model=<sizes>``, each
   storing the branch points of the recipe's ``checkpoint.branch_tokens_per_param``;
2. the cooldown branches of each size: ``python train.py -m +recipe=R-cooldown
   model.d_model=<sizes> budget.tokens_per_param=<those budgets>``;
3. ``tools/scaling_law.py <runs_dir>/sweeps/R <runs_dir>/sweeps/R-cooldown`` with the
   target and points given: L(N, D), the compute-optimal N and D at the target with bootstrap
   intervals, and whether the prediction is supported or extrapolated.

``--jobs J`` runs the sizes in J streams at once (each one thread, ``OMP_NUM_THREADS=1``
unless set), the sizes dealt out largest first to the stream with the least work; each
stream runs its sources, then their branches. ``--per-device K`` puts K streams on each
GPU (stream i sees only GPU i // K: ``CUDA_VISIBLE_DEVICES``), for rungs too small to fill
one GPU each (a 10M rung's step is host-bound: several processes keep the GPU busy; issue
49): ``--jobs 8 --per-device 4`` runs 8 streams on 2 GPUs. Overrides after ``--`` go to every run (a
data root, ``runs_dir``, a seed); a cooldown recipe whose ``branch_from`` is
``${pretrain_sweep_source:...}`` (ladder-bytes-cooldown) finds each branch's source whatever
they change; one that names the source by its size alone (ladder-mix-cooldown) needs
overrides that leave what is trained unchanged. The flags of the
fit (``--target-flops``, ``--predict``, ``--predict-run``, ``--bootstrap``, ``--max-interval``,
``--max-ratio``, ``--max-size-ratio``, ``--out``, ``--count``, ``--metric``, ``--min-steps``,
``--diagnose``,
``--backtest``, ``--backtest-tolerance``, ``--min-params``,
``--no-plots``) go to
tools/scaling_law.py. ``--dry-run`` prints the commands and
runs nothing; ``--fit-only`` fits the runs already there. ``--seed-sizes 16,72`` adds a second
seed (``--seed``, ``train.seed``) of those sizes, sources and branches, in their own streams:
the seed-to-seed spread the fit's interval must include.

``--plan`` runs nothing either: it states the whole design (pretrain/analysis/ladder_design.py)
and refuses, with exit code 2, one that cannot identify L(N, D) or does not fit its budget::

    python tools/ladder.py --recipe ladder-bytes --sizes 16,24,32,48,60,72 --seed-sizes 16,72 \
        --plan --core-hours 2 --ratio 30 -- data.root=data/ladder-bytes

It composes every size as train.py would (counts, LR, branch points), measures each size's
tokens/s with tools/bench.py at one thread per run (``--rates FILE`` keeps the measurements
and reuses them), and sizes the held-out run at ``--ratio`` x the largest rung's compute, at
the tokens/param of ``--fit fit.json`` (a fit's compute-optimal split) or 20.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.errors import UserError, cli


def branch_budgets(recipe: str, overrides: list[str] = ()) -> list[float]:
    """The tokens per parameter of the recipe's branch points (its cooldown budgets), as
    the recipe composes (its defaults included) with the ladder's overrides."""
    from pretrain.config.compose import compose_config

    if not (REPO / "recipes" / f"{recipe}.yaml").exists():
        raise UserError(f"--recipe {recipe}: no recipes/{recipe}.yaml")
    budgets = compose_config([f"+recipe={recipe}", *overrides]).checkpoint.branch_tokens_per_param
    if not budgets:
        raise UserError(f"recipes/{recipe}.yaml sets no checkpoint.branch_tokens_per_param: "
                         "a ladder recipe stores branch points for its cooldown branches")
    if not (REPO / "recipes" / f"{recipe}-cooldown.yaml").exists():
        raise UserError(f"--recipe {recipe}: no recipes/{recipe}-cooldown.yaml for the branches")
    return [float(b) for b in budgets]


Unit = tuple[int, "int | None"]  # a width, and its train.seed (None: the recipe's)


def deal(units: list[Unit], jobs: int) -> list[list[Unit]]:
    """Units dealt into ``jobs`` streams, largest first to the least loaded (work ~ d^2);
    of two equal widths the recipe's seed first."""
    out: list[list[Unit]] = [[] for _ in range(min(jobs, len(units)))]
    for u in sorted(units, key=lambda u: (u[0], u[1] is None), reverse=True):
        min(out, key=lambda s: sum(d * d for d, _ in s)).append(u)
    return out


def streams(sizes: list[int], jobs: int) -> list[list[int]]:
    """Sizes dealt into ``jobs`` streams, largest first to the least loaded (work ~ d^2)."""
    return [[d for d, _ in s] for s in deal([(d, None) for d in sizes], jobs)]


def _fmt(x: float) -> str:
    return f"{x:g}"


def stream_commands(recipe: str, sizes: list[int], budgets: list[float],
                    overrides: list[str]) -> list[list[str]]:
    """The two train.py commands of one stream: its sources, then their branches."""
    d = "model.d_model=" + ",".join(map(str, sizes))
    train = [sys.executable, str(REPO / "train.py"), "-m"]
    # a branch's budget and branch points are its own: the sources' overrides of them stay
    # with the sources (the cooldown recipe still finds its source: pretrain_sweep_source)
    own = ("budget.tokens_per_param=", "checkpoint.branch_tokens_per_param=")
    cool = [o for o in overrides if not o.lstrip("+~").startswith(own)]
    return [train + [f"+recipe={recipe}", d, *overrides],
            train + [f"+recipe={recipe}-cooldown", d,
                     "budget.tokens_per_param=" + ",".join(map(_fmt, budgets)), *cool]]


def stream_envs(streams: int, per_device: int, env: dict) -> list[dict]:
    """Each stream's environment: ``env``, and with ``per_device`` K > 0 the one GPU it
    sees (stream i: GPU i // K, as ``CUDA_VISIBLE_DEVICES`` numbers them)."""
    if per_device <= 0:
        return [env] * streams
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else None
    out = []
    for i in range(streams):
        gpu = i // per_device
        if gpus is not None and gpu >= len(gpus):
            raise ValueError(f"--per-device {per_device} puts {streams} streams on "
                             f"{gpu + 1} GPUs; CUDA_VISIBLE_DEVICES={visible} has "
                             f"{len(gpus)}: raise --per-device or lower --jobs")
        out.append({**env, "CUDA_VISIBLE_DEVICES": gpus[gpu] if gpus else str(gpu)})
    return out


def run_streams(plan: list[list[list[str]]], envs: list[dict]) -> int:
    """Run the streams at once (stream i in ``envs[i]``), each its commands in order; the
    first failure's code."""
    procs = [(cmds, env, subprocess.Popen(cmds[0], env=env, cwd=REPO))
             for cmds, env in zip(plan, envs, strict=True)]
    rc = 0
    for cmds, env, proc in procs:
        code = proc.wait()
        for cmd in cmds[1:]:
            if code:
                break
            code = subprocess.run(cmd, env=env, cwd=REPO).returncode
        rc = rc or code
    return rc


def unit_commands(recipe: str, units: list[Unit], budgets: list[float],
                  overrides: list[str]) -> list[list[str]]:
    """A stream's commands: per seed (the recipe's first), its sources, then their branches,
    which find their sources by the recipe's ``pretrain_sweep_source``."""
    seeds = list(dict.fromkeys(seed for _, seed in units))
    return [cmd for seed in seeds
            for cmd in stream_commands(recipe, [d for d, s in units if s == seed], budgets,
                                       overrides + ([] if seed is None
                                                    else [f"train.seed={seed}"]))]


def runs_dir(overrides: list[str]) -> Path:
    for o in overrides:
        if o.startswith("runs_dir="):
            return Path(o.split("=", 1)[1])
    return REPO / "runs"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", required=True, help="widths (model.d_model), e.g. 12,16,20,24")
    ap.add_argument("--recipe", default="ladder-bytes")
    ap.add_argument("--jobs", type=int, default=1, help="streams run at once (default 1)")
    ap.add_argument("--per-device", type=int, default=0, metavar="K",
                    help="K streams on each GPU (CUDA_VISIBLE_DEVICES per stream; default: "
                    "every stream sees every GPU)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--fit-only", action="store_true", help="fit the finished runs only")
    for flag in ("--target-flops", "--bootstrap", "--max-interval", "--max-ratio",
                 "--max-size-ratio", "--out", "--count", "--metric", "--min-steps", "--backtest",
                 "--backtest-tolerance", "--min-params"):
        ap.add_argument(flag, help=f"tools/scaling_law.py {flag}")
    ap.add_argument("--predict", action="append", default=[], metavar="N,D",
                    help="tools/scaling_law.py --predict, repeatable")
    ap.add_argument("--predict-run", action="append", default=[], metavar="DIR",
                    help="tools/scaling_law.py --predict-run, repeatable")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="tools/scaling_law.py --diagnose")
    ap.add_argument("--seed-sizes", default="", help="widths to run again at --seed")
    ap.add_argument("--seed", type=int, default=7, help="train.seed of the second seed (7)")
    plan = ap.add_argument_group("--plan: state and check the design, run nothing")
    plan.add_argument("--plan", action="store_true")
    plan.add_argument("--core-hours", type=float, help="budget of the whole study, core-hours")
    plan.add_argument("--flops", type=float, help="budget of the whole study, C = 6 N D")
    plan.add_argument("--ratio", type=float, default=30.0,
                      help="held-out compute / the largest rung's (30)")
    plan.add_argument("--fit", type=Path, help="a fit.json whose compute-optimal split sets the "
                      "held-out run's tokens/param (default: 20, Chinchilla's)")
    plan.add_argument("--target-tpp", type=float, help="the held-out run's tokens/param")
    plan.add_argument("--heldout-threads", type=int, default=os.cpu_count() or 1)
    plan.add_argument("--rates", type=Path, help="JSON of measured tokens/s, read and updated")
    plan.add_argument("--no-measure", action="store_true",
                      help="plan without measuring speeds (no times, no time budget)")
    ap.add_argument("overrides", nargs="*", help="after --: overrides for every run")
    return ap


def fit_arguments(args: argparse.Namespace) -> list[str]:
    """The flags that go on to tools/scaling_law.py."""
    fit_args = [x for flag in ("target_flops", "bootstrap", "max_interval", "max_ratio",
                               "max_size_ratio", "out", "count", "metric", "min_steps",
                               "backtest", "backtest_tolerance", "min_params")
                if getattr(args, flag) is not None
                for x in (f"--{flag.replace('_', '-')}", getattr(args, flag))]
    fit_args += [x for p in args.predict for x in ("--predict", p)]
    fit_args += [x for r in args.predict_run for x in ("--predict-run", r)]
    fit_args += ["--no-plots"] if args.no_plots else []
    return fit_args + (["--diagnose"] if args.diagnose else [])


@cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plan:
        from pretrain.tools.ladder_plan import plan_main

        return plan_main(args)
    fit_args = fit_arguments(args)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    budgets = branch_budgets(args.recipe, args.overrides)
    seed_sizes = [int(s) for s in args.seed_sizes.split(",") if s]
    units = [(d, None) for d in sizes] + [(d, args.seed) for d in seed_sizes]
    plan = [unit_commands(args.recipe, s, budgets, args.overrides)
            for s in deal(units, max(args.jobs, 1))]
    sweeps = runs_dir(args.overrides) / "sweeps"
    fit = [str(sweeps / args.recipe), str(sweeps / f"{args.recipe}-cooldown"), *fit_args]
    env = dict(os.environ)
    if args.jobs > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    envs = stream_envs(len(plan), args.per_device, env)
    for i, (cmds, e) in enumerate(zip(plan, envs, strict=True)):
        gpu = f" (CUDA_VISIBLE_DEVICES={e['CUDA_VISIBLE_DEVICES']})" if args.per_device else ""
        for cmd in cmds:
            print(f"stream {i}{gpu}: " + " ".join(cmd[1:]), flush=True)
    print("fit: tools/scaling_law.py " + " ".join(fit), flush=True)
    if args.dry_run:
        return 0
    rc = 0 if args.fit_only else run_streams(plan, envs)
    if rc:
        print(f"a ladder run failed (exit {rc}): not fitting; rerun the same command to "
              "resume", file=sys.stderr)
        return rc
    from pretrain.tools.scaling_law import main as scaling_law

    return scaling_law(fit)


if __name__ == "__main__":
    sys.exit(main())
