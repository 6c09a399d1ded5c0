"""Several whole runs, one after the other, in one process group: each as
``pretrain.train.trainer.run`` trains it (setup, fit: evaluate, step, log, stop or save,
resume from its run directory's newest checkpoint or from checkpoint.resume_from), but
closed without leaving the group, so the next run joins the same processes.

    python tests/forked_ranks.py N tests/runs_worker.py OUT SPEC

SPEC: helpers.write_spec's file, {"runs": [(key, Config, run_dir), ...]}, in order (a run
directory may come twice: stopped, then resumed). Rank 0 writes OUT/results.json: each
run's result by key (its exit status under "exit_code": 75 for a run stopped to be
requeued, as a process started without torchrun exits).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist
from helpers import read_spec

from pretrain.config.schema import Config
from pretrain.parallel.mesh import destroy
from pretrain.train.trainer import Trainer


def run_in_group(cfg: Config, run_dir: Path) -> dict:
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.setup()
        result = trainer.fit()
        result["exit_code"] = trainer.exit_code
        return result
    finally:
        trainer.close(leave_group=False)
        del trainer
        gc.collect()


def main() -> None:
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    results = {}
    for key, cfg, run_dir in spec["runs"]:
        results[key] = run_in_group(cfg, Path(run_dir))
        dist.barrier()
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    destroy()  # the group left while its gloo threads can still finish (parallel_worker)
    gc.collect()


if __name__ == "__main__":
    main()
