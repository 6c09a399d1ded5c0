"""A synthetic problem with a known gradient noise scale, and the trainer's measuring
protocol (first micro batch vs whole step) run on it, in one process or in a DP rank.

P independent linear regressions in d dimensions share every sample: x in R^{P x d}, x ~
N(0, I), y_p = w*_p . x_p + eps_p with eps ~ N(0, sigma^2), loss 1/2 sum_p (w_p . x_p -
y_p)^2 per sample. At w = w* + delta (|delta_p| = 1) the per-sample gradient of block p is
(delta_p . x_p - eps_p) x_p, with mean G_p = delta_p and covariance (|delta_p|^2 + sigma^2) I
+ delta_p delta_p^T (Isserlis), so B_simple = tr(Sigma) / |G|^2 = d (1 + sigma^2) + 1
samples. The P blocks are independent estimates in one backward: P = 256 makes a step worth
256 single-regression steps.
"""

from __future__ import annotations

import torch
from torch import nn

P, D, SIGMA = 256, 8, 1.0
B_SIMPLE = D * (1 + SIGMA**2) + 1  # 17 samples


class Regressions(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(P * D))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = (x * self.w.view(P, D)).sum(-1)  # (batch, P)
        return 0.5 * ((pred - y) ** 2).sum(-1).mean()


def w_star() -> torch.Tensor:
    """w* such that delta = w - w* = -w* at w = 0 has |delta_p| = 1 for every block."""
    g = torch.Generator().manual_seed(123)
    v = torch.randn(P, D, generator=g)
    return (v / v.norm(dim=1, keepdim=True)).flatten()


def draw(n: int, gen: torch.Generator, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, P, D, generator=gen)
    y = (x * ws.view(P, D)).sum(-1) + SIGMA * torch.randn(n, P, generator=gen)
    return x, y
