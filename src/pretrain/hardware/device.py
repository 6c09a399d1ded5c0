"""The device a run uses, its peak FLOP/s (for MFU) and its memory readings."""

from __future__ import annotations

import ctypes
import functools
import getpass
import glob
import logging
import math
import os
import platform
import resource
import sys
import tempfile
import time

import torch

from pretrain import torch_compat
from pretrain.errors import UserError

log = logging.getLogger("pretrain")


class DeviceError(UserError, ValueError):
    pass


def gpus_present() -> str | None:
    """Evidence that this machine or job has NVIDIA GPUs, whether or not torch can use them:
    a launcher that assigned GPUs (``CUDA_VISIBLE_DEVICES``, Slurm's ``SLURM_*GPUS*``) or
    the driver's device files. None when there is none."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() not in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={cvd}"
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS",
                "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK"):
        value = os.environ.get(key)
        if value and value.strip() not in ("0", ""):
            return f"{key}={value}"
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    return f"{len(nodes)} GPU device file(s) ({nodes[0]}...)" if nodes else None


def _cuda_unusable_reason() -> str:
    if torch.version.cuda is None:
        return (f"this PyTorch ({torch.__version__}) is a CPU-only build; install the CUDA "
                "build of the same version")
    return (f"this PyTorch is built for CUDA {torch.version.cuda} but cannot initialise it "
            "(a driver older than that CUDA, or no access to /dev/nvidia*: check nvidia-smi)")


def pick_device(requested: str) -> torch.device:
    """The run's device. ``auto``: CUDA when usable, else the CPU, except that a launcher
    (torchrun, Slurm) that was given GPUs torch cannot use is an error: eight CPU processes
    training 1000x slower than asked for is never what a cluster job meant."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        evidence = gpus_present()
        if evidence is not None:
            launched = [k for k in ("WORLD_SIZE", "SLURM_JOB_ID") if k in os.environ]
            message = (f"train.device=auto: GPUs are present ({evidence}) but CUDA is not "
                       f"usable: {_cuda_unusable_reason()}. To train on the CPU on purpose, "
                       "set train.device=cpu")
            if launched:
                raise DeviceError(message + f" (launched with {', '.join(launched)} set)")
            log.warning("%s; training on the CPU now", message)
        return torch.device("cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"train.device={requested} but CUDA is not usable: "
                          f"{_cuda_unusable_reason()}; or use train.device=cpu (or auto)")
    return torch.device(requested)


def gpu_peak_flops(device: torch.device, dtype: str) -> float | None:
    """The MFU denominator of this GPU for compute dtype ``dtype``, from the one GPU table
    (conf/gpu/, see pretrain.hardware.gpus: ``GpuSpec.mfu_peak``, the planner's rule too);
    None for a GPU the table does not know."""
    from pretrain.hardware.gpus import gpu_for_device_name

    spec = gpu_for_device_name(torch.cuda.get_device_name(device))
    return spec.mfu_peak(dtype) if spec is not None else None


# The three operand layouts of a Linear's matmuls: forward x @ W^T, input gradient g @ W,
# weight gradient g^T @ x. A CPU's kernels differ by layout (an emulated bf16 GEMM runs
# 1.3 GFLOP/s as a @ b and 25 as a @ b^T on an AVX2 CPU), so a peak taken from one layout
# alone can sit far below what the model's own matmuls reach.
_LAYOUTS = {
    "a@b.T": lambda a, b: a @ b.t(),
    "a@b": lambda a, b: a @ b,
    "a.T@b": lambda a, b: a.t() @ b,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, budget: float, min_repeats: int = 3) -> float:
    """The fastest of several timed calls (one untimed call first): noise from other work
    on the machine only ever slows a call down, so the minimum is the machine's rate."""
    fn()
    _sync(device)
    best, spent, repeats = math.inf, 0.0, 0
    while repeats < min_repeats or spent < budget:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, repeats = min(best, dt), spent + dt, repeats + 1
    return max(best, 1e-9)


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, n: int = 2048,
                         seconds: float = 1.0, rounds: int = 3) -> float:
    """The practical peak FLOP/s of ``dtype`` matmuls here: the best of the three layouts a
    Linear uses (``_LAYOUTS``), each the fastest of several timed square matmuls.

    The size adapts: each matmul does enough work to time well (about a tenth of its
    layout's share of ``seconds``), from 256 up to ``n``; a dtype the CPU only emulates gets
    smaller matrices rather than minutes of start-up. The layouts take turns over
    ``rounds`` rounds, so a burst of other work on a shared machine has to last the whole
    measurement to lower it."""
    share = seconds / (len(_LAYOUTS) * rounds)
    operands = []
    for fn in _LAYOUTS.values():
        probe = torch.randn(256, 256, device=device).to(dtype)
        rate = 2 * 256**3 / _best_seconds(functools.partial(fn, probe, probe), device, 0.0, 2)
        size = int((rate * share * rounds / 10 / 2) ** (1 / 3)) // 64 * 64
        size = max(256, min(n, size))
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        operands.append((functools.partial(fn, a, b), size))
    best = 0.0
    for _ in range(rounds):
        for call, size in operands:
            best = max(best, 2 * size**3 / _best_seconds(call, device, share, 2))
    return best


def cpu_native_matmul(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether this CPU runs ``dtype`` matmuls in hardware, and the evidence, from a
    capability check (free, and the same answer in every process of a run).

    bf16 is native with AVX512-BF16 or AMX on x86 and with the BF16 extension on Arm;
    fp16 with AMX-FP16 (x86) or on Arm. Elsewhere PyTorch emulates them, 7-100x slower
    than fp32. Honours ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``, which cap the
    kernels PyTorch and oneDNN may use (and imitate an older CPU)."""
    if dtype == torch.float32:
        return True, "fp32"
    cap = torch.backends.cpu.get_cpu_capability()
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    if platform.machine().lower() in ("aarch64", "arm64"):
        ok = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ok = ok or (dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported())
        return ok, f"Arm CPU ({cap}) {'with' if ok else 'without'} {name} instructions"
    probes = ({"AVX512-BF16": "cpu_avx512_bf16", "AMX": "cpu_amx_tile"}
              if dtype == torch.bfloat16 else {"AMX-FP16": "cpu_amx_fp16"})
    needs = " or ".join(probes)
    gone = [torch_compat.PRIVATE[k].where[0] for k in probes.values() if not torch_compat.has(k)]
    if gone:  # torch's probes are private: without them, native is not shown
        return False, (f"{cap} CPU; whether it has {needs} is unknown: torch "
                       f"{torch.__version__} has no {gone[0].replace(':', '.')}")
    flags = [f for f, key in probes.items() if torch_compat.private(key)()]
    if not flags:
        return False, f"{cap} CPU without {needs}"
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL")
    capped = [f"ATEN_CPU_CAPABILITY caps PyTorch at {cap}"] if cap in ("DEFAULT", "AVX2") else []
    if not isa.upper().startswith(("ALL", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX10")):
        capped.append(f"ONEDNN_MAX_CPU_ISA={isa} caps oneDNN below {needs}")
    if capped:
        return False, f"the CPU has {'/'.join(flags)} but {'; '.join(capped)}"
    return True, f"{cap} CPU with {'/'.join(flags)}"


def peak_rss_bytes() -> int:
    """This process's peak resident host memory so far."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes held by tensors (CUDA: the caching allocator's allocated peak; CPU: the
    process's peak RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def peak_reserved_bytes(device: torch.device) -> int | None:
    """CUDA: peak bytes the caching allocator reserved from the driver, what the planner
    and torchtitan report as a GPU's memory (allocated plus the allocator's cache and
    fragmentation); None elsewhere."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def inductor_cache_per_isa() -> None:
    """Give inductor's on-disk cache a folder of its own per ``ATEN_CPU_CAPABILITY``.

    The imitation of an older CPU (``ATEN_CPU_CAPABILITY=avx2`` on an AVX512 machine) makes
    inductor generate AVX2 code, but its FX-graph cache key (torch 2.13) leaves the vector ISA
    out: a graph cached by an AVX512 run came back under the imitation and gave NaN gradients
    (a fresh folder gave the eager ones to 4e-9). Unset or set by the user, nothing changes."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:  # as inductor names its default folder
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
            user = f"uid_{os.getuid()}"
        folder = f"torchinductor_{user}_{cap}"  # beside inductor's default
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), folder)


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
