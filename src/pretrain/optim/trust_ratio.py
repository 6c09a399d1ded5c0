"""LAMB and LARS: layer-wise trust ratios for large batches.

torch has neither, so here they are as two small ``torch.optim.Optimizer`` subclasses.
Both scale each tensor's update by a trust ratio ``||w|| / ||update||`` (LARS times its
coefficient eta), so every tensor moves by a set fraction of its own norm however large
the batch makes the gradient's: LAMB (You et al. 2020) on Adam's update, LARS (You et al.
2017) on the decayed gradient with heavy-ball momentum.

The ratio must use the norms of the WHOLE tensors. Under FSDP2 and tensor parallelism a
parameter is a DTensor holding one shard: ``torch.linalg.vector_norm`` of a DTensor is a
DTensor (a partial norm) and ``full_tensor()`` reduces it over the mesh, so every rank
gets the whole tensor's norm; elementwise arithmetic on DTensors works shard by shard,
and the state (moments, momentum) is made ``zeros_like`` the parameter, so it is sharded
like it and torch.distributed.checkpoint saves and reshards it. On one process the same
code runs on plain tensors. A pipeline stage's optimizer sees its stage's tensors only:
per-tensor rules need nothing more.

A parameter group with ``trust_ratio: False`` (biases, norms, embeddings: the groups
``optim.build_optimizer`` makes, like AdamW's no-decay group) gets a plain Adam (LAMB) or
momentum SGD (LARS) step, without a ratio and without decay.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the whole tensor, a plain 0-dim tensor on every rank."""
    n = torch.linalg.vector_norm(t)
    return n.full_tensor() if isinstance(n, DTensor) else n


def trust_ratio(w: torch.Tensor, update: torch.Tensor, coefficient: float = 1.0
                ) -> torch.Tensor:
    """``coefficient * ||w|| / ||update||``, 1 where either norm is 0 (a tensor at zero,
    or nothing to do), as in both papers' reference code."""
    w_norm, u_norm = full_norm(w), full_norm(update)
    ratio = coefficient * w_norm / u_norm.clamp(min=torch.finfo(u_norm.dtype).tiny)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


class _PerTensor(torch.optim.Optimizer):
    """An optimizer whose step is one rule applied to each tensor with a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError


class Lamb(_PerTensor):
    """LAMB: AdamW's update (bias-corrected moments, decoupled decay) times the trust ratio
    ``||w|| / ||update||`` of each tensor (You et al. 2020, Algorithm 2)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust_ratio: bool = True):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "trust_ratio": trust_ratio})

    def _update(self, p: torch.Tensor, group: dict) -> None:
        (beta1, beta2), state = group["betas"], self.state[p]
        if not state:  # as AdamW keeps them: a float32 step counter, moments like p
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = state["step"].item()
        update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + group["eps"])
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        if group["trust_ratio"]:
            update.mul_(trust_ratio(p, update))
        p.add_(update, alpha=-group["lr"])


class Lars(_PerTensor):
    """LARS: SGD with momentum on ``g + wd w`` scaled by the local LR
    ``eta ||w|| / ||g + wd w||`` of each tensor (You et al. 2017; the form of NVIDIA's
    LARC and timm's Lars: the ratio multiplies the gradient before the momentum)."""

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 trust_ratio: bool = True):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "trust_coefficient": trust_coefficient,
                                  "trust_ratio": trust_ratio})

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
        if group["trust_ratio"]:
            g = g * trust_ratio(p, g, group["trust_coefficient"])
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(g)
        p.add_(buf, alpha=-group["lr"])
