"""The spike guard's window across a resume (optim/spike_guard.py decides on the device which
steps are spikes; the train module holds it): a ``Hook`` whose state, the accepted steps'
recent losses and gradient norms and the skip count, is saved in each checkpoint's meta.json
under ``spike_guard`` and handed back on resume, so a resumed run skips exactly the steps the
uninterrupted one would. A checkpoint without it (or with the guard off) starts the window
empty."""

from __future__ import annotations

from pretrain.train.hooks import Hook, LoopContext, register


@register(order=50)
class SpikeWindow(Hook):
    name = "spike_guard"

    def __init__(self, ctx: LoopContext):
        self.module = ctx.module

    def state_dict(self) -> dict:
        return self.module.guard_state() or {}

    def load_state_dict(self, state: dict) -> None:
        self.module.restore_guard(state or None)
