"""The schema of seeing inside a run (docs/debugging.md): the profiler and memory snapshots
(``profile.*``), the collective timeouts (``comm.*``) and riding out a lost node without a
restart (``ft.*``: torchft, docs/reliability.md#torchft); part of ``schema.Config``, kept
apart so schema.py stays one screenful per section."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProfileConfig:
    """torch.profiler over a window of steps (train/services/profiler.py; docs/debugging.md):
    a Chrome/Perfetto trace per profiled rank and window in ``<run dir>/profile/``, and one
    summary line per window in the log. Off by default."""

    enable: bool = False
    # torch.profiler.schedule: skip_first steps, then `repeat` cycles of wait (off), warmup
    # (recorded, thrown away) and active (kept) steps; repeat 0: cycles until the run ends.
    skip_first: int = 0
    wait: int = 1
    warmup: int = 1
    active: int = 2
    repeat: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])  # empty: every rank
    # cpu, cuda (cuda is dropped on a CPU run)
    activities: list[str] = field(default_factory=lambda: ["cpu", "cuda"])
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False
    # CUDA caching-allocator history (torch.cuda.memory._record_memory_history), dumped with
    # torch's _dump_snapshot to <run dir>/memory/rank<r>_step<n>.pickle after each step
    # listed here and on an out-of-memory error (pytorch.org/memory_viz reads it). CUDA
    # only: refused on a CPU run.
    memory_snapshot: bool = False
    memory_snapshot_steps: list[int] = field(default_factory=lambda: [2])
    memory_snapshot_max_entries: int = 100_000


@dataclass
class CommConfig:
    """Collective timeouts (train/hang.py): a rank that stops arriving ends the run within
    ``train_timeout_s`` with one line naming the collective, the step and the missing
    ranks, exit 76 (not requeued)."""

    # Start-up: process group, mesh, model materialisation, the first evaluation and step
    # (a first step can compile for minutes).
    init_timeout_s: float = 600.0
    # After the first step, every collective of the world and of the mesh's groups (a step's,
    # and a synchronous checkpoint save's: raise it if a save writes for longer; the async
    # saves' own group keeps torch's default).
    train_timeout_s: float = 300.0


@dataclass
class FaultToleranceConfig:
    """``mode=torchft`` makes this process one replica group of ``groups`` (a node each:
    shard inside it, replicate across), coordinated by a torchft Lighthouse; a lost group
    drops out at the next step while the others train on, and a returning one heals from a
    live peer. ``train.global_batch_size`` is then each group's batch: the global batch is
    that times the groups present in a step. ``none``: off."""

    mode: str = "none"  # none | torchft
    groups: int = 2  # replica groups the data of a step is split into
    lighthouse: str | None = None  # http://HOST:PORT; None: $TORCHFT_LIGHTHOUSE
    min_replicas: int = 1  # groups a step needs (1: any one survivor trains on)
    timeout_s: float = 30.0  # a collective, the commit vote, a heal's transfer
    # Times a group's quorum request is retried when the Lighthouse does not answer (torchft's
    # quorum_retries): a Lighthouse restarted at the same address within them is survived.
    quorum_retries: int = 30
