"""Plan before you spend: per-GPU memory, verdict, time and GPU-hours for a recipe and layout.

    python tools/plan.py +recipe=gpt3-6.7b --gpu h100-80gb --gpus 64
    python tools/plan.py +recipe=gpt3-6.7b parallel.tp=8 parallel.pp=2 --gpus 64 --mfu 0.45
    python tools/plan.py +recipe=gpt3-6.7b parallel=auto --gpus 256 --gpu a100-80gb --json
    python tools/plan.py +recipe=tiny --gpu-file my_gpus/        # extra GPU types (YAML)

Overrides are Hydra's, exactly as train.py takes them. ``--gpus`` defaults to the layout's
own size (tp x pp x dp); with ``parallel=auto`` it is required. ``--mfu`` defaults to the GPU
type's (conf/gpu/*.yaml). Exit status: 0 fits, 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pretrain.budget import BudgetError  # noqa: E402
from pretrain.cli import compose_config  # noqa: E402
from pretrain.planning.autolayout import LayoutError, resolve_auto  # noqa: E402
from pretrain.planning.gpus import GpuError, get_gpu  # noqa: E402
from pretrain.planning.report import build_plan, format_plan  # noqa: E402
from pretrain.precision import resolve_auto_precision  # noqa: E402
from pretrain.validate import ConfigError, check  # noqa: E402

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
    return ap.parse_known_args(argv)


def fail(message: str) -> int:
    print(f"plan: {message}", file=sys.stderr)
    return BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        return fail(f"unknown option(s) {' '.join(bad)}; see --help")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        return fail(f"--mfu={args.mfu} must be in (0, 1], e.g. 0.4")
    try:
        gpu = get_gpu(args.gpu, tuple(args.gpu_file))
        cfg = compose_config(overrides)
    except GpuError as e:
        return fail(str(e))
    except Exception as e:  # Hydra composition errors: unknown recipe, key or group
        return fail(f"{type(e).__name__}: {e}")
    par = cfg.parallel
    if par.name == "auto":
        if not args.gpus:
            return fail("parallel=auto needs the number of GPUs: add --gpus N")
        n = args.gpus
    else:
        declared = max(par.tp, 1) * max(par.pp, 1) * max(par.dp or 1, 1)
        n = args.gpus or declared
    if n < 1:
        return fail(f"--gpus={n} must be a positive number of GPUs")
    candidates = None
    cfg, auto_precision = resolve_auto_precision(cfg, gpu)
    try:
        if par.name == "auto":
            cfg, candidates = resolve_auto(cfg, n, gpu)
            candidates = candidates[: args.top]
        check(cfg, n)
        plan = build_plan(cfg, n, gpu, args.mfu, candidates)
    except (LayoutError, ConfigError, BudgetError) as e:
        return fail(str(e))
    if auto_precision:
        plan["precision_auto"] = auto_precision
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return FITS if plan["fits"] else DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
