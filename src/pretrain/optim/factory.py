"""The optimizers' builders (AdamW, LAMB, LARS, Muon with AdamW; decay on matrices only),
which ``optim/specs.py`` names, LR scaling with batch size, and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from pretrain.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from pretrain.model.parametrization import Scales, is_hidden, scales
from pretrain.optim.muon import NS_DTYPES, MuonWithAdamW, ShardedMuon, muon_matrix
from pretrain.optim.trust_ratio import Lamb, Lars


def scaled_lr(cfg: OptimConfig, global_batch_tokens: int) -> float:
    """``optim.lr`` was tuned at ``ref_batch_tokens``; adapt it to the actual global batch.
    An LR from a rule (``optim.lr_rule`` other than fixed, resolved into ``cfg.lr`` by
    pretrain.budget.hparams.apply_rules) is the LR for the run's own compute and batch already: it
    is used as it is, never rescaled a second time."""
    if cfg.lr_rule != "fixed" or cfg.lr_scaling == "none" or not cfg.ref_batch_tokens:
        return cfg.lr
    ratio = global_batch_tokens / cfg.ref_batch_tokens
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr * ratio  # linear, the last of optim.lr_scaling's values


def decay_groups(model: torch.nn.Module, also_embeddings: Iterable[torch.nn.Parameter],
            skip: set[int] = frozenset()) -> tuple[list, list]:
    """(decay, no_decay): matrices (ndim >= 2) that are not embeddings, and the rest
    (embeddings, norms, biases), in the model's parameter order, less ``skip``."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    embeddings |= {id(p) for p in also_embeddings}
    for p in model.parameters():
        if not p.requires_grad or id(p) in skip:
            continue
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    # An output head tied to the embedding is the embedding: it gets no decay either.
    decay = [p for p in decay if id(p) not in embeddings]
    return decay, no_decay


def model_scales(model: torch.nn.Module) -> Scales:
    """The parametrisation's multipliers of the GPT (or pipeline stages) in ``model``."""
    for m in model.modules():
        if isinstance(getattr(m, "cfg", None), ModelConfig):
            return scales(m.cfg)
    return Scales("sp")


def _mup_groups(model: torch.nn.Module, cfg: OptimConfig, lr: float, s: Scales,
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


def build_adamw(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
                also_embeddings: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """torch's AdamW, decay on the matrices; under mup/completep muP's groups."""
    s = model_scales(model)
    if s.active:
        return torch.optim.AdamW(_mup_groups(model, cfg, lr, s), lr=lr,
                                 betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(cfg, device))
    return _adamw(*decay_groups(model, also_embeddings), cfg, lr, device)


def build_lamb(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> Lamb:
    """LAMB: the trust ratio on the decayed matrices only, plain Adam on the rest."""
    decay, no_decay = decay_groups(model, also_embeddings)
    return Lamb([{"params": decay}, {"params": no_decay, "weight_decay": 0.0,
                                     "trust_ratio": False}],
                lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_lars(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> Lars:
    """LARS: the trust ratio on the decayed matrices only, plain momentum SGD on the rest."""
    decay, no_decay = decay_groups(model, also_embeddings)
    return Lars([{"params": decay}, {"params": no_decay, "weight_decay": 0.0,
                                     "trust_ratio": False}],
                lr=lr, momentum=_momentum(cfg, 0.9), weight_decay=cfg.weight_decay,
                trust_coefficient=cfg.trust_coefficient)


def _momentum(cfg: OptimConfig, default: float) -> float:
    return default if cfg.momentum is None else cfg.momentum


def _adamw(decay: list, no_decay: list, cfg: OptimConfig, lr: float, device: torch.device,
           drop_empty: bool = False) -> torch.optim.AdamW:
    """torch's AdamW on the two groups; ``drop_empty``: without an empty group (torch
    2.13's ``set_optimizer_state_dict`` gives an empty group the hyperparameters of the
    last group it read, and that group none, so a load behind Muon would break)."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if drop_empty:
        groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=_fused(cfg, device))


def _fused(cfg: OptimConfig, device: torch.device) -> bool:
    return cfg.fused if cfg.fused is not None else device.type == "cuda"


def build_muon(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
               also_embeddings: list[torch.nn.Parameter]) -> MuonWithAdamW:
    """Muon (torch's, orthogonalising whole matrices) on the hidden matrices with AdamW's
    LR and decay (``match_rms_adamw``); AdamW, as ``optim=adamw`` builds it, on the rest.
    Under mup/completep Muon's LR (AdamW's RMS, so AdamW's rule) is divided by the width
    ratio and its AdamW part takes muP's groups."""
    matrices = [p for n, p in model.named_parameters()
                if p.requires_grad and muon_matrix(n, p.shape)]
    s = model_scales(model)
    muon = ShardedMuon(matrices, lr=lr * s.hidden_lr if s.active else lr,
                       weight_decay=cfg.weight_decay * s.hidden_decay,
                       momentum=_momentum(cfg, 0.95), ns_steps=cfg.ns_steps,
                       adjust_lr_fn="match_rms_adamw", ns_dtype=NS_DTYPES[cfg.muon_ns_dtype])
    skip = {id(p) for p in matrices}
    if s.active:
        groups = [g for g in _mup_groups(model, cfg, lr, s, skip) if g["params"]]
        return MuonWithAdamW(muon, torch.optim.AdamW(
            groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(cfg, device)))
    decay, no_decay = decay_groups(model, also_embeddings, skip=skip)
    return MuonWithAdamW(muon, _adamw(decay, no_decay, cfg, lr, device, drop_empty=True))


def warmup_steps(cfg: ScheduleConfig, global_batch_tokens: int) -> int:
    if cfg.warmup_steps is not None and cfg.warmup_tokens is not None:
        raise ValueError("set schedule.warmup_steps or schedule.warmup_tokens, not both")
    if cfg.warmup_tokens is not None:
        return math.ceil(cfg.warmup_tokens / global_batch_tokens)
    return cfg.warmup_steps or 0


def wsd_decay_start(total: int, cfg: ScheduleConfig) -> int:
    """The first step (0-based) of WSD's decay in a run of ``total`` steps: the last
    ``decay_fraction`` of them (at least one) decay. A cooldown branch of ``total`` steps
    may start from a checkpoint saved at this step or before (checkpoint/branch.py)."""
    return total - max(1, math.ceil(cfg.decay_fraction * total))


def lr_multiplier(step: int, total: int, warmup: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based) of ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    lo = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":  # warmup, stable at peak, then a decay over the last fraction
        start = wsd_decay_start(total, cfg)
        if step < start:
            return 1.0
        done = min(1.0, (step - start + 1) / (total - start))
        return lo + (1.0 - lo) * (1.0 - (math.sqrt(done) if cfg.decay_shape == "1-sqrt"
                                         else done))
    progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
    if cfg.decay == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - lo) * progress  # linear, the last of schedule.decay's values


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int,
                    global_batch_tokens: int) -> LambdaLR:
    warmup = warmup_steps(cfg, global_batch_tokens)
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, warmup, cfg))
