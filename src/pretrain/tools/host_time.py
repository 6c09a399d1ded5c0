"""The planner's host time of a step against the trainer's step timed on this CPU: nano at
its 2 layers and at 16 (the calibration), the tiny model and the 10M rung (the checks),
eager and compiled (planning/host_check.py says how and why).

    python tools/host_time.py                 # the table (about 2 minutes on 2 cores)
    python tools/host_time.py --json

Times are wall seconds a step: the fastest of ``--blocks`` blocks of ``--steps`` steps each
(another process's burst slows a block, not the figure), each of the eight steps in a
process of its own, their blocks interleaved (a slow minute slows the calibration and the
checks alike), after ``--warmup`` steps (compile and the allocator warmed), one thread (as
torchrun gives a rank). Run it alone on the machine (``flock /tmp/pretrain-cpu.lock``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from pretrain.config.compose import compose_config
from pretrain.errors import cli
from pretrain.planning import host_check
from pretrain.planning.calibration import GPU_HOST

QUIET = ["logging.wandb=disabled", "logging.progress_bar=false", "train.sample_tokens=0"]


class Timed:
    """The trainer's step of ``model`` at host_check's shape, set up and warmed (compile and
    the allocator), timed a block at a time: seconds a step, and of it the forward/backward
    region's (its strategy's ``forward_backward``) and clipping's and the optimizer's
    (``_clipped_grad_norm``, ``_update``)."""

    def __init__(self, model: str, compiled: bool, warmup: int, folder: Path):
        from pretrain.train.trainer import Trainer

        self.model, self.compiled = model, compiled
        cfg = compose_config([*host_check.overrides(model, compiled), *QUIET])
        self.trainer = Trainer(cfg, folder)
        self.trainer.setup()
        for _ in range(warmup):
            self.trainer.train_step_local()
        module = self.trainer.module
        self.region = _timed(module.strategy, "forward_backward")
        self.clip, self.update = _timed(module, "_clipped_grad_norm"), _timed(module, "_update")

    def block(self, steps: int) -> host_check.Measured:
        self.region[0] = self.clip[0] = self.update[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            self.trainer.train_step_local()
        return host_check.Measured(self.model, self.compiled, (time.perf_counter() - t0) / steps,
                                   self.region[0] / steps,
                                   (self.clip[0] + self.update[0]) / steps)


def measure_all(steps: int, warmup: int, blocks: int) -> list[host_check.Measured]:
    """Every model, eager and compiled, each in a process of its own, their blocks
    interleaved (a block of each in turn, ``blocks`` rounds, one process running at a time):
    a slow minute of a shared machine lands on the models calibrated on and the models
    checked alike, not on one of them (timed one model after the other, the step times moved
    5-25% between runs minutes apart); and no step is slowed by the others built before it
    in its process (built in one process, a model built after twelve others took 10-15%
    longer than the same model built first). Each keeps its fastest block (another
    process's burst slows a block, not the figure)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        pipes = []
        for m in host_check.MODELS:
            for c in (False, True):
                ours, theirs = ctx.Pipe()
                ctx.Process(target=_serve, args=(theirs, m, c, warmup, f"{tmp}/{m}-{int(c)}"),
                            daemon=True).start()
                pipes.append(ours)
        for p in pipes:
            p.recv()  # built and warmed
        rounds = [[_ask(p, ("block", steps)) for p in pipes] for _ in range(blocks)]
        best = [min(blocks_of, key=lambda m: m.step_s) for blocks_of in zip(*rounds, strict=True)]
        return [replace(b, launch_share=_ask(p, ("profile", steps)) if b.compiled else 0.0)
                for b, p in zip(best, pipes, strict=True)]


def _ask(pipe, request):
    pipe.send(request)
    return pipe.recv()


def _serve(pipe, model: str, compiled: bool, warmup: int, folder: str) -> None:
    """A model's process: build and warm its step (one thread, as torchrun gives a rank),
    then time a block or profile its steps when asked, until the parent closes."""
    torch.set_num_threads(1)
    timed = Timed(model, compiled, warmup, Path(folder))
    pipe.send(None)
    while True:
        try:
            what, steps = pipe.recv()
        except EOFError:
            return
        pipe.send(timed.block(steps) if what == "block" else launch_share(timed.trainer, steps))


# torch.profiler's names (torch 2.13): the compiled region's entry (dynamo's guards, then
# the region: AOTAutograd's forward wrapper and the generated forward), the backward
# node's evaluation (its wrapper and the generated backward), and the generated code
GRAPH_EVENTS = ("TorchDynamo Cache Lookup", "Torch-Compiled Region",
                "autograd::engine::evaluate_function: CompiledFunctionBackward")
GENERATED = "## Call CompiledFxGraph"


def launch_share(trainer, steps: int) -> float:
    """Of the compiled graph's host time in ``steps`` profiled steps, the share inside
    inductor's generated code (forward and backward: its kernels' calls); the rest is the
    guards and AOTAutograd's runtime wrappers. A profile slows each event alike, so the
    share, not its times, is what is kept."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step_local()
    events = prof.key_averages()
    graph = sum(e.cpu_time_total for e in events if e.key.startswith(GRAPH_EVENTS))
    generated = sum(e.cpu_time_total for e in events if e.key.startswith(GENERATED))
    return generated / graph if graph else 0.0


def _timed(owner, attr: str) -> list[float]:
    """Wrap ``owner.attr`` to add its wall seconds into the returned one-element list."""
    inner, seconds = getattr(owner, attr), [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        seconds[0] += time.perf_counter() - t0
        return out

    setattr(owner, attr, timed)
    return seconds


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="steps a block")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    measured = measure_all(args.steps, args.warmup, args.blocks)
    costs = host_check.calibrate(measured)
    table = host_check.rows(measured, costs)
    if args.json:
        print(json.dumps({"rows": table, "cpu_costs": costs.__dict__,
                          "gpu_host_costs": GPU_HOST.__dict__,
                          "measured": [m.__dict__ for m in measured]}))
    else:
        print(host_check.markdown(table, costs))
    return 0
