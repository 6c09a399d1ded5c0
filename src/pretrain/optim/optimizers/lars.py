"""optim=lars: LARS (You et al. 2017; optim/trust_ratio.py's ``Lars``), the trust ratio on the
decayed matrices only, plain momentum SGD on the rest."""

from __future__ import annotations

import math

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim.factory import decay_groups
from pretrain.optim.registry import OptimizerSpec, register
from pretrain.optim.trust_ratio import Lars


def momentum_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """LARS: one momentum buffer, no step counter."""
    return pb * math.prod(local)


def build_lars(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> Lars:
    """LARS: the trust ratio on the decayed matrices only, plain momentum SGD on the rest
    (optim.momentum; None: 0.9)."""
    decay, no_decay = decay_groups(model, also_embeddings)
    return Lars([{"params": decay}, {"params": no_decay, "weight_decay": 0.0,
                                     "trust_ratio": False}],
                lr=lr, momentum=0.9 if cfg.momentum is None else cfg.momentum,
                weight_decay=cfg.weight_decay, trust_coefficient=cfg.trust_coefficient)


# You et al. 2017's 1 to 29 (ResNet-50, eta 1e-3); llama-tiny's best was 4 (README).
# lr_scaling: linear is SGD's (Goyal et al. 2017), which LARS follows.
register(OptimizerSpec(
    "lars", build_lars, momentum_state, (1e-1, 50.0),
    reads=frozenset({"momentum", "trust_coefficient", "weight_decay"}),
    lr_rules=frozenset({"fixed", "power"}), lr_scalings=frozenset({"none", "linear"}),
    why="LARS's step is lr x eta x each tensor's norm: deepseek's AdamW LR law "
        "does not apply, and its batch scaling is linear, SGD's (You et al. 2017)",
    ramp_lr="linear"))
