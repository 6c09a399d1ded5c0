"""Steps skipped for a non-finite loss or gradient, decided on the device.

Every rank decides the same (the global grad norm is not finite whenever the loss or any
gradient is not), but reading that decision on the host every step would be a host sync
in the hot loop. So the decision stays a device tensor: a fused optimizer takes it as
``found_inf`` and leaves parameters and state untouched on such a step (as under
GradScaler), and the counts below accumulate on the device. They are read on the steps that
sync anyway (logging, stop checks, saves): the warnings and the ``train.max_nonfinite_steps``
stop come then, at most ``train.stop_check_interval - 1`` steps late, and the longest run of
skipped steps is kept so none is missed in between. A non-fused optimizer (the CPU default)
has no ``found_inf``: there the decision is read on the host each step.
"""

from __future__ import annotations

import logging

import torch

from pretrain.optim.specs import spec, usual_lr

log = logging.getLogger("pretrain")


def device_skip_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours ``found_inf`` (torch's fused Adam/AdamW do)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """``optimizer.step()``, a no-op on the device when ``finite`` is False."""
    optimizer.grad_scale = None
    optimizer.found_inf = (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


class NonFiniteSteps:
    """Device-side counts of skipped steps: in all, in the current run, the longest run."""

    def __init__(self, device: torch.device, skipped: int = 0):
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.total, self.run, self.longest = zero + skipped, zero.clone(), zero.clone()
        self.skipped = skipped  # as last read on the host
        self.in_a_row = 0

    def add(self, finite: torch.Tensor) -> None:
        bad = (~finite).long()
        self.total = self.total + bad
        self.run = (self.run + 1) * bad
        self.longest = torch.maximum(self.longest, self.run)

    def settle(self, step: int, limit: int) -> int:
        """Read the counts (one host sync); warn about steps skipped since the last read;
        returns the longest run of skipped steps since then (the caller stops at ``limit``)."""
        total, run, longest = torch.stack([self.total, self.run, self.longest]).tolist()
        new = total - self.skipped
        if new:
            log.warning("%d step(s) up to step %d skipped: loss or gradient not finite "
                        "(%d in a row now, %d in all, limit train.max_nonfinite_steps=%d)",
                        new, step, run, total, limit)
        self.skipped, self.in_a_row = total, run
        self.longest = torch.zeros_like(self.longest)  # a run going on is counted again
        return longest


def nonfinite_advice(optim_cfg, peak_lr: float, fp8: bool) -> str:
    """What to change after a stop for non-finite steps, for this run's precision and LR
    source: a lower peak LR (a tenth of it; the middle of the optimizer's usual range when
    it is above that range), as the keys that set it; for fp8, the bf16 policy. (fp16 never
    stops here: its loss scaler skips and rescales; bf16 and fp32 get no precision advice.)"""
    name = str(optim_cfg.name)
    target = usual_lr(name) if peak_lr > spec(name).lr_range[1] else peak_lr / 10
    rule = str(getattr(optim_cfg.lr_rule, "value", optim_cfg.lr_rule))
    if rule == "fixed":  # optim.lr scales with the peak (batch scaling is a factor)
        lower = f"optim.lr={optim_cfg.lr * target / peak_lr:.3g}"
    else:  # the LR comes from a rule: fix it at the target
        scaling = str(getattr(optim_cfg.lr_scaling, "value", optim_cfg.lr_scaling))
        lower = (f"optim.lr_rule=fixed optim.lr={target:.3g}"
                 + (" optim.lr_scaling=none" if scaling != "none" else ""))
    advice = f"lower the LR (the peak LR is {peak_lr:.3g}: {lower})"
    if fp8:
        advice += ", or train without fp8 matmuls (precision=bf16)"
    return advice + ", then resume"
