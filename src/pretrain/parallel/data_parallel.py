"""Data parallelism: FSDP2 ``fully_shard`` (ZeRO-2/3, HSDP) or FSDP-style ``replicate`` (DDP).

Applied per transformer block, then to the root (a whole model or one pipeline stage), so
each block's parameters are gathered just before it runs and its gradients reduced as soon
as its backward is done, overlapping communication with compute. ZeRO-3 frees the gathered
parameters after forward; ZeRO-2 keeps them until backward (``reshard_after_forward=False``:
one all-gather per step instead of two). HSDP shards within ``dp_shard`` and replicates
across ``dp_replicate`` (a 2-D dp mesh). Parameters that are already DTensors on the TP mesh
become 2-D (dp, tp) DTensors. Under mixed precision the wrapper goes on at dp = 1 too in a
multi-process layout (``needs_wrapper``): FSDP2's ``MixedPrecisionPolicy`` casts the parameters
there; one process alone autocasts instead (``autocasts``).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from pretrain import torch_compat
from pretrain.model.moe import GroupedExperts
from pretrain.parallel.layout import Layout
from pretrain.parallel.mesh import Meshes
from pretrain.precision.policy import Policy


def needs_wrapper(layout: Layout, mixed: bool) -> bool:
    """Whether a data-parallel wrapper goes on: with more than one DP rank, with offload
    (FSDP2's own), and under mixed precision in a multi-process layout (a DP group of one
    then, e.g. tp=2 x dp=1: its all-gather is the cast of the parameters to the compute
    dtype, its reduce-scatter the cast of the gradients back). One process alone takes no
    wrapper: it autocasts (``autocasts``), as nanoGPT and torchtitan's single-device path
    do, so a step is its forwards, backwards, clip and optimizer step and nothing else (the
    wrapper at dp = 1 copied and cast every weight and gradient per micro batch: the
    measured H100 step spent 17% of its GPU time in those copies). ``mixed``:
    ``Policy.mixed`` (compute dtype below the parameter dtype); the planner
    (planning/memory.py) asks the same question of a config."""
    return layout.dp > 1 or layout.offload != "none" or (mixed and layout.world_size > 1)


def autocasts(layout: Layout, mixed: bool) -> bool:
    """Whether the run computes under ``torch.autocast``: mixed precision with no wrapper
    to cast the parameters (one process). The parameters stay in their (fp32) dtype, the
    matmuls run in the compute dtype, the residual stream and norms in fp32 (torch's
    autocast lists). The planner counts activations by the same answer."""
    return mixed and layout.one_device


def shard_dim(shape: tuple[int, ...], dp_shard: int) -> int:
    """The dimension FSDP2 shards a parameter along: dim 0, except a mixture of experts'
    3-D (experts x out x in) tensor whose expert count the shard ranks do not divide
    (Mixtral's 8 experts over 64 ranks): dim 1 then, as torchtitan shards experts, so no
    rank holds a padded whole expert. The planner (planning/params.py) counts by it."""
    if len(shape) == 3 and shape[0] % dp_shard:
        return 1
    return 0


def mixed_precision(policy: Policy) -> MixedPrecisionPolicy:
    """Gather parameters in the compute dtype (half the traffic under bf16) and reduce
    gradients in ``reduce_dtype``. Forward inputs are token ids, left alone; activations
    then follow the bf16 weights (the embedding's output, so the residual stream, is in the
    compute dtype), and norms upcast inside themselves (model.py)."""
    return MixedPrecisionPolicy(param_dtype=policy.compute_dtype,
                                reduce_dtype=policy.reduce_dtype, cast_forward_inputs=False)


def apply_data_parallel(part: nn.Module, blocks: list[nn.Module], mesh: Meshes,
                        layout: Layout, policy: Policy) -> None:
    """Wrap ``blocks`` (the transformer layers of ``part``) and then ``part`` in place."""
    mp = mixed_precision(policy)
    # FSDP2's own offload; pinned host memory only where there is a GPU to copy to
    offload = (CPUOffloadPolicy(pin_memory=mesh.fsdp.device_type == "cuda")
               if layout.offload == "params" else OffloadPolicy())
    if not layout.dp_spec.shards:
        replicate = torch_compat.private("replicate")
        for block in blocks:
            replicate(block, mesh=mesh.dp, mp_policy=mp)
        replicate(part, mesh=mesh.dp, mp_policy=mp)
        return
    dp_mesh = mesh.fsdp
    reshard = layout.dp_spec.reshard_after_forward

    def placement(param: nn.Parameter) -> Shard:
        return Shard(shard_dim(tuple(param.shape), layout.dp_shard))

    if mesh.experts_fsdp is not None:  # expert parallelism: experts first, on their own mesh
        for experts in (m for b in blocks for m in b.modules() if isinstance(m, GroupedExperts)):
            # Sharded along dim 1 (dim 0 is EP's); each rank's expert gradients already sum
            # the tokens of its EP peers, so they are divided by every DP rank, not only by
            # the dp_shard / ep ranks this reduce-scatter spans (torchtitan does the same).
            fully_shard(experts, mesh=mesh.experts_fsdp, reshard_after_forward=reshard,
                        mp_policy=mp, offload_policy=offload,
                        shard_placement_fn=lambda p: Shard(1))
            experts.set_gradient_divide_factor(float(layout.dp))
            # gloo has no PREMUL_SUM: sum, then divide. Not on a one-rank group, where
            # torch 2.13 divides the copied gradient by the factor and then again.
            shards = mesh.experts_fsdp.size(mesh.experts_fsdp.ndim - 1)  # HSDP: (rep, shard)
            if mesh.experts_fsdp.device_type != "cuda" and shards > 1:
                experts.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=offload, shard_placement_fn=placement)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                offload_policy=offload)
