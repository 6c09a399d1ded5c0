"""torch.profiler over a window of steps (``profile.*``; torchtitan's ``profiling.*``,
OLMo-core's ProfilerCallback): on the ranks of ``profile.ranks`` (empty: every rank), the
schedule ``skip_first`` / ``wait`` / ``warmup`` / ``active`` x ``repeat`` over optimizer
steps; each finished window's Chrome/Perfetto trace is written to
``<run dir>/profile/rank<r>_step<n>.json`` (open it at ui.perfetto.dev or chrome://tracing)
and summarised in one log line (hardware/profiler_trace.py: top ops by self time; compute,
communication and idle shares). ``tools/trace_summary.py`` reads the folder, every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from pretrain.hardware.profiler_trace import read_trace, summarize
from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


def activities(names: list[str], device: torch.device) -> list[ProfilerActivity]:
    """The profiler activities asked for that this device has (cuda only on a GPU run)."""
    out = []
    if "cpu" in names:
        out.append(ProfilerActivity.CPU)
    if "cuda" in names and device.type == "cuda":
        out.append(ProfilerActivity.CUDA)
    return out


class Profiler(Hook):
    name = "profiler"

    def __init__(self, ctx: LoopContext):
        self.folder = Path(ctx.run_dir or ".") / "profile"
        self.rank = ctx.rank
        self.ctx = ctx
        self.written: list[Path] = []
        self.prof: torch.profiler.profile | None = None
        self.running = False

    def start(self, ctx: LoopContext) -> None:
        """The schedule counts from this attempt's first step (a resumed run's too), and
        the trace's ``ProfilerStep#N`` are optimizer steps: N is the step it records."""
        p = ctx.cfg.profile
        first = ctx.step + 1
        window = torch.profiler.schedule(skip_first=p.skip_first, wait=p.wait,
                                         warmup=p.warmup, active=p.active, repeat=p.repeat)
        self.prof = torch.profiler.profile(
            activities=activities(list(p.activities), ctx.device),
            schedule=lambda n: window(max(n - first, 0)), on_trace_ready=self.ready,
            record_shapes=p.record_shapes, with_stack=p.with_stack,
            profile_memory=p.profile_memory)
        self.prof.step_num, self.prof.current_action = first, window(0)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof.start()
        self.running = True

    def step_end(self, ctx: LoopContext) -> None:
        if self.running:
            self.prof.step()

    def ready(self, prof: torch.profiler.profile) -> None:
        """A window ended: its trace on disk, its line in the log."""
        path = self.folder / f"rank{self.rank}_step{self.ctx.step}.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)
        log.info("%s (trace: %s)", summarize(read_trace(path), self.rank).line(), path)

    def close(self) -> None:
        if self.running:
            self.running = False
            self.prof.stop()


@register(order=5)
def build(ctx: LoopContext) -> Profiler | None:
    """The hook when ``profile.enable`` and this rank is among ``profile.ranks``."""
    p = ctx.cfg.profile
    if not p.enable or (p.ranks and ctx.rank not in p.ranks):
        return None
    return Profiler(ctx)
