"""Score downstream tasks through a real Trainer's train module on N ranks (or in this
process for one), as the loop's hook does at its last evaluation.

    python tests/forked_ranks.py N tests/downstream_worker.py OUT SPEC

SPEC: helpers.write_spec's file, {"configs": {name: Config}}: the layouts one after the
other in the same process group (each Trainer closed without leaving it, as
tests/parallel_worker.py's layouts are; the group is left at the end). Each rank writes
OUT/<name>.rank<R>.json: the hook's metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from helpers import read_spec

from pretrain.parallel.mesh import destroy
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
        trainer.close(leave_group=False)  # the caller leaves it (mesh.destroy)


def main() -> None:
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    for name, cfg in spec["configs"].items():
        score_layout(cfg, out, name)
        if dist.is_initialized():
            dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
