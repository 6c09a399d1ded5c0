"""Plan before you spend: per-GPU memory, verdict, time and GPU-hours for a recipe and layout.

    python tools/plan.py +recipe=gpt3-6.7b --gpu h100-80gb --gpus 64
    python tools/plan.py +recipe=gpt3-6.7b parallel.tp=8 parallel.pp=2 --gpus 64 --mfu 0.45
    python tools/plan.py +recipe=gpt3-6.7b parallel=auto --gpus 256 --gpu a100-80gb --json
    python tools/plan.py +recipe=tiny --gpu-file my_gpus/        # extra GPU types (YAML)
    python tools/plan.py +recipe=gpt3-175b --simulate --rank 1023  # start one rank for real
    python tools/plan.py --check-matrix        # planned vs simulated peak on 19 layouts

``--simulate`` starts rank R of the run on this CPU, on a fake process group of the run's
world size: the real mesh, parallelisation, initial weights of that rank's shards and
optimizer state, then one micro batch's forward and backward on fake tensors with torch's
memory tracker. Its last line is one JSON object: what the rank holds, measured, next to
the planner's prediction ("predicted").

Overrides are Hydra's, exactly as train.py takes them. ``--gpus`` defaults to the layout's
own size (tp x pp x dp); with ``parallel=auto`` it is required. ``--mfu`` defaults to the GPU
type's (conf/gpu/*.yaml). Exit status: 0 fits, 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from pretrain.budget.compute import BudgetError, resolve_budget
from pretrain.config.compose import compose_config
from pretrain.config.schema import ConfigError
from pretrain.decision.checks import check, run_warnings
from pretrain.decision.resolve import describe_run, resolve_auto
from pretrain.errors import UserError, cli, report
from pretrain.hardware.gpus import get_gpu
from pretrain.parallel.layout import layout_world_size, resolve_layout
from pretrain.planning.autolayout import LayoutError
from pretrain.planning.graphs import graph_verdict
from pretrain.planning.report import build_plan, format_plan

FITS, DOES_NOT_FIT, BAD_INPUT = 0, 1, 2


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--gpu", default="h100-80gb", help="GPU type (conf/gpu/NAME.yaml)")
    ap.add_argument("--gpus", type=int, default=None, help="number of GPUs")
    ap.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation, 0-1")
    ap.add_argument("--gpu-file", action="append", default=[],
                    help="YAML file or directory of extra GPU types (repeatable)")
    ap.add_argument("--top", type=int, default=5, help="candidates shown for parallel=auto")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--simulate", action="store_true",
                    help="start one rank of the run on this CPU (fake process group)")
    ap.add_argument("--rank", type=int, default=0, help="the rank --simulate starts")
    ap.add_argument("--published", action="store_true",
                    help="the planner against published runs (torchtitan, Megatron-LM): a "
                         "markdown table of tokens/s and memory, published and predicted")
    ap.add_argument("--check-matrix", nargs="?", const="all", choices=("all", "fast"),
                    help="the planner's peak memory against --simulate on a matrix of "
                         "layouts (planning/matrix.py): a markdown table; 'fast': a few rows")
    ap.add_argument("--no-step", dest="step", action="store_false",
                    help="--simulate without the fake-tensor forward/backward")
    return ap.parse_known_args(argv)


def fail(message: str) -> int:
    return report(message)  # BAD_INPUT


@cli
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        return fail(f"unknown option(s) {' '.join(bad)}; see --help")
    if args.published:
        from pretrain.planning.published import RUNS, compare, markdown

        print(markdown([compare(run) for run in RUNS]))
        return FITS
    if args.check_matrix:
        return run_matrix(args.check_matrix == "fast")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        return fail(f"--mfu={args.mfu} must be in (0, 1], e.g. 0.4")
    try:
        gpu = get_gpu(args.gpu, tuple(args.gpu_file))
        cfg = compose_config(overrides)
    except UserError:  # a GPU, recipe, key or value that is not there: @cli's line
        raise
    except Exception as e:  # anything else Hydra's composition raises
        return fail(f"{type(e).__name__}: {e}")
    par = cfg.parallel
    if par.name == "auto":
        if not args.gpus:
            return fail("parallel=auto needs the number of GPUs: add --gpus N")
        n = args.gpus
    else:
        n = args.gpus or layout_world_size(par)
    if n < 1:
        return fail(f"--gpus={n} must be a positive number of GPUs")
    try:  # the run's own decision path, on this GPU type (resolve.py)
        cfg, notes = resolve_auto(cfg, n, gpu, top=args.top)
        check(cfg, n)
        budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
        warnings = run_warnings(cfg, budget)  # as the run's resolve_plan
        plan = {**build_plan(cfg, n, gpu, describe_run(cfg, n, budget), args.mfu), **notes}
    except (LayoutError, ConfigError, BudgetError) as e:
        return fail(str(e))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.simulate:
        return run_simulation(cfg, n, args.rank, args.step, plan)
    layout = resolve_layout(cfg, n)
    if layout.one_device:  # the host-bound verdict and what a CUDA graph would save
        plan["cuda_graphs"] = graph_verdict(cfg, layout, gpu, budget).line()
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    if "cuda_graphs" in plan and not args.json:
        print(plan["cuda_graphs"])
    return FITS if plan["fits"] else DOES_NOT_FIT


def run_matrix(fast_only: bool) -> int:
    """Every row of planning/matrix.py simulated and planned; exit 1 if one is off."""
    from pretrain.planning.matrix import check_matrix

    results, table = check_matrix(fast_only, progress=lambda r: print(json.dumps(r),
                                                                      flush=True))
    print(table)
    return FITS if all(r["ok"] for r in results) else DOES_NOT_FIT


def run_simulation(cfg, world_size: int, rank: int, step: bool, plan: dict) -> int:
    from pretrain.planning.simulate import simulate

    if not 0 <= rank < world_size:
        return fail(f"--rank={rank} is not a rank of this {world_size}-GPU run: "
                    f"use 0..{world_size - 1}")
    print(f"simulating rank {rank} of {world_size} ({plan['layout_text']}) on this "
          "CPU: mesh, parallelize, this rank's initial weights and optimizer state"
          + (", then one micro batch on fake tensors" if step else ""), flush=True)
    result = simulate(cfg, world_size, rank, step=step)
    pred = result["predicted"]

    def size(b: float) -> str:
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"

    print(f"rank {rank} {result['coordinate']}: stages {result['stages']}; parameters "
          f"{size(result['local_param_bytes'])} (planner {size(pred['local_param_bytes'])}), "
          f"gradients {size(result['local_grad_bytes'])}, optimizer state "
          f"{size(result['local_optimizer_bytes'])}; initialised in "
          f"{result['init_seconds']:.1f} s; peak host memory "
          f"{size(result['peak_rss_bytes'])}", flush=True)
    if "step_peak_bytes" in result:
        print(f"one micro batch on fake tensors: step peak {size(result['step_peak_bytes'])} ("
              + ", ".join(f"{k} {size(v)}" for k, v in result["step_peak_by_kind"].items() if v)
              + ")", flush=True)
        ratio = result["measured_over_planner"]
        for key, what in (("step_peak_bytes", "forward/backward peak"),
                          ("optimizer_step_peak_bytes", "optimizer step peak"),
                          ("optimizer_step_transient_bytes", "optimizer step transient")):
            r = f"{ratio[key]:.3f}" if ratio[key] is not None else "-"
            print(f"  {what:<26} measured {size(result[key]):>10}, planner "
                  f"{size(pred[key]):>10}, measured/planner {r}", flush=True)
    print(json.dumps(result), flush=True)
    return FITS if plan["fits"] else DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
