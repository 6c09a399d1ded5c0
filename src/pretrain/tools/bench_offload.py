"""Time, on this host, what ``parallel.offload=params`` runs on the CPU each step.

    python tools/bench_offload.py                 # 1 thread (torchrun's OMP_NUM_THREADS=1)
    python tools/bench_offload.py --threads 0     # torch's default thread count
    python tools/bench_offload.py --params 50e6 --tensor 10e6

FSDP2's ``CPUOffloadPolicy`` keeps the parameter shards, their gradients and the AdamW state
in host memory, so the optimizer step runs on the host, with the optimizer
``build_optimizer`` makes for host parameters: torch's AdamW with ``fused=False``, which on
CPU tensors is its single-tensor for-loop (foreach is CUDA's). Gradients come back from the
GPU each micro batch and are summed into the host gradient (``add_``). Printed: nanoseconds
per fp32 parameter for each of those, torch's fused CPU AdamW (one vectorised pass: what a
vectorised host step, DeepSpeed's CPU Adam being the anchor, buys) and a host copy, on
tensors of ``--tensor`` elements. planning/calibration.py holds the figures the planner uses.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pretrain.errors import cli


def _timed(fn, repeats: int) -> float:
    fn()  # warm: state allocated, pages touched
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _adamw(params: list[torch.Tensor], **flags) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **flags)
    for p in params:
        p.grad = torch.randn_like(p)
    return opt


def measure(n_params: float, tensor: float, repeats: int) -> dict[str, float]:
    """ns per parameter of each host-side operation of an offloaded step."""
    sizes = [int(tensor)] * max(1, round(n_params / tensor))
    n = sum(sizes)
    params = [torch.randn(s, requires_grad=True) for s in sizes]
    out = {}
    for name, flags in (("adamw_for_loop", {"foreach": False, "fused": False}),
                        ("adamw_fused", {"fused": True})):
        opt = _adamw(params, **flags)
        out[name] = _timed(opt.step, repeats) / n * 1e9
        opt.state.clear()
    more = [torch.randn_like(p) for p in params]
    out["grad_accumulate"] = _timed(
        lambda: [p.grad.add_(g) for p, g in zip(params, more, strict=True)], repeats) / n * 1e9
    out["host_copy"] = _timed(
        lambda: [g.copy_(p.grad) for p, g in zip(params, more, strict=True)], repeats) / n * 1e9
    return out


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="fp32 parameters in all")
    ap.add_argument("--tensor", type=float, default=10e6, help="elements per tensor")
    ap.add_argument("--threads", type=int, default=1, help="0: torch's default")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = measure(args.params, args.tensor, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.params:.3g} fp32 parameters in tensors of {args.tensor:.3g}")
    for k, v in ns.items():
        print(f"  {k:<16} {v:7.2f} ns/parameter  ({1e9 / v / 1e6:8.1f} M parameters/s)")
    print(f"  fused / for-loop AdamW: {ns['adamw_for_loop'] / ns['adamw_fused']:.1f}x faster")
    print(json.dumps({"threads": torch.get_num_threads(), "ns_per_param": ns}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
