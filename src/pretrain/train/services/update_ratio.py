"""The update-to-weight ratio per layer: on the logging steps whose number is a multiple of
``train.update_ratio_interval`` (0, the default: off), ||ΔW|| / ||W|| of each block
(``layers.<i>``) and of each other top-level module (``tok_emb``, ``norm``, ``lm_head``...),
where ΔW = W_after - W_before is what the optimizer step changed (lr x its update, weight
decay included) and ||.|| the Frobenius norm over every parameter of the group. Recorded as
``update_ratio/<group>``. The rule of thumb (Karpathy's CS231n notes) is about 1e-3 per
step; far above, the steps are too large for that layer's weights; far below, it barely moves.

It copies this rank's parameters before a measured step (one model's worth of memory, on
those steps only) and reads the norms in one host sync after it. Sharded parameters (FSDP,
TP: DTensors) are reduced over their shards; under pipeline parallelism rank 0 reports the
groups of its own stages."""

from __future__ import annotations

import torch

from pretrain.train.hooks import Hook, LoopContext, register


def group_of(name: str) -> str:
    """The group of parameter ``name``: ``layers.<i>`` for a block's, else its top-level
    module's; wrapper components (``_orig_mod``, ``_checkpoint_wrapped_module``) skipped."""
    parts = [p for p in name.split(".") if not p.startswith("_")]
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The squared Frobenius norm of ``t``, over every shard when it is a DTensor."""
    sq = t.float().pow(2).sum()
    return sq.full_tensor() if hasattr(sq, "full_tensor") else sq


def update_ratios(before: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
                  ) -> dict[str, float]:
    """||W_after - W_before|| / ||W_before|| per group (``group_of``), from the parameters
    ``before`` a step and the same names ``params`` after it."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, old in before.items():
        delta = squared_norm(params[name].detach() - old)
        groups.setdefault(group_of(name), []).append(torch.stack([delta, squared_norm(old)]))
    names = list(groups)
    sums = torch.stack([torch.stack(groups[g]).sum(0) for g in names]).double().tolist()
    return {g: (d / w) ** 0.5 if w > 0 else float("nan") for g, (d, w) in zip(names, sums,
                                                                               strict=True)}


def named_parameters(module) -> dict[str, torch.Tensor]:
    """This rank's parameters by name, over its model parts (pipeline stages)."""
    return {n: p for part in module.parts for n, p in part.named_parameters()}


class UpdateRatio(Hook):
    name = "update_ratio"

    def __init__(self, interval: int):
        self.interval = interval
        self.before: dict[str, torch.Tensor] | None = None

    def due(self, ctx: LoopContext, step: int) -> bool:
        return step % self.interval == 0 and ctx.logs(step)

    def before_step(self, ctx: LoopContext) -> None:
        if self.due(ctx, ctx.step + 1):
            self.before = {n: p.detach().clone()
                           for n, p in named_parameters(ctx.module).items()}

    def step_end(self, ctx: LoopContext) -> None:
        if self.before is None:
            return
        ratios = update_ratios(self.before, named_parameters(ctx.module))
        self.before = None
        if ctx.logging:
            for group, ratio in ratios.items():
                ctx.record(f"update_ratio/{group}", ratio)


@register(order=35)
def build(ctx: LoopContext) -> UpdateRatio | None:
    """The hook when ``train.update_ratio_interval`` > 0."""
    interval = ctx.cfg.train.update_ratio_interval
    return UpdateRatio(interval) if interval > 0 else None
