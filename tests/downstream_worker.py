"""Score downstream tasks through a real Trainer's train module under torchrun (or in this
process for one), as the loop's hook does at its last evaluation.

    torchrun --standalone --nproc_per_node=N tests/downstream_worker.py OUT SPEC

SPEC: helpers.write_spec's file, {"configs": {name: Config}} (one layout a launch: a
second Trainer after the first one closed hung in these ranks). Each rank writes
OUT/<name>.rank<R>.json: the hook's metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from helpers import read_spec

from pretrain.train.services.tasks import TaskEvaluation
from pretrain.train.trainer import Trainer


def score_layout(cfg, out: Path, name: str) -> dict:
    trainer = Trainer(cfg, out / name)
    try:
        trainer.setup()
        hook = TaskEvaluation(cfg.eval)
        hook.start(trainer.ctx)
        trainer.step = trainer.budget.steps  # the last step: always scored
        metrics: dict = {}
        hook.evaluate(trainer.ctx.collecting(metrics))
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(metrics))
        return metrics
    finally:
        trainer.close()


if __name__ == "__main__":
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    for name, cfg in spec["configs"].items():
        score_layout(cfg, out, name)
