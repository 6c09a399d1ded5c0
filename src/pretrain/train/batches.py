"""The run's steps as batches of samples, for the loop: the full batch every step, or a
batch ramp's (budget/batch_ramp.py holds its rules). The loop asks four things: the next
step's batch, whether the budget is spent (the fixed-batch run's samples), what the
prefetcher reads, and (``noise_scale``) what a logging step's noise scale changes; the
ramp's state travels in the trainer's checkpoint state as one JSON string."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from pretrain.budget.batch_ramp import BatchRamp, RampSpec, planned_steps

log = logging.getLogger("pretrain")


class Batches:
    """Sizes in sequences; ``samples`` are global samples consumed before a step."""

    @classmethod
    def of(cls, run) -> Batches:
        """A resolved run's (decision/resolve.Resolved): its ramp, batch and budget."""
        return cls(run.ramp, run.cfg.train.global_batch_size, run.budget.steps,
                   run.cfg.model.seq_len)

    def __init__(self, spec: RampSpec | None, full: int, fixed_steps: int, seq_len: int):
        self.ramp = BatchRamp(spec) if spec is not None else None
        self.full, self.fixed_steps, self.seq_len = full, fixed_steps, seq_len
        self.total_samples = fixed_steps * full
        # the steps the run takes (a noise_scale ramp's are not known before it runs: the
        # fixed batch's, for the progress bar)
        self.total_steps = planned_steps(spec) if spec is not None else fixed_steps
        self.last = full  # the last step's batch

    @property
    def sizes(self) -> Callable[[int], int] | None:
        """A ramp's batch of the step after a number of samples (a mixture's batches);
        None without one."""
        return self.next if self.ramp is not None else None

    @property
    def last_tokens(self) -> int:
        return self.last * self.seq_len

    def took(self, batch: int) -> None:
        """A step of ``batch`` sequences was taken (``last_tokens`` is then its tokens)."""
        self.last = batch

    def next(self, samples: int) -> int:
        """Global sequences of the step after ``samples`` samples."""
        return self.full if self.ramp is None else self.ramp.batch(samples)

    def finished(self, step: int, samples: int) -> bool:
        """The budget is spent: the fixed-batch run's samples (its steps, without a ramp)."""
        if self.ramp is None:
            return step >= self.fixed_steps
        return samples >= self.total_samples

    def is_last(self, step: int, taken: int, samples: int) -> bool:
        """Whether optimizer step ``step`` ends the run, ``taken`` steps and ``samples``
        samples in (``step`` is the one just taken, or the next)."""
        if self.ramp is None:
            return step == self.fixed_steps
        if step == taken:
            return samples >= self.total_samples
        return step == taken + 1 and samples + self.next(samples) >= self.total_samples

    def plan(self, dp: int, dp_rank: int
                      ) -> Callable[[int], tuple[int, int, int]] | None:
        """The prefetcher's plan under a ramp (data/prefetch.py): the step after ``key``
        samples -> (this rank's first sample, its count, the next step's key); None: the
        prefetcher's own fixed stride."""
        if self.ramp is None:
            return None

        def plan(key: int) -> tuple[int, int, int]:
            batch = self.ramp.batch(key)
            n = batch // dp
            return key + dp_rank * n, n, key + batch

        return plan

    def key(self, samples: int, dp_rank: int, local: int) -> int:
        """The prefetcher's key of the next step: its first global sample under a ramp,
        this rank's first sample otherwise."""
        return samples if self.ramp is not None else samples + dp_rank * local

    def fewest_microbatches(self, layout) -> int:
        """Micro batches per DP rank of the smallest step (a ramp's first)."""
        if self.ramp is None:
            return layout.microbatches
        return self.ramp.spec.start // (layout.micro_batch_size * layout.dp)

    def observe(self, step: int, samples: int, noise_tokens: float | None) -> None:
        """A logging step's smoothed noise scale (batch_ramp=noise_scale): the next steps'
        batch, said when it changes."""
        if self.ramp is None:
            return
        before = self.ramp.current
        if self.ramp.observe(step, samples, noise_tokens):
            log.info("step %d: noise scale %.4g tokens >= %gx the batch: batch %s -> %s tokens "
                     "from the next step", step, noise_tokens, self.ramp.spec.factor,
                     f"{before * self.seq_len:,}", f"{self.ramp.current * self.seq_len:,}")

    def line(self) -> dict:
        """The log line's entry: the last step's batch in tokens (under a ramp)."""
        return {"batch_tokens": self.last * self.seq_len} if self.ramp is not None else {}

    def result(self) -> dict:
        """result.json's entry: the ramp's state at the end (its changes)."""
        return {"batch_ramp": self.ramp.state_dict()} if self.ramp is not None else {}

    def state_dict(self) -> dict:
        return {"batch_ramp": json.dumps(self.ramp.state_dict())} if self.ramp else {}

    def load_state_dict(self, state: dict) -> None:
        if self.ramp is not None and state.get("batch_ramp"):
            self.ramp.load_state_dict(json.loads(state["batch_ramp"]))
