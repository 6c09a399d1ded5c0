"""The gradient noise scale as a run measures it (the estimator: train/noise_scale.py), a
hook on the loop's seam: before a logging step it asks the train module to measure the
first micro batch's squared gradient norm too (``TrainModule.measure_next``); after it,
folds that and the whole step's into the averages (one host sync) and records B_simple;
at the end, what it says of the batch. The loop knows nothing of it."""

from __future__ import annotations

import logging

import torch

from pretrain.train.hooks import Hook, LoopContext, register
from pretrain.train.noise_scale import SPIKE, NoiseScale, compare_batch, probe_support

log = logging.getLogger("pretrain")


class NoiseScaleProbe:
    """The noise scale as a run measures it, on logging steps only (whose host syncs and
    collectives are there anyway): the step strategy hands over the first micro batch's
    squared norm, the train module the whole step's (``record``), and the logging step
    folds them into the estimator (``update``: one host sync)."""

    def __init__(self, cfg, layout, global_batch_tokens: int,
                 microbatches: int | None = None):
        self.estimator = NoiseScale(cfg.train.noise_scale_ema)
        self.micro_batches = layout.microbatches if microbatches is None else microbatches
        self.small_seqs, self.why_not = probe_support(cfg, layout, self.micro_batches)
        self.dp, self.seq_len = layout.dp, cfg.model.seq_len
        self.big_tokens = global_batch_tokens
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def measured(self) -> bool:
        return self.small_seqs is not None

    @property
    def value(self) -> float | None:
        return self.estimator.value

    def describe(self) -> str:
        if self.small_seqs is None:
            return f"gradient noise scale: {self.why_not}"
        small = self.small_seqs * self.dp
        how = (
            "first micro batch"
            if self.micro_batches >= 2
            else "first half of the batch (one micro batch, run as two halves on logging steps)"
        )
        return (
            f"gradient noise scale (McCandlish et al. 2018): on logging steps, B_small = "
            f"each rank's {how} x dp={self.dp} = {small} sequences = "
            f"{small * self.seq_len:,} tokens, B_big = the global batch, "
            f"{self.big_tokens:,} tokens (a batch ramp: each step's); EMA {self.estimator.beta:.2f}"
        )

    def restore(self, state: dict | None) -> None:
        """A resumed run's averages, from its checkpoint (None: saved before they were)."""
        if state is not None:
            self.estimator.load_state_dict(state)

    def record(self, small_sq: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
        """A measuring step's squared norms, kept on the device: the first micro batch's
        and the whole step's raw (unclipped) one."""
        if small_sq is not None:
            self.pending = (small_sq, grad_norm.float() ** 2)

    def update(self, step: int) -> float | None:
        """On a logging step: fold the pending squared norms into the EMAs (one host sync)
        and return B_simple in tokens (None until it is defined)."""
        if self.pending is None:
            return self.estimator.value
        small_sq, big_sq = torch.stack(self.pending).double().tolist()
        self.pending = None
        spikes = self.estimator.spikes
        self.estimator.update(small_sq, big_sq, self.small_seqs * self.dp * self.seq_len,
                              self.big_tokens)
        if self.estimator.spikes > spikes:
            log.info("noise scale: step %d's squared gradient norm %.4g is over %gx its "
                     "average, a spike: left out of the averages", step, big_sq, SPIKE)
        return self.estimator.value


@register(order=30)
class NoiseScaleHook(Hook):
    """The probe on the loop's seam: the small batch armed before each logging step
    (``before_step``), its estimate on every logging step's line, what it says of the batch
    at the end (and result.json's ``noise_scale``), its averages in each checkpoint's
    meta.json under "noise_scale"."""

    name = "noise_scale"

    def __init__(self, ctx: LoopContext):
        self.probe = NoiseScaleProbe(ctx.cfg, ctx.layout, ctx.batch_tokens,
                                     ctx.fewest_microbatches)
        if self.probe.measured:
            ctx.module.probe_small_batch(self.probe.small_seqs)

    def start(self, ctx: LoopContext) -> None:
        log.info(self.probe.describe())

    def before_step(self, ctx: LoopContext) -> None:
        if self.probe.measured and ctx.logs(ctx.step + 1):  # on logging steps only
            ctx.module.measure_next()

    def step_end(self, ctx: LoopContext) -> None:
        if not ctx.logging:  # measured on logging steps only
            return
        self.probe.big_tokens = ctx.last_batch_tokens  # a batch ramp changes it
        self.probe.record(ctx.module.small_sq, ctx.module.grad_norm)
        value = self.probe.update(ctx.step)  # None: not measured, or not yet defined
        if value is not None:
            ctx.record("noise_scale", value)

    def finish(self, ctx: LoopContext) -> None:
        ctx.record("noise_scale", self.probe.value)
        if self.probe.value is not None:
            log.info(compare_batch(ctx.batch_tokens, self.probe.value))

    def state_dict(self) -> dict:
        return self.probe.estimator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.probe.restore(state)
