"""Python's garbage collector, run at fixed steps instead of whenever it decides.

An automatic collection pauses one rank for milliseconds to a second at a moment of its own
choosing; at scale the other ranks wait for it in the next collective, so every rank runs
as slowly as the unluckiest one. As torchtitan does (``GarbageCollection``): automatic GC
off during training, a generation-1 collection every ``train.gc_interval`` steps on every
rank at once, and the previous setting restored at the end. 0 leaves Python's automatic
GC alone.
"""

from __future__ import annotations

import gc
import logging
import time

from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


class GarbageCollection:
    def __init__(self, interval: int):
        self.interval = interval
        self.was_enabled = gc.isenabled()
        if interval > 0:
            gc.disable()
            gc.collect(1)

    def step(self, step: int) -> None:
        if self.interval > 0 and step % self.interval == 0:
            t0 = time.perf_counter()
            gc.collect(1)
            log.debug("gc.collect(1) at step %d: %.3f s", step, time.perf_counter() - t0)

    def close(self) -> None:
        if self.interval > 0 and self.was_enabled:
            gc.enable()


@register(order=40)
class GarbageCollectionHook(Hook):
    """``GarbageCollection`` on the loop's seam: off from the start of training, collected
    after every ``interval``-th step, given back at the end."""

    name = "garbage_collection"

    def __init__(self, ctx: LoopContext):
        self.interval = ctx.cfg.train.gc_interval
        self.collector: GarbageCollection | None = None

    def start(self, ctx: LoopContext) -> None:
        self.collector = GarbageCollection(self.interval)

    def step_end(self, ctx: LoopContext) -> None:
        self.collector.step(ctx.step)

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
            self.collector = None
