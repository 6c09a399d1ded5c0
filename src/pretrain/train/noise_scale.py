"""The gradient noise scale, measured while training (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", appendix A.1).

For a batch of B samples the expected squared norm of the mean gradient is
E|G_B|^2 = |G|^2 + tr(Sigma) / B (G the true gradient, Sigma the per-sample covariance).
Two batch sizes B_small < B_big of the same step give unbiased estimates of both terms:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

and the simple noise scale B_simple = tr(Sigma) / |G|^2 is the ratio of their exponential
moving averages (each single-step estimate is noisy, the |G|^2 one can be negative). With B
in tokens, B_simple is in tokens. The trainer supplies the two squared norms: the whole
step's raw gradient (before clipping, after fp16 unscaling) for B_big, and the first micro
batch's, over every data-parallel rank, for B_small (services/noise_probe.py: when and how a
run measures them, as a hook on the loop's seam).
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("pretrain")


def estimates(small_sq: float, big_sq: float, b_small: float, b_big: float
              ) -> tuple[float, float]:
    """Unbiased single-step estimates (|G|^2, tr(Sigma)) from the squared norms of the mean
    gradients over b_small and b_big samples (or tokens)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < B_small < B_big, got {b_small}, {b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


# A step whose squared gradient norm is this many times its running average is a loss
# spike: one such step outweighs every other in the averages for dozens of measurements
# (measured on the tiny model: a step at 1000x the usual |G_big|^2 made the tr(Sigma)
# average negative for 40 logging steps). Spikes are left out of the averages, and counted.
SPIKE = 10.0


class NoiseScale:
    """Exponential moving averages of the two estimates, and their ratio B_simple. The
    ratio of two EMAs started at zero needs no bias correction (the same factor divides
    both). Steps whose |G_big|^2 is SPIKE times its (bias-corrected) average are skipped."""

    def __init__(self, beta: float = 0.9):
        self.beta = beta
        self.grad_sq = 0.0
        self.trace = 0.0
        self.big_sq = 0.0  # EMA of |G_big|^2, for the spike test
        self.updates = 0
        self.spikes = 0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> bool:
        """Fold in one step's norms; False (and nothing changed) if they are not finite (an
        fp16 overflow, a skipped step) or the step is a spike (counted in ``spikes``)."""
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return False
        if self.updates and big_sq > SPIKE * self.big_sq / (1 - self.beta ** self.updates):
            self.spikes += 1
            return False
        g, t = estimates(small_sq, big_sq, b_small, b_big)
        self.grad_sq = self.beta * self.grad_sq + (1 - self.beta) * g
        self.trace = self.beta * self.trace + (1 - self.beta) * t
        self.big_sq = self.beta * self.big_sq + (1 - self.beta) * big_sq
        self.updates += 1
        return True

    @property
    def value(self) -> float | None:
        """B_simple in the units of B (tokens); None until the |G|^2 average is positive."""
        if self.updates == 0 or self.grad_sq <= 0 or self.trace <= 0:
            return None
        return self.trace / self.grad_sq

    def state_dict(self) -> dict:
        return {"grad_sq": self.grad_sq, "trace": self.trace, "big_sq": self.big_sq,
                "updates": self.updates, "spikes": self.spikes}

    def load_state_dict(self, state: dict) -> None:
        """Continue a resumed run's averages where they stopped (the checkpoint's meta.json
        holds them), so its estimate is the uninterrupted run's."""
        self.grad_sq, self.trace = float(state["grad_sq"]), float(state["trace"])
        self.big_sq = float(state["big_sq"])
        self.updates, self.spikes = int(state["updates"]), int(state["spikes"])


def compare_batch(batch_tokens: int, noise_tokens: float) -> str:
    """How the global batch compares with the noise scale, in McCandlish et al.'s trade-off
    (eq. 2.11, with B_crit ~ B_simple): tokens E/E_min = 1 + B/B_noise and steps
    S/S_min = 1 + B_noise/B."""
    tokens_x, steps_x = 1 + batch_tokens / noise_tokens, 1 + noise_tokens / batch_tokens
    if batch_tokens < noise_tokens / 3:
        verdict = ("a larger batch would train at nearly the same token efficiency in "
                   "fewer steps")
    elif batch_tokens > 3 * noise_tokens:
        verdict = "a smaller batch would reach the same loss with fewer tokens"
    else:
        verdict = "the batch is near the noise scale, the knee of the steps/tokens trade-off"
    return (f"batch {batch_tokens:,} tokens vs noise scale {noise_tokens:,.0f} tokens: about "
            f"{tokens_x:.2f}x the minimum tokens and {steps_x:.2f}x the minimum steps for a "
            f"given loss (McCandlish et al. 2018, B_crit ~ B_simple): {verdict}")


def probe_support(cfg, layout, microbatches: int | None = None
                  ) -> tuple[int | None, str | None]:
    """(sequences per DP rank in the small batch, None), or (None, why not measured).

    B_big is the global batch; B_small is the first micro batch over every DP rank,
    dp x micro_batch_size sequences, whose gradient the layout holds after that micro
    batch's backward: one process and ZeRO-3 (reduce-scattered every micro batch)
    as they run; DDP and ZeRO-2 (which defer the reduction to the last micro batch)
    reduce the first micro batch's gradients at once on measuring steps, one more
    gradient reduction then. A step of one micro batch per rank runs it as two halves
    on measuring steps (same samples, same update), B_small = dp x half of it. A rank's
    own unreduced gradient would be a smaller batch, but FSDP2 and replicate reduce
    inside backward, where it cannot be read without a hook into their internals.
    Pipelines run every micro batch's backward inside the schedule: not measured.
    ``microbatches``: the fewest per rank of any step (a batch ramp's first; None: the
    layout's), which decides the small batch for the whole run."""
    microbatches = layout.microbatches if microbatches is None else microbatches
    if not cfg.train.noise_scale:
        return None, "train.noise_scale=false"
    if layout.pp > 1:
        return None, ("not measured under pipeline parallelism: the schedule runs every "
                      "micro batch's backward in one call, so no smaller batch's gradient "
                      "is ever whole without an extra backward")
    if microbatches >= 2:
        return layout.micro_batch_size, None
    if cfg.train.compile:
        return None, ("not measured: with one micro batch per step the measuring step "
                      "runs two half batches, a new shape torch.compile would compile "
                      "the blocks again for (use 2 or more micro batches)")
    if layout.micro_batch_size >= 2:
        return layout.micro_batch_size // 2, None
    return None, ("not measured: one sequence per rank and step leaves no smaller batch "
                  "(raise parallel.micro_batch_size or train.global_batch_size)")
