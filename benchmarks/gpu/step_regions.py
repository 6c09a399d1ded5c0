"""Where a training step's host time goes: the trainer's step split into its regions (the
batch and hooks, forward/backward, clipping, the optimizer, zero_grad, the schedule) and the
rest (the step's own Python), each timed on the host without a device sync, beside the
device's own time for the same steps. On a GPU this is the host time a CUDA graph cannot
remove: everything outside the graphed forward/backward. Runs on the CPU too (a smoke run).

    python benchmarks/gpu/step_regions.py +recipe=tiny train.cuda_graphs=true --steps 50
    python benchmarks/gpu/step_regions.py +recipe=tiny train.device=cpu --steps 5 --json

Prints a table (ms per step by region, op count per region from torch.profiler) and, with
--json, one JSON line; --trace PATH writes the profiler's Chrome trace of two steps."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pretrain.config.compose import compose_config
from pretrain.train.trainer import Trainer

QUIET = ["logging.wandb=disabled", "logging.progress_bar=false", "train.sample_tokens=0"]


class Regions:
    """Host seconds per named region: each wrapped callable adds its wall time (no device
    sync, so on a GPU this is launch and Python time) and opens a profiler range."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            with record_function(f"region::{name}"):
                out = inner(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t0
            return out

        setattr(owner, attr, timed)


def instrument(trainer: Trainer) -> Regions:
    module, regions = trainer.module, Regions()
    regions.wrap(trainer, "_local_batch", "batch")
    regions.wrap(trainer, "_call_hooks", "hooks")
    regions.wrap(module.strategy, "forward_backward", "forward_backward")
    regions.wrap(module, "_clipped_grad_norm", "clip")
    regions.wrap(module, "_update", "optimizer")
    regions.wrap(module.optimizer, "zero_grad", "zero_grad")
    regions.wrap(module.scheduler, "step", "schedule")
    return regions


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(overrides: list[str], steps: int, warmup: int, trace: Path | None) -> dict:
    cfg = compose_config([*overrides, *QUIET])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp))
        trainer.setup()
        device = trainer.device
        for _ in range(warmup):  # compile, capture the graphs, warm the allocator
            trainer.train_step_local()
        sync(device)
        regions = instrument(trainer)
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            h0 = time.perf_counter()
            trainer.train_step_local()
            host += time.perf_counter() - h0
        sync(device)
        wall = time.perf_counter() - t0
        seconds = dict(regions.seconds)  # before the profiled steps add theirs
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                trainer.train_step_local()
            sync(device)
        if trace:
            prof.export_chrome_trace(str(trace))
    ops = op_counts(prof)
    per_step = {k: round(1e3 * v / steps, 3) for k, v in sorted(seconds.items())}
    named = sum(seconds.values())
    return {"overrides": overrides, "device": str(device), "steps": steps,
            "step_ms": round(1e3 * wall / steps, 3), "host_ms": round(1e3 * host / steps, 3),
            "regions_ms": per_step,
            "rest_ms": round(1e3 * (host - named) / steps, 3),
            "ops_per_step": ops, "device_ms": device_ms(prof)}


def op_counts(prof) -> dict[str, int]:
    """aten ops a step (two profiled steps halved), by the innermost region holding them."""
    counts: dict[str, int] = defaultdict(int)
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    ranges = [e for e in events if e.name.startswith("region::")]
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        inside = [r for r in ranges if r.time_range.start <= e.time_range.start
                  and e.time_range.end <= r.time_range.end]
        name = (min(inside, key=lambda r: r.time_range.elapsed_us()).name[8:]
                if inside else "outside")
        counts[name] += 1
    return {k: v // 2 for k, v in sorted(counts.items())}


def device_ms(prof) -> float | None:
    """The GPU's busy time a step (kernel self time, two steps halved); None on a CPU."""
    total = sum(e.self_device_time_total for e in prof.key_averages()
                if e.self_device_time_total > 0)
    return round(total / 2e3, 3) if total else None


def print_table(r: dict) -> None:
    print(f"{r['device']}: {r['step_ms']} ms a step (wall, {r['steps']} steps), host "
          f"{r['host_ms']} ms, device {r['device_ms']} ms")
    print(f"{'region':18} {'host ms/step':>12} {'aten ops':>9}")
    for k, v in r["regions_ms"].items():
        print(f"{k:18} {v:12.3f} {r['ops_per_step'].get(k, 0):9d}")
    print(f"{'rest (loop Python)':18} {r['rest_ms']:12.3f} "
          f"{r['ops_per_step'].get('outside', 0):9d}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", type=Path)
    args, overrides = ap.parse_known_args(argv)
    r = measure(overrides, args.steps, args.warmup, args.trace)
    print(json.dumps(r)) if args.json else print_table(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
