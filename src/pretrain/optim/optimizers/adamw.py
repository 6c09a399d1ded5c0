"""optim=adamw: torch's AdamW (fused on CUDA), decay on the matrices only; under
model.parametrization=mup|completep muP's two groups. Its pieces (``adam_state``,
``adamw_groups``, ``mup_groups``) serve LAMB's state count and Muon's AdamW part too."""

from __future__ import annotations

import math

import torch

from pretrain.config.schema import OptimConfig
from pretrain.model.parametrization import Scales, is_hidden
from pretrain.optim.factory import decay_groups, model_scales
from pretrain.optim.registry import OptimizerSpec, register


def adam_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """torch's AdamW (and trust_ratio.Lamb, which keeps the same): two moments in the
    parameter dtype and a 4-byte step per tensor."""
    return 2 * pb * math.prod(local) + 4


def fused(cfg: OptimConfig, device: torch.device) -> bool:
    """``optim.fused``; None: fused where the device is CUDA."""
    return cfg.fused if cfg.fused is not None else device.type == "cuda"


def mup_groups(model: torch.nn.Module, cfg: OptimConfig, lr: float, s: Scales,
               skip: set[int] = frozenset()) -> list[dict]:
    """muP's/CompleteP's two AdamW groups (pretrain.model.parametrization): everything
    vector-like (embeddings, norms, biases, an untied head, routers: LR as given, no decay,
    epsilon / width), then the hidden matrices (LR and epsilon / width, decay x width,
    CompleteP's epsilon / depth too). The first group's LR is the one logged."""
    hidden, other = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in skip:
            (hidden if is_hidden(name) else other).append(p)
    return [{"params": other, "weight_decay": 0.0, "lr": lr, "eps": cfg.eps * s.other_eps},
            {"params": hidden, "weight_decay": cfg.weight_decay * s.hidden_decay,
             "lr": lr * s.hidden_lr, "eps": cfg.eps * s.hidden_eps}]


def adamw_groups(groups: list[dict], cfg: OptimConfig, lr: float,
                 device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW on ``groups`` with optim.betas, optim.eps and optim.fused."""
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=fused(cfg, device))


def decayed_adamw(decay: list, no_decay: list, cfg: OptimConfig, lr: float,
                  device: torch.device, drop_empty: bool = False) -> torch.optim.AdamW:
    """torch's AdamW on the two groups; ``drop_empty``: without an empty group (torch
    2.13's ``set_optimizer_state_dict`` gives an empty group the hyperparameters of the
    last group it read, and that group none, so a load behind Muon would break)."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if drop_empty:
        groups = [g for g in groups if g["params"]]
    return adamw_groups(groups, cfg, lr, device)


def build_adamw(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
                also_embeddings: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """torch's AdamW, decay on the matrices; under mup/completep muP's groups."""
    s = model_scales(model)
    if s.active:
        return adamw_groups(mup_groups(model, cfg, lr, s), cfg, lr, device)
    return decayed_adamw(*decay_groups(model, also_embeddings), cfg, lr, device)


# GPT-3's 0.6e-4 (175B) to 6e-4 (125M); tiny models to 1e-2 (README's sweeps).
register(OptimizerSpec("adamw", build_adamw, adam_state, (1e-5, 3e-2),
                       reads=frozenset({"betas", "eps", "fused", "weight_decay"}),
                       elementwise=True, mup=True))
