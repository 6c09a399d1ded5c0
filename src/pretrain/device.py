"""The device a run uses, its peak FLOP/s (for MFU) and its memory readings."""

from __future__ import annotations

import ctypes
import resource
import sys
import time

import torch


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={requested} but no CUDA device is visible; "
                         "use train.device=cpu (or auto)")
    return torch.device(requested)


def gpu_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense datasheet peak of this GPU for ``dtype``, from the one GPU table (conf/gpu/,
    see pretrain.planning.gpus); None for a GPU the table does not know."""
    from pretrain.planning.gpus import gpu_for_device_name

    spec = gpu_for_device_name(torch.cuda.get_device_name(device))
    return spec.peak_flops(dtype) if spec is not None else None


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, n: int = 2048,
                         seconds: float = 1.0) -> float:
    """Achieved FLOP/s of a large square matmul: the practical peak of a CPU.

    ``n`` shrinks where one n x n matmul would alone take longer than ``seconds``: a dtype
    the CPU only emulates (fp16 without AVX512-FP16 runs at ~0.4 GFLOP/s, one 2048^3 matmul
    in ~40 s, paid twice at every fp16 start-up)."""
    probe = torch.randn(256, 256, device=device).to(dtype)
    probe @ probe  # warm-up, then time one
    t0 = time.perf_counter()
    probe @ probe
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = 2 * 256**3 / max(time.perf_counter() - t0, 1e-9)
    n = max(256, min(n, int((rate * seconds / 2) ** (1 / 3))))
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the OS after every step.

    On CPU the big activations (logits above all) are freed and re-allocated each step; with
    glibc's default thresholds every allocation is a fresh mmap whose page faults cost about a
    third of a step. Raising the mmap and trim thresholds keeps that memory in the heap.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4
    # glibc caps M_MMAP_THRESHOLD at 32 MiB, below a 50k-vocab logits tensor, so serve every
    # allocation from the heap instead, and never trim the heap back.
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)
