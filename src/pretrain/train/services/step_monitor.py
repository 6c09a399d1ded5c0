"""Stragglers and waits, every logging step: each rank's step time, the share of it spent
waiting for data, gathered with one small all-gather, and the slowest rank named when it is
more than ``logging.straggler_share`` above the median of the others.

A synchronous step hides a straggler in wall time: every rank leaves the step's collectives
together, so each one's step lasts as long as the slowest's. What differs is where the time
went. Each rank times, per step, its whole step (wall), and its preparation: reading the
batch (the data wait) and the hooks before the forward (``StepTiming``). The rank that
prepares longest arrives last at the step's first collective; the others wait for it about
the difference. So a rank's own step time is its wall time less that wait (the longest
preparation less its own), and the straggler is the rank whose own time is longest. Slowness
inside the forward and backward of one rank (a slow GPU) shows in the profiler's per-rank
collective times instead (tools/trace_summary.py): the others spend it waiting there.
The warning names the straggler's node too (Slurm's name for it, else the host's), gathered
once at start: on a cluster the node is what to drain or replace.

Recorded: ``step_time_s`` (the median rank's own step time), ``step_time_max_s`` and
``slowest_rank`` (only when it is a straggler), ``data_wait_share`` (the most any rank
waited for data, as a share of its step), ``data_wait_rank`` and
``tokens_per_s_per_device``.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from pretrain.train.hang import node_name
from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


def own_times(wall: list[float], prep: list[float]) -> list[float]:
    """Each rank's own step time: its wall time less what it waited for the rank that
    prepared longest (see the module's docstring)."""
    latest = max(prep)
    return [w - (latest - p) for w, p in zip(wall, prep, strict=True)]


def straggler(own: list[float], share: float) -> tuple[int, float] | None:
    """(rank, its excess over the median of the other ranks) when the slowest rank is more
    than ``share`` above it; None otherwise (and with one rank, or ``share`` 0). The
    others', not all ranks': with two ranks the median of both is half the straggler."""
    if len(own) < 2 or share <= 0:
        return None
    slow = max(range(len(own)), key=own.__getitem__)
    median = statistics.median(own[:slow] + own[slow + 1:])
    excess = own[slow] / median - 1 if median > 0 else float("inf")
    return (slow, excess) if excess > share else None


class StepMonitor(Hook):
    name = "step_monitor"

    def __init__(self, ctx: LoopContext):
        self.share = ctx.cfg.logging.straggler_share
        self.reset()
        # each rank's node, so a straggler's warning names where to look (once, at start)
        self.nodes = [node_name()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.nodes = [""] * dist.get_world_size()
            dist.all_gather_object(self.nodes, node_name())

    def reset(self) -> None:
        self.steps, self.wall, self.prep, self.data = 0, 0.0, 0.0, 0.0

    def step_end(self, ctx: LoopContext) -> None:
        t = ctx.timing
        self.steps += 1
        self.wall += time.perf_counter() - t.start
        self.prep += t.ready - t.start
        self.data += t.data_wait
        if not ctx.logging:
            return
        mine = torch.tensor([self.wall, self.prep, self.data], dtype=torch.float64) / self.steps
        self.reset()
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [torch.zeros(3, dtype=torch.float64, device=ctx.device)
                     for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine.to(ctx.device))
            wall, prep, data = torch.stack(every).T.cpu().tolist()
        else:
            wall, prep, data = ([v] for v in mine.tolist())
        own = own_times(wall, prep)
        waits = [d / w if w > 0 else 0.0 for d, w in zip(data, wall, strict=True)]
        worst = max(range(len(waits)), key=waits.__getitem__)
        ctx.record("step_time_s", statistics.median(own))
        # the run's tokens/s shared by its devices (every rank's step lasts as long)
        ctx.record("tokens_per_s_per_device", ctx.batch_tokens / max(wall) / len(wall))
        ctx.record("data_wait_share", waits[worst])
        if len(waits) > 1:
            ctx.record("data_wait_rank", worst)
        slow = straggler(own, self.share)
        if slow is not None:
            rank, excess = slow
            ctx.record("slowest_rank", rank)
            ctx.record("step_time_max_s", own[rank])
            if ctx.rank0:
                log.warning("step %d: rank %d is a straggler (on %s): %.3f s a step, %.0f%% "
                            "above the other ranks' median (logging.straggler_share %.0f%%); "
                            "its data wait %.0f%% of its step", ctx.step, rank,
                            self.nodes[rank] if rank < len(self.nodes) else "?", own[rank],
                            100 * excess, 100 * self.share, 100 * waits[rank])


@register(order=10)
def build(ctx: LoopContext) -> StepMonitor:
    """Always on: one all-gather of three numbers per logging step."""
    return StepMonitor(ctx)
