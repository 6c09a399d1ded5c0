"""A synthetic problem with a known gradient noise scale, and the trainer's measuring
protocol (first micro batch vs whole step) run on it, in one process or in a DP rank.

P independent linear regressions in d dimensions share every sample: x in R^{P x d}, x ~
N(0, I), y_p = w*_p . x_p + eps_p with eps ~ N(0, sigma^2), loss 1/2 sum_p (w_p . x_p -
y_p)^2 per sample. At w = w* + delta (|delta_p| = 1) the per-sample gradient of block p is
(delta_p . x_p - eps_p) x_p, with mean G_p = delta_p and covariance (|delta_p|^2 + sigma^2) I
+ delta_p delta_p^T (Isserlis), so B_simple = tr(Sigma) / |G|^2 = d (1 + sigma^2) + 1
samples. The P blocks are independent estimates in one backward: P = 256 makes a step worth
256 single-regression steps.

On 2 data-parallel ranks: ``python tests/forked_ranks.py 2 tests/noise_problem.py OUT``
(helpers.run_ranks); each rank writes OUT/rank<R>.json, FSDP2's and DDP's measurement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pretrain.parallel.grad_clip import global_grad_norm
from pretrain.train.noise_scale import NoiseScale

P, D, SIGMA = 256, 8, 1.0
B_SIMPLE = D * (1 + SIGMA**2) + 1  # 17 samples
STEPS, EMA = 150, 0.98


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


def measure(model: torch.nn.Module, micro: int, per_micro: int, gen: torch.Generator,
            ws: torch.Tensor, dp: int, ddp: bool = False) -> float:
    """The trainer's protocol for STEPS steps at fixed weights: the loss of each micro batch
    / micro, backward; after the first, the squared global gradient norm x micro^2 (its mean
    gradient); after the last, the whole step's. Returns the EMA'd B_simple in samples."""
    ns = NoiseScale(EMA)
    params = list(model.parameters())
    for _ in range(STEPS):
        for i in range(micro):
            if ddp:  # DDP: reduced once at the end, and at once on a measuring step
                model.set_requires_gradient_sync(i in (0, micro - 1))
            x, y = draw(per_micro, gen, ws)
            (model(x, y) / micro).backward()
            if i == 0:
                small = (global_grad_norm(params) ** 2 * micro**2).item()
        big = (global_grad_norm(params) ** 2).item()
        for p in params:
            p.grad = None
        ns.update(small, big, per_micro * dp, per_micro * micro * dp)
    return ns.value


def dp_rank(rank: int) -> dict:
    return {mode: dp_mode(rank, mode) for mode in ("zero3", "ddp")}


def dp_mode(rank: int, mode: str) -> dict:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    model = Regressions()
    (replicate if mode == "ddp" else fully_shard)(model, mesh=mesh)
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank its own samples
    value = measure(model, 4, 2, gen, w_star(), dp=2, ddp=mode == "ddp")
    # the mixed pattern (first micro batch reduced at once, the middle one not, the last
    # with the rest) still gives the mean gradient over both ranks' whole batches
    xs = [draw(3, torch.Generator().manual_seed(50 + r), w_star()) for r in range(2)]
    mine = xs[rank]
    for i in range(3):
        if mode == "ddp":
            model.set_requires_gradient_sync(i in (0, 2))
        (model(mine[0][i:i + 1], mine[1][i:i + 1]) / 3).backward()
    g = model.w.grad
    g = g.full_tensor() if isinstance(g, DTensor) else g
    ref = Regressions()
    ref(torch.cat([x for x, _ in xs]), torch.cat([y for _, y in xs])).backward()
    return {"value": value, "grad_error": float((g - ref.w.grad).abs().max())}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(dp_rank(rank)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
