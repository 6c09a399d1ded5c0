"""Data parallelism: FSDP2 ``fully_shard`` (ZeRO-2/3, HSDP) or FSDP-style ``replicate`` (DDP).

Applied per transformer block, then to the root (a whole model or one pipeline stage), so
each block's parameters are gathered just before it runs and its gradients reduced as soon
as its backward is done, overlapping communication with compute. ZeRO-3 frees the gathered
parameters after forward; ZeRO-2 keeps them until backward (``reshard_after_forward=False``:
one all-gather per step instead of two). HSDP shards within ``dp_shard`` and replicates
across ``dp_replicate`` (a 2-D dp mesh). Parameters that are already DTensors on the TP mesh
become 2-D (dp, tp) DTensors.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from pretrain.parallel.layout import Layout
from pretrain.parallel.mesh import Meshes
from pretrain.precision import Policy


def mixed_precision(policy: Policy) -> MixedPrecisionPolicy:
    """Gather parameters in the compute dtype (half the traffic under bf16) and reduce
    gradients in ``reduce_dtype``. Forward inputs are left alone: the trainer's autocast
    decides activation dtypes, exactly as on one device."""
    return MixedPrecisionPolicy(param_dtype=policy.compute_dtype,
                                reduce_dtype=policy.reduce_dtype, cast_forward_inputs=False)


def apply_data_parallel(part: nn.Module, blocks: list[nn.Module], mesh: Meshes,
                        layout: Layout, policy: Policy) -> None:
    """Wrap ``blocks`` (the transformer layers of ``part``) and then ``part`` in place."""
    mp = mixed_precision(policy)
    if layout.dp_mode == "ddp":
        for block in blocks:
            replicate(block, mesh=mesh.dp, mp_policy=mp)
        replicate(part, mesh=mesh.dp, mp_policy=mp)
        return
    dp_mesh = mesh.fsdp
    reshard = layout.dp_mode == "zero3"
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
