"""tests/parallel_worker.py's layouts, plus checkpoint round trips of the optimizer state.

Run as ``python tests/forked_ranks.py N tests/optim_worker.py OUT SPEC`` (or
called in the test's process for one process). SPEC: helpers.write_spec's file with
"configs" and "eval_also" as parallel_worker reads them, and "resumes": {name: {"save":
Config, "loads": {load_name: Config}, "k": K}}. For each resume, a run saves a checkpoint
after K steps and goes on to its budget ("straight"); then each load config (another
layout, or the same) starts from that checkpoint and trains the remaining steps. Rank 0
writes OUT/<name>.pt: the losses and final parameters of each, and the whole optimizer
state (every shard and stage gathered, by canonical name) as saved and as loaded.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import read_spec
from parallel_worker import full_params, run_layout
from torch.distributed.tensor import DTensor

from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.config.schema import Config
from pretrain.train.trainer import Trainer


def whole_optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor of the whole model on rank 0 (``fqn/key``), as DCP
    sees it: each DTensor made whole, each pipeline rank's stages merged."""
    osd = ModelOptimizer(trainer.module.parts, trainer.module.optimizer).state_dict()["optim"]
    mine = {f"{fqn}/{key}": (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for fqn, state in osd["state"].items() for key, v in state.items()
            if torch.is_tensor(v)}
    if not dist.is_initialized():
        return mine
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return {k: v for sd in gathered for k, v in sd.items()} if dist.get_rank() == 0 else {}


def train(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.train_step()[0] for _ in range(steps)]


def run_resume(save: Config, loads: dict[str, Config], k: int, out: Path, name: str) -> None:
    first = Trainer(save, out / name)
    first.setup()
    train(first, k)
    first.save_checkpoint(block=True)
    ckpt = first.ckpt.latest()
    record = {"saved_state": whole_optimizer_state(first),
              "straight": train(first, first.budget.steps - k),
              "straight_final": full_params(first), "loads": {}}
    first.ckpt.close()
    for load_name, cfg in loads.items():
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume_from=str(ckpt)))
        trainer = Trainer(cfg, out / f"{name}-{load_name}")
        trainer.setup()
        loaded_state = whole_optimizer_state(trainer)
        record["loads"][load_name] = {"step": trainer.step, "state": loaded_state,
                                      "losses": train(trainer, trainer.budget.steps - k),
                                      "final": full_params(trainer)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(record, out / f"{name}.pt")


def main() -> None:
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    for name, cfg in spec["configs"].items():
        run_layout(cfg, out, name, spec["eval_also"])
        if dist.is_initialized():
            dist.barrier()
    for name, r in spec.get("resumes", {}).items():
        run_resume(r["save"], r["loads"], r["k"], out, name)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
