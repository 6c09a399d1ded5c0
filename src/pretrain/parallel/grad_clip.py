"""Gradient-norm clipping over a model spread across meshes and pipeline stages.

``torch.nn.utils.clip_grad_norm_`` refuses gradients that live on different device meshes,
which a TP x FSDP layout produces (2-D (dp, tp) DTensors next to 1-D ones), and it only sees
this rank's pipeline stages. So: the norm of each mesh's gradients (a DTensor reduction:
the global norm of those parameters), combined, then summed over the pipeline ranks, and
every gradient scaled by the same factor everywhere.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(params: list[torch.nn.Parameter],
                     pp_group: dist.ProcessGroup | None = None,
                     device: torch.device | None = None) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank, on
    ``device`` (the run's: offloaded gradients live on the host, and NCCL reduces only
    GPU tensors).

    ``params`` must hold each parameter of the model once over the pipeline ranks (a
    weight tied across stages on one of them only)."""
    device = device or (params[0].device if params else torch.device("cpu"))
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for group in _by_mesh(params).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        if isinstance(norm, DTensor):  # a partial result: reduced on the run's device
            norm = DTensor.from_local(norm.to_local().to(device), norm.device_mesh,
                                      norm.placements).full_tensor()
        total_sq += norm.float().to(device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    return total_sq.sqrt()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None,
                   duplicates: frozenset[int] = frozenset(),
                   device: torch.device | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before.
    ``duplicates``: ids of parameters that are copies of one held elsewhere (tied across
    pipeline stages), scaled but counted once."""
    norm = global_grad_norm([p for p in params if id(p) not in duplicates], pp_group, device)
    if max_norm > 0 and math.isfinite(max_norm):
        for group in _by_mesh(params).values():  # its foreach kernels take one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
    return norm


def _by_mesh(params: list[torch.nn.Parameter]) -> dict[object, list[torch.nn.Parameter]]:
    """Parameters with a gradient, grouped by the device mesh it lives on (None: a plain
    tensor). Expert parallelism adds a mesh beside TP's and FSDP's."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return groups
