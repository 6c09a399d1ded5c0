"""Process group and the one DeviceMesh of a run.

The mesh is ``(pp, dp_replicate, dp_shard, tp)`` with TP innermost, Megatron's rank order:
the ranks of one TP group are adjacent (same node, fastest links), then data parallel, then
pipeline stages outermost. ``dp_replicate`` x ``dp_shard`` is flattened into ``dp`` for
data loading and loss averaging; FSDP uses ``dp_shard`` (or both, for HSDP), DDP ``dp``.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pretrain import torch_compat
from pretrain.parallel.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# With expert parallelism dp_shard is built from (dp_shard_mod_ep, ep), ep innermost: an
# EP group is adjacent ranks (one node, where the all-to-all is fastest).
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


def init_distributed(device: torch.device, timeout_s: float) -> torch.device:
    """Join the process group torchrun/srun described in the environment (a group of one
    without a launcher); return this rank's device (cuda:LOCAL_RANK on GPUs). NCCL on
    CUDA, gloo on CPU. ``timeout_s``: every collective's until the run shortens it after
    its first step (comm.init_timeout_s, then comm.train_timeout_s: train/hang.py)."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # One process started without a launcher (mixed precision on one device runs FSDP2
        # over a group of one): an in-memory store, no port to open.
        alone = "WORLD_SIZE" not in os.environ
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
            **({"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}),
        )
    return device


@dataclass(frozen=True)
class Meshes:
    """The run's mesh and the views of it each parallelism uses."""

    root: DeviceMesh  # (pp, dp_replicate, dp_shard, tp)
    pp: DeviceMesh
    dp: DeviceMesh  # all data-parallel ranks, flattened: data slices, DDP, loss averages
    fsdp: DeviceMesh  # dp, or (dp_replicate, dp_shard) for HSDP
    tp: DeviceMesh
    ep: DeviceMesh | None = None  # expert parallelism: the ranks one MoE layer's experts span
    experts_fsdp: DeviceMesh | None = None  # what FSDP shards each rank's experts over


def build_mesh(layout: Layout, device: torch.device) -> Meshes:
    if layout.ep > 1:
        return _build_ep_mesh(layout, device)
    root = init_device_mesh(
        device.type,
        (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp),
        mesh_dim_names=MESH_DIMS,
    )
    # One name for "all data-parallel ranks", whatever the replicate x shard split.
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    fsdp = root["dp_replicate", "dp_shard"] if layout.hsdp else dp
    return Meshes(root=root, pp=root["pp"], dp=dp, fsdp=fsdp, tp=root["tp"])


def _build_ep_mesh(layout: Layout, device: torch.device) -> Meshes:
    """torchtitan's expert-parallel mesh: dp_shard split into (dp_shard / ep, ep). The
    non-expert parameters are sharded over all of dp_shard, as without EP; each rank's
    experts over dp_shard / ep. Under HSDP both keep the replicate dimension outside."""
    root = init_device_mesh(
        device.type,
        (layout.pp, layout.dp_replicate, layout.dp_shard // layout.ep, layout.ep, layout.tp),
        mesh_dim_names=EP_MESH_DIMS,
    )
    dp = root["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
    if layout.hsdp:
        root["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        fsdp, experts = root["dp_replicate", "dp_shard"], root["dp_replicate", "dp_shard_mod_ep"]
    else:
        fsdp, experts = dp, root["dp_shard_mod_ep"]
    return Meshes(root=root, pp=root["pp"], dp=dp, fsdp=fsdp, tp=root["tp"], ep=root["ep"],
                  experts_fsdp=experts)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


def destroy() -> None:
    """Leave the process group and let go of what still holds its groups. A DeviceMesh
    keeps its ProcessGroups (and a gloo group its worker threads), and DTensor's sharding
    propagation caches keep every DTensorSpec they saw, each with its mesh: left alone,
    the groups outlive the run and are torn down during interpreter shutdown, where a gloo
    thread freeing Python-owned tensors once aborted a finished two-process run."""
    if dist.is_initialized():
        dist.destroy_process_group()
    clear_dtensor_caches()


def clear_dtensor_caches() -> None:
    """Empty the caches DTensor keys on meshes: the C++ fast path's sharding-propagation
    cache (through torch's own ``tensor.debug._clear_sharding_prop_cache``), the
    redistribute planners, and every ``functools`` cache in ``torch.distributed.tensor``
    (op sharding, tensor meta, transform plans, mesh topology; found, not listed, so a
    cache a new torch adds is emptied too). Caches are per thread where torch made them so;
    this is the training thread, the one that filled them. A torch without one of the two
    private clearers skips it: the groups then live until exit, as they would anyway."""
    for clear in ("clear_sharding_prop_cache", "clear_redistribute_planner_cache"):
        if torch_compat.has(clear):
            torch_compat.private(clear)()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which warns on torch's
        # deprecated aliases (torch.distributed.reduce_op)
        if (type(obj) is functools._lru_cache_wrapper
                and getattr(obj, "__module__", "").startswith("torch.distributed.tensor")):
            obj.cache_clear()


def broadcast_from_rank0(obj: object) -> object:
    """Rank 0's ``obj`` on every rank (a no-op without a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce(value: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place over all ranks, or ``group``'s (gloo has no AVG: average as a sum of
    pre-divided values)."""
    if dist.is_initialized():
        dist.all_reduce(value, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                        group=group)
    return value


def env_rank() -> int:
    """This process's rank as the launcher set it, before any process group exists."""
    return int(os.environ.get("RANK", "0"))
