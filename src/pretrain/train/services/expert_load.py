"""A mixture of experts' routing on the loop's seam: each logging step's line gets the MoE
layers' load (the busiest expert over the mean) and auxiliary losses
(``TrainModule.routing_stats``), and the end of the run the busiest expert's load averaged
over layers and logged windows (result.json ``expert_max_load``). A dense model reads
nothing (no collective)."""

from __future__ import annotations

import logging

from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


@register(order=20)
class ExpertLoad(Hook):
    name = "expert_load"

    def __init__(self, ctx: LoopContext):
        self.total = 0.0  # the sum over logged windows of the layers' mean busiest load
        self.windows = 0

    def step_end(self, ctx: LoopContext) -> None:
        if not ctx.logging:  # a host read and collectives: on logging steps only
            return
        routing = ctx.module.routing_stats()
        loads = [v for k, v in routing.items() if k.startswith("moe/max_load")]
        if loads:
            self.total += sum(loads) / len(loads)
            self.windows += 1
        for key, value in routing.items():
            ctx.record(key, value)

    def finish(self, ctx: LoopContext) -> None:
        if not self.windows:
            return
        ctx.record("expert_max_load", self.total / self.windows)
        log.info("expert load: the busiest expert of an MoE layer took %.2fx the mean tokens "
                 "(averaged over layers and the %d logged windows; 1 = balanced, %s "
                 "balancing)", self.total / self.windows, self.windows,
                 ctx.cfg.model.moe_balance)

    def state_dict(self) -> dict:
        """A resumed run's average covers the windows logged before it stopped too."""
        return {"total": self.total, "windows": self.windows} if self.windows else {}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.windows = float(state["total"]), int(state["windows"])
