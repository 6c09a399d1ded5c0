"""The ``batch_ramp`` group's schema (conf/batch_ramp/), beside schema.py, which holds it
in ``Config.batch_ramp``."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config.choices import RampKind, RampLr


@dataclass
class BatchRampConfig:
    """The global batch over the run (src/pretrain/budget/batch_ramp.py; docs/batch-ramp.md):
    ``none`` keeps train.global_batch_size from the first step; ``tokens`` grows it from
    ``start_tokens`` to the full batch over the first ``ramp_tokens`` (Brown et al. 2020,
    app. B); ``noise_scale`` doubles it whenever the smoothed measured gradient noise scale
    is ``factor`` times the current batch, up to the full batch (Merrill et al. 2025). Every
    batch is a whole number of the layout's micro batches x dp (the micro batch never
    changes shape); the samples read are the fixed-batch run's, grouped into other steps;
    the schedule runs in tokens and the LR follows the batch (``lr_scaling``)."""

    name: RampKind = RampKind.none
    # the first step's global batch in tokens, rounded up to whole micro batches x dp
    start_tokens: int | None = None
    # tokens (from the start) over which ``tokens`` reaches the full batch
    ramp_tokens: int | None = None
    # tokens: 0 grows the batch step by step (linear in the tokens consumed, rounded down to
    # whole micro batches x dp); n > 0 in n equal stages
    stages: int = 0
    # LR at batch B = the full batch's LR x rule(B / full batch): auto = the optimizer's rule
    lr_scaling: RampLr = RampLr.auto
    # noise_scale: double the batch when B_simple >= factor x the current batch (tokens)
    factor: float = 2.0
    # noise_scale: measurements (logging steps) the noise scale average needs before the
    # first decision, and between two changes
    min_measurements: int = 3
