"""A loss spike on purpose: the same run with and without the spike guard.

A stretch of bad batches (every target replaced by one token, as a corrupted shard of
repeated text would be) is fed to training steps ``--bad FIRST:LAST`` (1-based, inclusive),
once with ``optim.spike_guard=false`` and once with ``optim.spike_guard=true``, on the
config that train.py composes from the same overrides. Prints each run's final training
and validation loss and the steps it skipped. The corruption is a patch of this tool, not
a config key: nothing in a recipe can turn it on.

    python tools/spike_demo.py --bad 150:159 runs_dir=/tmp/spike_demo
    python tools/spike_demo.py --bad 30:30 --scale 1e4 optim.grad_clip=0 ...
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

from pretrain.config.compose import compose_config
from pretrain.errors import cli
from pretrain.train.trainer import Trainer


def corrupt(trainer: Trainer, first: int, last: int, token: int, scale: float | None
            ) -> None:
    """Replace every target of steps ``first``..``last`` by ``token``; or, with ``scale``,
    multiply their loss and gradients by it (a numerical blow-up)."""
    real = trainer.module.strategy.forward_backward

    def bad_batches(x: torch.Tensor, y: torch.Tensor, measure: bool = False):
        bad = first <= trainer.step + 1 <= last
        if bad and scale is None:
            y = torch.full_like(y, token)
        loss, small = real(x, y, measure)
        if bad and scale is not None:
            for p in trainer.module.parallel.parameters():
                p.grad.mul_(scale)
            loss = loss * scale
        return loss, small

    trainer.module.strategy.forward_backward = bad_batches


def run_once(overrides: list[str], guard: bool, first: int, last: int, token: int,
             scale: float | None) -> dict:
    cfg = compose_config([*overrides, f"optim.spike_guard={str(guard).lower()}",
                          f"run_name=spike_demo_guard_{str(guard).lower()}"])
    trainer = Trainer(cfg, f"{cfg.runs_dir}/{cfg.run_name}")
    try:
        trainer.setup()
        corrupt(trainer, first, last, token, scale)
        result = trainer.fit()
    finally:
        trainer.close()
    return {k: result.get(k) for k in ("final_loss", "final_val_loss", "skipped_steps",
                                        "spike_skipped_steps")}


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bad", default="150:159", help="first:last bad step (1-based)")
    ap.add_argument("--token", type=int, default=0, help="the token every bad target becomes")
    ap.add_argument("--scale", type=float, default=None,
                    help="instead: multiply the bad steps' loss and gradients by this")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as train.py takes them")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    first, last = (int(v) for v in args.bad.split(":"))
    out = {f"guard={g}": run_once(args.overrides, g, first, last, args.token, args.scale)
           for g in (False, True)}
    print(json.dumps({"bad_steps": [first, last], **out}, indent=2))
    return 0
