"""The optimizer (AdamW, LAMB, LARS or Muon with AdamW; decay on matrices only), LR scaling
with batch size, which LR rules each optimizer takes, and the LR schedule."""

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


# Which LR rules (optim.lr_rule) and batch scalings (optim.lr_scaling) keep their meaning
# with each optimizer; config_checks refuses the others, with the reason given here.
# - deepseek's LR law was fitted on AdamW runs. Muon with match_rms_adamw gives its updates
#   AdamW's RMS (Moonlight reuses AdamW's LR and decay unchanged), so the law carries over;
#   LAMB and LARS step a fraction of each weight's norm set by lr (x eta): AdamW's LR is not
#   theirs. power (your own fit, of runs with the optimizer you train with) suits all.
# - lr_scaling: sqrt is Adam's rule (Malladi et al. 2022) and LAMB's (You et al. 2020 scale
#   its LR with the square root of the batch), linear is SGD's (Goyal et al. 2017), which
#   LARS follows; AdamW and Muon (AdamW's LR) keep both, as before.
LR_RULES: dict[str, tuple[frozenset[str], frozenset[str], str]] = {
    "adamw": (frozenset({"fixed", "deepseek", "power"}), frozenset({"none", "sqrt", "linear"}),
              ""),
    "muon": (frozenset({"fixed", "deepseek", "power"}), frozenset({"none", "sqrt", "linear"}),
             ""),
    "lamb": (frozenset({"fixed", "power"}), frozenset({"none", "sqrt"}),
             "LAMB's step is lr x each tensor's norm: deepseek's AdamW LR law does not "
             "apply, and its batch scaling is sqrt (You et al. 2020)"),
    "lars": (frozenset({"fixed", "power"}), frozenset({"none", "linear"}),
             "LARS's step is lr x eta x each tensor's norm: deepseek's AdamW LR law does "
             "not apply, and its batch scaling is linear, SGD's (You et al. 2017)"),
}


# The peak LRs (optim.lr, after its rule or batch scaling) each optimizer usually trains
# with, generous on both sides; outside, the plan warns (``lr_range_warning``): one LR is
# rarely right for two optimizers (AdamW's 3e-3 moves LARS's weights 1000x too little).
# - adamw: GPT-3's 0.6e-4 (175B) to 6e-4 (125M); tiny models to 1e-2 (README's sweeps).
# - muon: AdamW's (match_rms_adamw); llama-tiny's best was 8e-3 (README).
# - lamb: You et al. 2020's 1e-3 to 1.76e-2 (BERT); llama-tiny's best was 3.2e-2 (README).
# - lars: You et al. 2017's 1 to 29 (ResNet-50, eta 1e-3); llama-tiny's best was 4 (README).
LR_RANGES: dict[str, tuple[float, float]] = {
    "adamw": (1e-5, 3e-2),
    "muon": (1e-5, 5e-2),
    "lamb": (1e-4, 1e-1),
    "lars": (1e-1, 50.0),
}


# Beyond this factor outside LR_RANGES an LR is refused (optim.allow_lr_out_of_range=true
# runs it anyway): above, the run diverges; below, it does not train.
LR_REFUSE_FACTOR = 100.0


def usual_lr(name: str) -> float:
    """The middle (geometric) of ``optim=name``'s usual range: about its preset's LR
    (AdamW 5.5e-4, Muon 7.1e-4, LAMB 3.2e-3, LARS 2.2)."""
    lo, hi = LR_RANGES[name]
    return math.sqrt(lo * hi)


def lr_range_warning(name: str, lr: float) -> str | None:
    """What the plan says when ``lr`` is outside ``optim=name``'s usual range, else None."""
    lo, hi = LR_RANGES[name]
    if lo <= lr <= hi:
        return None
    side = "below" if lr < lo else "above"
    fate = ("the run will likely diverge (non-finite losses, skipped steps, then a stop)"
            if lr > hi else "the run will barely train")
    return (f"lr {lr:.3g} is far {side} optim={name}'s usual range {lo:g} to {hi:g} "
            f"(src/pretrain/optim/factory.py LR_RANGES): {fate}. An LR meant for another "
            f"optimizer? Set optim.lr within the range (e.g. optim.lr={usual_lr(name):.2g})")


def lr_out_of_range_problem(cfg: OptimConfig) -> str | None:
    """A refusal when ``optim.lr`` is more than LR_REFUSE_FACTOR outside the usual range
    (unless ``optim.allow_lr_out_of_range``), else None."""
    lo, hi = LR_RANGES[str(cfg.name)]
    if cfg.allow_lr_out_of_range or not cfg.lr > 0 or \
            lo / LR_REFUSE_FACTOR <= cfg.lr <= hi * LR_REFUSE_FACTOR:
        return None
    side = "above" if cfg.lr > hi else "below"
    return (f"optim.lr={cfg.lr:g} is more than {LR_REFUSE_FACTOR:g}x {side} optim={cfg.name}'s "
            f"usual range {lo:g} to {hi:g}: set optim.lr within it (e.g. optim.lr="
            f"{usual_lr(str(cfg.name)):.2g}), or optim.allow_lr_out_of_range=true if you mean it")


def lr_rule_problems(cfg: OptimConfig) -> list[str]:
    """The LR rule or batch scaling ``cfg`` asks for, if ``optim.name`` does not take it."""
    rules, scalings, why = LR_RULES[cfg.name]
    out = []
    if cfg.lr_rule not in rules:
        out.append(f"optim.lr_rule={cfg.lr_rule} does not apply to optim={cfg.name} ({why}): "
                   f"use optim.lr_rule={'|'.join(sorted(rules))}")
    if cfg.lr_scaling not in scalings:
        out.append(f"optim.lr_scaling={cfg.lr_scaling} does not apply to optim={cfg.name} "
                   f"({why}): use optim.lr_scaling={'|'.join(sorted(scalings))}")
    return out


def _groups(model: torch.nn.Module, also_embeddings: Iterable[torch.nn.Parameter],
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


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float,
                    device: torch.device,
                    also_embeddings: Iterable[torch.nn.Parameter] = ()) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer. Weight decay on matrices (ndim >= 2) but not on
    embeddings, norms or biases; LAMB's and LARS's trust ratio on the same matrices only;
    Muon on the hidden matrices (``muon.muon_matrix``), AdamW on everything else.
    ``also_embeddings``: parameters to treat as embeddings though no nn.Embedding holds them
    here (an output head tied to an embedding that a pipeline put on another stage).
    Under model.parametrization=mup|completep the groups are muP's (``_mup_groups``)."""
    also_embeddings = list(also_embeddings)
    s = model_scales(model)
    if s.active and cfg.name not in ("adamw", "muon"):
        raise ValueError(f"model.parametrization={s.kind} has no rule for optim={cfg.name}: "
                         "use optim=adamw or optim=muon")
    if cfg.name == "muon":
        return _muon(model, cfg, lr, device, also_embeddings)
    if s.active:
        return torch.optim.AdamW(_mup_groups(model, cfg, lr, s), lr=lr,
                                 betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(cfg, device))
    decay, no_decay = _groups(model, also_embeddings)
    if cfg.name == "lamb":
        return Lamb([{"params": decay}, {"params": no_decay, "weight_decay": 0.0,
                                         "trust_ratio": False}],
                    lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "lars":
        return Lars([{"params": decay}, {"params": no_decay, "weight_decay": 0.0,
                                         "trust_ratio": False}],
                    lr=lr, momentum=_momentum(cfg, 0.9), weight_decay=cfg.weight_decay,
                    trust_coefficient=cfg.trust_coefficient)
    return _adamw(decay, no_decay, cfg, lr, device)


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


def _muon(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
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
    decay, no_decay = _groups(model, also_embeddings, skip=skip)
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
