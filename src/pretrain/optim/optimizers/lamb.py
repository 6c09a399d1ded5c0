"""optim=lamb: LAMB (You et al. 2020; optim/trust_ratio.py's ``Lamb``), the trust ratio on the
decayed matrices only, plain Adam on the rest."""

from __future__ import annotations

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim.factory import decay_groups
from pretrain.optim.optimizers.adamw import adam_state
from pretrain.optim.registry import OptimizerSpec, register
from pretrain.optim.trust_ratio import Lamb


def build_lamb(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> Lamb:
    """LAMB: the trust ratio on the decayed matrices only, plain Adam on the rest."""
    decay, no_decay = decay_groups(model, also_embeddings)
    return Lamb([{"params": decay}, {"params": no_decay, "weight_decay": 0.0,
                                     "trust_ratio": False}],
                lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


# You et al. 2020's 1e-3 to 1.76e-2 (BERT); llama-tiny's best was 3.2e-2 (README).
# lr_scaling: sqrt is LAMB's rule (You et al. 2020).
register(OptimizerSpec(
    "lamb", build_lamb, adam_state, (1e-4, 1e-1),
    reads=frozenset({"betas", "eps", "weight_decay"}),
    lr_rules=frozenset({"fixed", "power"}), lr_scalings=frozenset({"none", "sqrt"}),
    why="LAMB's step is lr x each tensor's norm: deepseek's AdamW LR law does not "
        "apply, and its batch scaling is sqrt (You et al. 2020)"))
