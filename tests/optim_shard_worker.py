"""Optimizer steps on a matrix sharded over 2 ranks against the same steps on one process.

Run as ``python tests/forked_ranks.py 2 tests/optim_shard_worker.py OUT``.
For each placement (Shard(0): FSDP2's and column-parallel TP's; Shard(1): row-parallel
TP's), rank 0 writes OUT/shards.pt: the largest difference between the whole matrix after
3 steps and one process's, for ShardedMuon, for torch.optim.Muon left to run on the shards,
and for LAMB; and the bytes one orthogonalisation allocates, whole and sharded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from pretrain.optim.muon import ShardedMuon, orthogonalise
from pretrain.optim.trust_ratio import Lamb

KW = {"lr": 0.1, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
OPTIMIZERS = {"sharded_muon": lambda p: ShardedMuon([p], **KW),
              "torch_muon": lambda p: torch.optim.Muon([p], **KW),
              "lamb": lambda p: Lamb([p], lr=0.01, weight_decay=0.1)}


def steps(make, w: torch.Tensor, grads: list[torch.Tensor], place) -> torch.Tensor:
    p = torch.nn.Parameter(place(w.clone()))
    opt = make(p)
    for g in grads:
        p.grad = place(g.clone())
        opt.step()
    return p.detach()


def transient(update: torch.Tensor) -> int:
    """Peak bytes ``orthogonalise`` allocates beyond its input (torch's MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    group = ShardedMuon([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    tracker = MemTracker()
    tracker.track_external(update)
    with tracker:
        orthogonalise(update, group)
    peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    local = update.to_local() if hasattr(update, "to_local") else update
    return peak - local.nbytes


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    w, grads = torch.randn(9, 6), [torch.randn(9, 6) for _ in range(3)]
    out: dict[str, dict[str, float]] = {name: {} for name in OPTIMIZERS}
    for name, make in OPTIMIZERS.items():
        one = steps(make, w, grads, lambda t: t)
        for dim in (0, 1):
            got = steps(make, w, grads,
                        lambda t, d=dim: distribute_tensor(t, mesh, [Shard(d)])).full_tensor()
            out[name][f"Shard({dim})"] = (got - one).abs().max().item()
    big = torch.randn(96, 40)
    out["transient"] = {"one": transient(big), "Shard(0)": transient(
        distribute_tensor(big, mesh, [Shard(0)]))}
    if dist.get_rank() == 0:
        torch.save(out, Path(sys.argv[1]) / "shards.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
