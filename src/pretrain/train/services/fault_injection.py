"""Faults on purpose, for the tests of hang and straggler detection (never set it in a real
run): ``PRETRAIN_FAULT`` is ``stall:rank=R:step=S`` (rank R stops before the forward of step
S, as a hung rank does, until it is killed; SIGTERM ends it at once) or
``slow:rank=R:seconds=X`` (rank R sleeps X s before every forward, a straggler).
``PRETRAIN_FAULT_MARK``: a file the stalling rank writes its wall-clock time to.
``PRETRAIN_FAULT_UNTIL``: a file that ends a slow rank's sleeps once it exists: a test slows
a run only until its fault is in (a node killed, a signal received), so the run's margin for
the fault can be wide and the steps after it cost nothing extra."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")
FAULT = "PRETRAIN_FAULT"


def parse(spec: str) -> tuple[str, dict[str, float]]:
    kind, *fields = spec.split(":")
    values = dict(f.split("=", 1) for f in fields)
    if kind not in ("stall", "slow"):
        raise ValueError(f"{FAULT}={spec!r}: the kinds are stall and slow")
    return kind, {k: float(v) for k, v in values.items()}


class Fault(Hook):
    name = "fault_injection"

    def __init__(self, kind: str, values: dict[str, float]):
        self.kind, self.values = kind, values

    def before_step(self, ctx: LoopContext) -> None:
        if self.kind == "slow":
            until = os.environ.get(f"{FAULT}_UNTIL")
            if not (until and os.path.exists(until)):
                time.sleep(self.values.get("seconds", 0.2))
        elif ctx.step + 1 == int(self.values.get("step", 2)):
            log.warning("%s: rank %d stalls at step %d", FAULT, ctx.rank, ctx.step + 1)
            signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
            if mark := os.environ.get(f"{FAULT}_MARK"):  # when it stalled, for the test
                Path(mark).write_text(repr(time.time()))
            time.sleep(self.values.get("seconds", 3600))


@register(order=8)
def build(ctx: LoopContext) -> Fault | None:
    spec = os.environ.get(FAULT)
    if not spec:
        return None
    kind, values = parse(spec)
    return Fault(kind, values) if int(values.get("rank", 0)) == ctx.rank else None
