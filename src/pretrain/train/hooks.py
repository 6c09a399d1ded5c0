"""The loop's seam: a service beside the training loop is a ``Hook`` (OLMo-core's
``Callback``, Lightning's callbacks), called at fixed points of ``Trainer.fit`` with a
``LoopContext``, the narrow view of the run a hook gets: never the trainer itself.

A new service is one module in the ``pretrain.train.services`` package whose factory is
decorated with ``@register(order)``: ``services.build_hooks`` imports every module of the
package and builds what they registered, in ``order``; the loop, services/__init__.py and
pyproject.toml's contract (which covers the package as a whole) do not change.

Every rank calls every method at the same points (a hook may run collectives in them); rank 0
alone logs and writes files (``ctx.rank0``). A hook reports what it measured with
``ctx.record(name, value)``: at ``step_end`` on a logging step (``ctx.logging``) and at
``evaluate`` the keys reach the log line, metrics.jsonl and wandb; at ``finish``,
result.json. Its ``state_dict`` is saved in each checkpoint's meta.json under the hook's
``name`` and handed back to ``load_state_dict`` on resume, so a resumed run continues as the
uninterrupted one would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config.schema import Config
from pretrain.parallel.layout import Layout
from pretrain.train.train_module import TrainModule


@dataclass
class StepTiming:
    """This rank's host clock for the current step (``time.perf_counter`` seconds), set by
    the loop: when the step began (before its batch was read), how long it waited for the
    batch, and when its forward began (after the hooks' ``before_step``)."""

    start: float = 0.0
    data_wait: float = 0.0
    ready: float = 0.0

    def fetch(self, read: Callable[[], Any], then: Callable[[], None]) -> Any:
        """A new step: ``read()`` (its batch), timed as the data wait, then ``then()`` (the
        hooks' ``before_step``); the forward begins after it."""
        self.start = time.perf_counter()
        out = read()
        self.data_wait = time.perf_counter() - self.start
        then()
        self.ready = time.perf_counter()
        return out


@dataclass(frozen=True)
class LoopContext:
    """What a hook sees of the run: read-only facts, the live step, and ``record``.

    ``module`` is the train module (model parts, optimizer, the reductions every rank
    calls together); ``step`` is the optimizer steps taken so far (1-based after a step);
    ``logs(step)`` says whether step ``step`` gets a log line; ``tokenizer`` is the
    prepared data's tokenizer.json."""

    cfg: Config
    module: TrainModule
    device: torch.device
    rank0: bool
    layout: Layout
    dp_rank: int  # which slice of each global batch (and of evaluation work) this rank has
    world_size: int
    total_steps: int
    batch_tokens: int  # tokens per optimizer step, over every rank
    tokenizer: Path
    logs: Callable[[int], bool]
    _step: Callable[[], int] = field(repr=False)
    # global samples consumed, and the run's batches (train/batches.Batches: a batch ramp
    # changes the batch from step to step; None: batch_tokens every step)
    _samples: Callable[[], int] | None = field(default=None, repr=False)
    _batches: Any = field(default=None, repr=False)
    _sink: list = field(default_factory=lambda: [None], repr=False)
    run_dir: Path | None = None  # where the run writes (traces, snapshots)
    timing: StepTiming = field(default_factory=StepTiming)
    rank: int = 0  # this process's global rank

    @property
    def step(self) -> int:
        return self._step()

    @property
    def tokens(self) -> int:
        """Tokens trained on so far."""
        if self._samples is not None:
            return self._samples() * self.cfg.model.seq_len
        return self.step * self.batch_tokens

    @property
    def last_batch_tokens(self) -> int:
        """The last step's global batch in tokens (``batch_tokens`` without a ramp)."""
        return self._batches.last_tokens if self._batches is not None else self.batch_tokens

    @property
    def fewest_microbatches(self) -> int:
        """Micro batches per DP rank of the run's smallest step (a batch ramp's first)."""
        if self._batches is None:
            return self.layout.microbatches
        return self._batches.fewest_microbatches(self.layout)

    @property
    def logging(self) -> bool:
        """Whether what is recorded now is kept: a logging step's ``step_end``, every
        ``evaluate`` and ``finish``."""
        return self._sink[0] is not None

    def record(self, name: str, value: Any) -> None:
        """``value`` under ``name`` on the log line / metrics.jsonl / wandb (``step_end``,
        ``evaluate``) or in result.json (``finish``)."""
        if self._sink[0] is None:
            raise RuntimeError(f"record({name!r}) outside a logging point: check "
                               "ctx.logging in step_end first")
        self._sink[0][name] = value

    def collecting(self, sink: dict | None) -> LoopContext:
        """(The loop's) ``record`` writes into ``sink`` until the next call (None: off)."""
        self._sink[0] = sink
        return self


class Hook:
    """A service the loop calls; every method is optional (the base does nothing)."""

    name: str = "hook"  # the key of its state in meta.json

    def __init__(self, ctx: LoopContext | None = None):
        """A registered class is built with the run's context (``register``)."""

    def start(self, ctx: LoopContext) -> None:
        """After resume, before the first step (``ctx.step`` is where the run starts)."""

    def before_step(self, ctx: LoopContext) -> None:
        """Before every optimizer step (step ``ctx.step + 1``): arm a measurement."""

    def step_end(self, ctx: LoopContext) -> None:
        """After every optimizer step; on logging steps (``ctx.logging``) ``record``
        adds to the log line."""

    def evaluate(self, ctx: LoopContext) -> None:
        """At every evaluation point (step 0 and every ``train.eval_interval``, and the
        last step), after the validation loss."""

    def finish(self, ctx: LoopContext) -> None:
        """The budget is spent: ``record`` adds to result.json."""

    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly (JSON-serialisable)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s value (a checkpoint saved before this hook existed
        gives nothing: the hook starts fresh)."""

    def close(self) -> None:
        """Give back what the hook holds (threads, files), whatever happened."""


# A factory builds its hook from the context, or None when the run does not use it.
Factory = Callable[[LoopContext], "Hook | None"]
REGISTRY: dict[str, tuple[int, Factory]] = {}


def register(order: int) -> Callable[[Factory], Factory]:
    """Register a hook factory (or a Hook subclass, called with the context) where it is
    defined; ``order`` places it among the others at every point (lower first)."""

    def add(factory: Factory) -> Factory:
        key = f"{factory.__module__}.{factory.__qualname__}"
        REGISTRY[key] = (order, factory)
        return factory

    return add


def registered() -> list[Factory]:
    """The registered factories, in their order (ties: by name, for a fixed order)."""
    return [f for _, (_, f) in sorted(REGISTRY.items(), key=lambda kv: (kv[1][0], kv[0]))]


def call_hooks(hooks: list[Hook], ctx: LoopContext, point: str, sink: dict | None) -> None:
    """Every hook's ``point``, in order; what they ``record`` goes into ``sink`` (None:
    nothing is kept at this point)."""
    if not hooks:
        return
    collecting = ctx.collecting(sink)
    try:
        for hook in hooks:
            getattr(hook, point)(collecting)
    finally:
        collecting.collecting(None)
