"""Run ``Trainer.fit`` on N ranks and record what the loop around the optimizer step
costs in collectives and host syncs, step by step, and where each rank stops.

    python tests/forked_ranks.py N tests/loop_worker.py OUT SPEC  (or under torchrun)

SPEC: helpers.write_spec's file, {"runs": {name: {"config": Config, "signal": [step, rank]
or null}}}. Every run is one Trainer + fit() in these processes. With
``signal``, that rank sends itself SIGUSR1 right after that step (the other ranks get none).

Each rank writes OUT/<name>.rank<R>.json: fit()'s result, its share of each step's loss
(as train_step_local returns it), and per step k the collectives
(torch.distributed calls) and host syncs (``Tensor.item`` / ``tolist`` called from
``pretrain`` code) made inside ``train_step_local`` (the step: forward, backward, clip,
optimizer) and outside it after step k (logging, eval, stop check, checkpoints) up to the
next step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import read_spec

from pretrain.config.schema import Config
from pretrain.train.trainer import Trainer

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_gather_object", "broadcast_object_list")
PACKAGE = os.sep + "pretrain" + os.sep


class Counts:
    """Counters by phase ("step" inside train_step_local, "loop" outside it)."""

    def __init__(self):
        self.phase = "loop"
        self.c: Counter = Counter()

    def hit(self, kind: str) -> None:
        self.c[(self.phase, kind)] += 1

    def take(self) -> dict[str, int]:
        out = {f"{p}_{k}": n for (p, k), n in self.c.items()}
        self.c.clear()
        return out


def instrument(counts: Counts) -> None:
    """Count every torch.distributed collective, and the host syncs pretrain's code asks
    for (``.item()``, ``.tolist()``; torch's own, e.g. AdamW's CPU step counters, are not
    device syncs and are left out)."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapped(*args, _real=real, **kwargs):
            counts.hit("collectives")
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)

        def synced(self, _real=real):
            if PACKAGE in sys._getframe(1).f_code.co_filename:
                counts.hit("syncs")
            return _real(self)

        setattr(torch.Tensor, name, synced)


def run(cfg: Config, out: Path, name: str, sig: list[int] | None, counts: Counts) -> None:
    trainer = Trainer(cfg, out / name)
    trainer.setup()
    rank = dist.get_rank()
    per_step: dict[int, dict[str, int]] = {}
    local_losses: list[float] = []
    real_step = trainer.train_step_local

    def record() -> None:  # what the current phase counted, under the last step's number
        per_step.setdefault(trainer.step, {}).update(counts.take())

    def step():
        record()  # the loop after the previous step
        counts.phase = "step"
        try:
            loss, norm = real_step()
            local_losses.append(loss.tolist())  # this test's own sync: not counted
            return loss, norm
        finally:
            record()
            counts.phase = "loop"
            if sig is not None and sig == [trainer.step, rank]:
                os.kill(os.getpid(), signal.SIGUSR1)

    trainer.train_step_local = step
    counts.take()
    try:
        result = trainer.fit()
    finally:
        trainer.stop.restore()
    record()
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(
        {"result": {k: v for k, v in result.items() if k != "sample"}, "steps": per_step,
         "local_losses": local_losses}))


def main() -> None:
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    counts = Counts()
    dist.init_process_group("gloo")  # the trainer joins the existing group
    instrument(counts)
    for name, run_spec in spec["runs"].items():
        run(run_spec["config"], out, name, run_spec["signal"], counts)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
