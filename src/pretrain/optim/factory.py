"""What every optimizer's builder (optim/optimizers/) starts from: the parameter groups (decay
on matrices only) and the model's parametrisation; LR scaling with batch size, and the LR
schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from pretrain.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from pretrain.model.parametrization import Scales, scales


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


def lr_multiplier_tokens(done: int, total_steps: int, batch_tokens: int, warmup: int,
                         cfg: ScheduleConfig) -> float:
    """``lr_multiplier`` with every position in tokens, for a run whose steps change length
    (batch_ramp): the multiplier of the step that ends after ``done`` tokens, in the
    schedule of the fixed-batch run of ``total_steps`` steps of ``batch_tokens`` (the full
    batch) with ``warmup`` steps. Warmup, the WSD decay start and the cosine's end stay at
    the tokens they are at in that run; at a fixed batch, ``done = (step + 1) x
    batch_tokens`` gives ``lr_multiplier(step, ...)`` (tests/test_batch_ramp.py)."""
    b = batch_tokens
    warm, total = warmup * b, total_steps * b
    if warm > 0 and done <= warm:
        return done / warm
    lo = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        start = wsd_decay_start(total_steps, cfg) * b
        if done <= start:
            return 1.0
        frac = min(1.0, (done - start) / (total - start))
        return lo + (1.0 - lo) * (1.0 - (math.sqrt(frac) if cfg.decay_shape == "1-sqrt"
                                         else frac))
    progress = min(1.0, (done - warm) / max(b, total - warm))
    if cfg.decay == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - lo) * progress


class TokenLR(LambdaLR):
    """The LR schedule of a run whose batch changes (batch_ramp): before each optimizer
    step ``place`` sets every group's LR from the tokens the step ends at and the batch
    factor (budget/batch_ramp.lr_factor); ``step`` keeps what was placed. The state is the
    LambdaLR's plus the last factor, so a resumed run reports the same LR."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: ScheduleConfig,
                 total_steps: int, batch_tokens: int, first: tuple[int, float]):
        self.cfg, self.total_steps, self.batch_tokens = cfg, total_steps, batch_tokens
        self.warmup = warmup_steps(cfg, batch_tokens)
        self.factor = self._factor(*first)
        super().__init__(optimizer, lambda _: self.factor)

    def _factor(self, done: int, batch_factor: float) -> float:
        return batch_factor * lr_multiplier_tokens(done, self.total_steps, self.batch_tokens,
                                                   self.warmup, self.cfg)

    def place(self, done: int, batch_factor: float) -> None:
        """The LRs of the step that ends after ``done`` tokens at this batch's factor."""
        self.factor = self._factor(done, batch_factor)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * self.factor
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items()
                if k not in ("cfg", "total_steps", "batch_tokens", "warmup")}
