"""Skip a step whose loss or gradient norm spikes, decided on the device.

OLMo-core's ``SkipStepOptimizer`` (used by its OLMo-3 pretraining scripts): a step is not
taken when its loss or its gradient norm exceeds the mean + ``sigmas`` standard deviations
of a rolling window of recent steps, once ``warmup`` steps are in the window. A bad batch
(or a numerical accident) then costs one step of data instead of an update whose size the
optimizer's moments remember for thousands of steps. Here only the accepted steps enter the
window (a skipped spike does not widen the band that let the next one through).

The window is a device ring buffer and the decision a device bool, so nothing is read on
the host: the train module combines it with the finite check (optim/nonfinite.py), and a
fused optimizer takes the combination as ``found_inf``. The loss and gradient norm it is
given are global (the same on every rank), so every rank decides the same. Its state is a
few host numbers at save time (``state_dict``), restored on resume, so a resumed run skips
exactly the steps the uninterrupted one would.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("pretrain")


class SpikeGuard:
    """The rolling window of accepted steps' (loss, grad norm) and the skip decision."""

    def __init__(self, device: torch.device, sigmas: float, window: int, warmup: int):
        self.sigmas, self.size, self.warmup = sigmas, window, warmup
        self.values = torch.zeros(2, window, device=device)  # rows: loss, grad norm
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted in all
        self.total = torch.zeros((), dtype=torch.int64, device=device)  # spikes skipped
        self.skipped = 0  # as last read on the host

    def ok(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """A device bool: False when the window is warm and ``loss`` or ``grad_norm`` is
        above its mean + sigmas x std (unbiased, over the filled slots)."""
        filled = (torch.arange(self.size, device=self.count.device) < self.count).float()
        n = filled.sum().clamp(min=2.0)
        mean = (self.values * filled).sum(1) / n
        std = (((self.values - mean[:, None]) ** 2 * filled).sum(1) / (n - 1)).sqrt()
        now = torch.stack([loss.float(), grad_norm.float()])
        spike = (now > mean + self.sigmas * std).any()
        return ~(spike & (self.count >= self.warmup))

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor,
               ok: torch.Tensor) -> None:
        """After the step: an accepted one (finite and ``ok``) enters the window, a finite
        one that was not ``ok`` is counted as a skipped spike."""
        taken = finite & ok
        slot = self.count % self.size
        now = torch.stack([loss.float(), grad_norm.float()])
        self.values[:, slot] = torch.where(taken, now, self.values[:, slot])
        self.count += taken.long()
        self.total += (finite & ~ok).long()

    def settle(self) -> int:
        """The spikes skipped in all (a host read: on steps that sync anyway)."""
        self.skipped = int(self.total.item())
        return self.skipped

    def state_dict(self) -> dict:
        """Plain numbers (for the checkpoint's meta; fp32 values round-trip exactly)."""
        return {"values": self.values.tolist(), "count": int(self.count.item()),
                "skipped": int(self.total.item())}

    def load_state_dict(self, state: dict | None) -> None:
        """``state`` from ``state_dict``; None (a checkpoint saved without the guard), or a
        window of another size: the window starts empty and warms up again."""
        if not state:
            return
        self.total.fill_(int(state["skipped"]))
        self.skipped = int(state["skipped"])
        values = torch.tensor(state["values"], dtype=torch.float32, device=self.values.device)
        if values.shape != self.values.shape:
            log.warning("the checkpoint's spike-guard window holds %d steps, "
                        "optim.spike_window=%d: the window starts empty", values.shape[1],
                        self.size)
            return
        self.values.copy_(values)
        self.count.fill_(int(state["count"]))
