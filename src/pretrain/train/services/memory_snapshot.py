"""CUDA memory snapshots (``profile.memory_snapshot``; torchtitan's
``enable_memory_snapshot``): the caching allocator's history of every allocation and free,
with its Python stack (torch's ``_record_memory_history``, at most
``profile.memory_snapshot_max_entries`` events kept), dumped with torch's ``_dump_snapshot``
after each step of ``profile.memory_snapshot_steps`` and when an allocation fails (the
allocator's out-of-memory observer), to ``<run dir>/memory/rank<r>_step<n>.pickle`` and
``rank<r>_oom.pickle``. Drag one onto pytorch.org/memory_viz. CUDA only: a CPU run with the
key is refused before it starts (trainer.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from pretrain import torch_compat
from pretrain.train.hooks import Hook, LoopContext, register

log = logging.getLogger("pretrain")


class MemorySnapshot(Hook):
    name = "memory_snapshot"

    def __init__(self, ctx: LoopContext):
        p = ctx.cfg.profile
        self.folder = Path(ctx.run_dir or ".") / "memory"
        self.steps = set(p.memory_snapshot_steps)
        self.rank = ctx.rank
        self.written: list[Path] = []
        self.record = torch_compat.private("record_memory_history")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.record(enabled="all", max_entries=p.memory_snapshot_max_entries)
        self.recording = True
        if torch_compat.has("cuda_oom_observer"):
            torch_compat.private("cuda_oom_observer")(self.on_oom)

    def dump(self, name: str) -> Path:
        path = self.folder / f"rank{self.rank}_{name}.pickle"
        torch_compat.private("dump_snapshot")(str(path))
        self.written.append(path)
        log.info("memory snapshot: %s (open it at pytorch.org/memory_viz)", path)
        return path

    def on_oom(self, device, alloc, device_alloc, device_free) -> None:
        """The allocator could not allocate ``alloc`` bytes: the history up to here."""
        if self.recording:
            log.error("out of memory on cuda:%s asking for %.2f GB (%.2f GB free): ",
                      device, alloc / 1e9, device_free / 1e9)
            self.dump("oom")

    def step_end(self, ctx: LoopContext) -> None:
        if self.recording and ctx.step in self.steps:
            self.dump(f"step{ctx.step}")

    def close(self) -> None:
        if self.recording:
            self.recording = False
            self.record(enabled=None)


@register(order=6)
def build(ctx: LoopContext) -> MemorySnapshot | None:
    """The hook when ``profile.memory_snapshot`` (a CUDA run: trainer.py refuses others)."""
    if not ctx.cfg.profile.memory_snapshot or ctx.device.type != "cuda":
        return None
    return MemorySnapshot(ctx)
