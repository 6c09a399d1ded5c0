"""optim=adafactor: torch's Adafactor (Shazeer & Stern 2018; T5, PaLM), decay on the matrices
only; its own epsilons, beta2 decay and update clipping (torch's defaults), so of the
optimizer-specific keys it reads optim.weight_decay alone."""

from __future__ import annotations

import math

import torch

from pretrain.config.schema import OptimConfig
from pretrain.optim.factory import decay_groups
from pretrain.optim.registry import OptimizerSpec, register


def factored_state(name: str, shape: tuple[int, ...], local: tuple[int, ...], pb: int) -> int:
    """torch's Adafactor: a float32 step, and the second moment factored over the last two
    dimensions, a row and a column factor per leading index ((r + c) per r x c matrix, not
    r x c), or whole for a vector."""
    if len(local) < 2:
        return 4 + pb * math.prod(local)
    return 4 + pb * math.prod(local[:-2]) * (local[-2] + local[-1])


def build_adafactor(model: torch.nn.Module, cfg: OptimConfig, lr: float, device: torch.device,
                    also_embeddings: list[torch.nn.Parameter]) -> torch.optim.Adafactor:
    """torch's Adafactor on ``decay_groups``' two groups, optim.weight_decay on the first."""
    decay, no_decay = decay_groups(model, also_embeddings)
    return torch.optim.Adafactor([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=lr, weight_decay=cfg.weight_decay)


# Its step is min(lr, 1/sqrt(t)) x each tensor's RMS (relative step): torch's default 1e-2
# (T5's); above 1 the 1/sqrt(t) cap is all that acts.
register(OptimizerSpec(
    "adafactor", build_adafactor, factored_state, (1e-4, 1.0),
    reads=frozenset({"weight_decay"}),
    lr_rules=frozenset({"fixed", "power"}), lr_scalings=frozenset({"none", "sqrt"}),
    why="Adafactor's step is lr x each tensor's RMS (a relative step): deepseek's "
        "AdamW LR law does not apply, and its batch scaling is Adam's sqrt",
    # torch 2.13's Adafactor on a DTensor: "aten.pow_.Scalar: in-place
    # operations that require placement changes are not supported"
    on_dtensor=False))
