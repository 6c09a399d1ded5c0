"""optim=sgd: torch's SGD with Nesterov momentum (Sutskever et al. 2013), decay on the matrices
only. The simplest optimizer here: one momentum buffer per parameter, an elementwise step
(so it runs on DTensor shards and on the host under parallel.offload=params), and an LR far
above Adam's (no per-element normalisation). ``optim.momentum`` 0 is plain SGD (Nesterov
needs a momentum) and keeps no buffer."""

from __future__ import annotations

import math

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim.factory import decay_groups
from pretrain.optim.registry import OptimizerSpec, register

MOMENTUM = 0.9  # optim.momentum None


def momentum_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """One momentum buffer like the parameter (torch makes it once a step has run)."""
    return pb * math.prod(local)


def build_sgd(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
              also_embeddings: list[torch.nn.Parameter]) -> torch.optim.SGD:
    """torch's SGD on ``decay_groups``' two groups, Nesterov momentum ``optim.momentum``."""
    momentum = MOMENTUM if cfg.momentum is None else cfg.momentum
    decay, no_decay = decay_groups(model, also_embeddings)
    return torch.optim.SGD([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=lr, momentum=momentum, nesterov=momentum > 0,
                           weight_decay=cfg.weight_decay)


# The LR: no normalisation, so the step is lr x the (clipped) gradient. On nano (the tests'
# Markov data, batch 4 x 64, fp32, constant LR, 30 steps) lr 0.3 and 1 train (8.33 to 5.37
# and 5.44), 3 diverges (11.8). deepseek's law is AdamW's; the batch scaling is SGD's linear
# rule (Goyal et al. 2017). On a DTensor sharded on either dimension (2 processes) torch's
# step equals the whole tensor's bit for bit.
register(OptimizerSpec(
    "sgd", build_sgd, momentum_state, (1e-2, 3.0),
    reads=frozenset({"momentum", "weight_decay"}),
    lr_rules=frozenset({"fixed", "power"}), lr_scalings=frozenset({"none", "linear"}),
    why="SGD's step is lr x the gradient, not Adam's normalised one: deepseek's AdamW LR "
        "law does not apply, and its batch scaling is linear (Goyal et al. 2017)",
    elementwise=True, ramp_lr="linear"))
