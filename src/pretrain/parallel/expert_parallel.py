"""Expert parallelism: each MoE layer's experts split over the ``ep`` ranks, tokens sent to
the rank of their expert and back by all-to-all (torchtitan's ``ExpertParallel``).

The model's ``GroupedExperts`` takes rows sorted by expert and the count per expert
(moe.py). Applied here, its weights become DTensors sharded along the experts (dim 0) over
the ``ep`` mesh, so a checkpoint keeps the whole (experts x out x in) tensors and resumes on
any EP degree, and its forward is wrapped with:

- dispatch: the per-expert counts are exchanged (all-to-all), then the rows (all-to-all
  with autograd, whose backward is the reverse exchange); what arrives is ordered by source
  rank then expert, and is regrouped by local expert for the grouped GEMMs;
- combine: the inverse regrouping and the reverse all-to-all, so the layer gets its own
  rows back in the order it sent them.

The split sizes are read on the host (one device sync per MoE layer and micro batch, as in
torchtitan and Megatron-LM's dropless all-to-all dispatcher). The routing, the load
statistics and the auxiliary losses stay on each rank's own tokens, before dispatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from pretrain import torch_compat
from pretrain.model.moe import GroupedExperts


def _all_to_all(x: torch.Tensor, output_split: list[int], input_split: list[int],
                group) -> torch.Tensor:
    """torch's functional all-to-all with autograd (its backward, the reverse exchange),
    waited on."""
    out = torch_compat.private("all_to_all_single_autograd")(x, output_split, input_split,
                                                              group)
    if isinstance(out, torch_compat.private("AsyncCollectiveTensor")):
        out = torch_compat.private("wait_tensor")(out)
    return out


def _is_fake(t: torch.Tensor) -> bool:
    return torch_compat.has("FakeTensor") and isinstance(t, torch_compat.private("FakeTensor"))


class _Exchange:
    """What one forward's dispatch sent where, for its combine (a module is called once at
    a time: its combine follows its dispatch before the next forward starts)."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.received: list[int] = []
        self.order: torch.Tensor | None = None


def _dispatch(mod: nn.Module, inputs: tuple, mesh: DeviceMesh):
    x, counts = inputs
    group, ep = mesh.get_group(), mesh.size()
    counts = counts.to(torch.int64)
    if _is_fake(counts):
        return _dispatch_balanced(mod, x, counts, mesh)
    # received[s, e]: rows source rank s sends for this rank's local expert e
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)
    ex: _Exchange = mod._ep_exchange
    ex.sent = counts.view(ep, -1).sum(1).tolist()
    ex.received = received.sum(1).tolist()
    rows = _all_to_all(x, ex.received, ex.sent, group)
    local_experts = received.shape[1]
    expert_of_row = torch.arange(local_experts, device=x.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1))
    ex.order = expert_of_row.argsort(stable=True)  # by local expert, then source rank
    return rows[ex.order], received.sum(0)


def _dispatch_balanced(mod: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                       mesh: DeviceMesh):
    """``tools/plan.py --simulate`` (fake tensors: shapes, no values): every rank sends
    and receives an equal share of the rows, the balanced load the planner assumes."""
    ep, rows = mesh.size(), x.shape[0]
    ex: _Exchange = mod._ep_exchange
    ex.sent = ex.received = [rows // ep + (r < rows % ep) for r in range(ep)]
    out = _all_to_all(x, ex.received, ex.sent, mesh.get_group())
    ex.order = torch.arange(rows, device=x.device)
    return out, counts.view(ep, -1).sum(0)


def _combine(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    ex: _Exchange = mod._ep_exchange
    back = torch.empty_like(out).index_copy(0, ex.order, out)  # source-rank order again
    return _all_to_all(back, ex.sent, ex.received, mesh.get_group())


def _shard_experts(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
    if not isinstance(mod, GroupedExperts):
        return
    for key, param in list(mod.named_parameters(recurse=False)):
        mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def apply_expert_parallel(part: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts in ``part`` (a model or pipeline stage, on the meta
    device) over ``ep_mesh``, with token dispatch and combine around them."""
    for module in part.modules():
        if isinstance(module, GroupedExperts):
            module._ep_exchange = _Exchange()
            distribute_module(module, ep_mesh, partition_fn=_shard_experts,
                              input_fn=_dispatch, output_fn=_combine)
