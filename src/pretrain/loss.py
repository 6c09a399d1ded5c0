"""Next-token cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss. Computed in fp32 (autocast runs cross_entropy in fp32 too)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
