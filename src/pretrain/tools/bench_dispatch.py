"""Print the aten ops one training step dispatches, and the planner's host and GPU time.

    python tools/bench_dispatch.py +recipe=gpt2-124m parallel.micro_batch_size=16 \\
        train.global_batch_size=64 precision=bf16 --gpu h100-80gb

The counts are planning/dispatch.py's (a dispatch mode counting the ops of the project's
model and loss on this CPU); planning/calibration.py turns them into host seconds with the
constants calibrated on recorded GPU runs. Re-calibrate after the training step changes:
time the step on a GPU, then divide by the counts printed here.
"""

from __future__ import annotations

import argparse
import json

from pretrain.budget.compute import resolve_budget
from pretrain.config.compose import compose_config
from pretrain.errors import cli
from pretrain.hardware.gpus import get_gpu
from pretrain.parallel.layout import resolve_layout
from pretrain.planning.cost import step_cost
from pretrain.planning.dispatch import count_ops, loss_chunks


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--gpus", type=int, default=1)
    args, overrides = ap.parse_known_args(argv)
    cfg = compose_config(overrides)
    layout = resolve_layout(cfg, args.gpus)
    c = count_ops(cfg.model)
    chunks = loss_chunks(cfg.model, layout.micro_batch_size, vocab_sharded=layout.tp > 1)
    blocks = cfg.model.n_layer // layout.pp
    per_mb = c.outside + blocks * c.per_block + c.loss_base + c.loss_per_chunk * chunks
    cost = step_cost(cfg, layout, get_gpu(args.gpu),
                     resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size))
    out = {"counts": c.__dict__, "blocks": blocks, "loss_chunks": chunks,
           "ops_per_micro_batch": per_mb, "microbatches": layout.microbatches,
           "eager_ops_per_step": layout.microbatches * per_mb + c.step,
           "compile": cfg.train.compile, "host_s": cost.host,
           "gpu_s": cost.device - cost.offload, "step_s": cost.total,
           "host_bound": cost.host_bound}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
