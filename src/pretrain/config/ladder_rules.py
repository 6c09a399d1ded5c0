"""A ladder's rungs trained like its target (issue 55, docs/ladder/README.md): each size's
batch and AdamW beta2 follow from the target's by two rules, so every rung takes as many
optimizer steps per token of its horizon as the rules say the target does, instead of one
batch for every size.

- Batch: DeepSeek's B_opt ~ C^0.3271 (Bi et al. 2024, sec. 3.1), at the size's own long run.
  At fixed tokens per parameter C ~ N^2 ~ width^4, so B = B_target (width / width_target)^1.31,
  in whole sequences, at least one. A WSD ladder's cooldown branches share their source's
  batch, so the rule is per size (width), not per run.
- beta2: the second-moment EMA keeps its horizon in tokens: 1 - beta2 = (1 - beta2_ref)
  B / B_ref (Porian et al. 2024: beta2 of 0.99-0.999 at small batches was essential for
  clean laws down to 5M parameters).

- Validation: the same windows for every size, whatever its batch: ``train.eval_batches``
  micro-batches of the size's batch cover a fixed number of windows (a batch-1 rung
  evaluated on 64 batches read 64 windows, a batch-6 one 384: each size was scored on
  another sample of the validation set, a bias between sizes the fit took for scaling).

Used from recipes through resolvers (config/naming.py): ``${pretrain_ladder_batch:...}``,
``${pretrain_beta2:...}`` and ``${pretrain_eval_batches:...}``.
"""

from __future__ import annotations

import math

BATCH_EXPONENT = 0.3271  # DeepSeek LLM (Bi et al. 2024): B_opt = 0.292 C^0.3271 tokens


def ladder_batch(width: int, target_width: int, target_batch: int) -> int:
    """Sequences per batch of a rung of ``width`` when the target (``target_width``) trains
    at ``target_batch`` sequences."""
    width, target_width, target_batch = int(width), int(target_width), int(target_batch)
    if min(width, target_width, target_batch) < 1:
        raise ValueError("pretrain_ladder_batch: width, target width and target batch must "
                         "be positive")
    return max(1, round(target_batch * (width / target_width) ** (4 * BATCH_EXPONENT)))


def token_beta2(batch: int, ref_batch: int, ref_beta2: float) -> float:
    """AdamW's beta2 at ``batch`` that averages over as many tokens as ``ref_beta2`` does at
    ``ref_batch`` (batches in the same unit)."""
    batch, ref_batch, ref_beta2 = int(batch), int(ref_batch), float(ref_beta2)
    if batch < 1 or ref_batch < 1 or not 0.0 < ref_beta2 < 1.0:
        raise ValueError("pretrain_beta2: batches must be positive and the reference beta2 "
                         "in (0, 1)")
    return min(1.0 - (1.0 - ref_beta2) * batch / ref_batch, 0.9999)


def eval_batches(windows: int, batch: int) -> int:
    """Micro-batches of ``batch`` sequences that cover ``windows`` validation windows."""
    windows, batch = int(windows), int(batch)
    if windows < 1 or batch < 1:
        raise ValueError("pretrain_eval_batches: windows and batch must be positive")
    return math.ceil(windows / batch)
