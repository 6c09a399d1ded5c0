"""Per-token losses of packed windows under document masking, on a multi-process layout.

Run as ``python tests/forked_ranks.py 2 tests/doc_attention_worker.py OUT SPEC`` (or under
torchrun) (SPEC: helpers.write_spec's file, {"cases": {name: Config}, "x": tokens, "y":
targets, "seed": int, "attention": backend}). Every case runs in the same two processes, one
after the other (one start-up for all, as tests/parallel_worker.py). For each, builds the
layout the way a run does (train_module.join, parallel.apply: parallelize_gpt, materialize
with ``seed``, so every rank starts from the weights one process would), then: without a
pipeline, one forward, the vocabulary-sharded logits gathered; with one, a training step of
the configured schedule (forward and backward, the document ids travelling between stages
with the activations), its loss function recording each micro batch's per-token losses.
Rank 0 (or the last stage's rank) writes OUT/<name>.pt: (batch, seq) per-token losses. The
process group is joined once and each case builds its own mesh in it (leaving and joining
again between cases raced in init_process_group's store barrier and hung); left at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import read_spec
from torch.distributed.tensor import DTensor

from pretrain.parallel.apply import materialize, parallelize_gpt
from pretrain.parallel.layout import resolve_layout
from pretrain.parallel.mesh import destroy
from pretrain.parallel.pipeline import build_schedule
from pretrain.precision.policy import resolve_policy
from pretrain.train.train_module import join


def token_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(),
                           reduction="none").view(y.shape)


def case_losses(cfg, x: torch.Tensor, y: torch.Tensor, seed: int,
                attention: str) -> torch.Tensor | None:
    """This rank's per-token losses of one case (None where the rank holds no logits)."""
    device = torch.device("cpu")
    layout = resolve_layout(cfg, dist.get_world_size() if dist.is_initialized() else 2)
    policy = resolve_policy(cfg.precision, device)
    place = join(layout, device, policy, 2)
    pm = parallelize_gpt(cfg, layout, place.mesh, device, policy, attention)
    materialize(pm, device, seed)
    if layout.pp == 1:
        with torch.no_grad():
            losses = token_losses(pm.parts[0](x), y)
        return losses if dist.get_rank() == 0 else None
    recorded: list[torch.Tensor] = []

    def loss_fn(logits, target):
        per_token = token_losses(logits, target)
        recorded.append(per_token.detach())
        return per_token.mean()

    schedule = build_schedule(pm.parts, pm.stage_ids, layout, place.mesh.pp, device, loss_fn)
    schedule.step(*([x] if pm.has_first_stage else []),
                  target=y if pm.has_last_stage else None, return_outputs=False)
    # the last micro batches' (torch's first step may add a shape-inference call)
    if not (pm.has_last_stage and recorded):
        return None
    return torch.cat(recorded[-layout.microbatches:])


def main() -> None:
    out, spec = Path(sys.argv[1]), read_spec(sys.argv[2])
    for name, cfg in spec["cases"].items():
        losses = case_losses(cfg, spec["x"], spec["y"], spec["seed"], spec["attention"])
        if losses is not None:
            torch.save(losses, out / f"{name}.pt")
        dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
