"""GPU types: memory, dense peak FLOP/s per dtype, link bandwidths, a default MFU.

One table for the whole project: ``conf/gpu/*.yaml``, one file per GPU type, each stating its
sources. The planner reads it for memory limits and time estimates, and ``device.py`` for the
MFU denominator of a running job (matched by the CUDA device name). Users add a GPU type by
dropping a file with the same keys into ``conf/gpu/``, or into a directory named by the
``PRETRAIN_GPU_TABLE`` environment variable (or ``tools/plan.py --gpu-file``); a file with the
name of a built-in type replaces it.

Bandwidths are per GPU and per direction, in GB/s (1e9 bytes): ``nvlink_gbps`` within a node,
``network_gbps`` (InfiniBand / Ethernet NIC share) between nodes.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.config.paths import CONF_DIR
from pretrain.errors import UserError

GIB = 1024**3
CONF_GPU_DIR = CONF_DIR / "gpu"
ENV_VAR = "PRETRAIN_GPU_TABLE"
KEYS = ("name", "match", "memory_gib", "peak_tflops", "nvlink_gbps", "network_gbps",
        "gpus_per_node", "default_mfu", "kernel_efficiency", "pcie_gbps", "memory_gbps",
        "host_speed")


class GpuError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    peak_tflops: dict[str, float]
    nvlink_gbps: float
    network_gbps: float
    gpus_per_node: int = 8
    default_mfu: float = 0.4
    # GB/s one way between host and GPU memory (parallel.offload's copies): PCIe 4.0 x16
    # about 25 usable by default, PCIe 5.0 x16 about 50 (H100/H200), GH200's NVLink-C2C 450.
    pcie_gbps: float = 25.0
    # GB/s of the GPU's own memory (HBM), the datasheet's: one GPU's memory-bound kernels
    # (planning/cost.memory_bound_seconds); None: not modelled.
    memory_gbps: float | None = None
    # The node's CPU against the one the host step of parallel.offload was timed on
    # (planning/calibration.py): its AdamW and gradient sums take 1 / host_speed as long.
    host_speed: float = 1.0
    # Fraction of the dense peak this project's compiled kernels reach, calibrated on
    # measured runs (docs/benchmarks.md): the cost model's compute runs at peak x this.
    kernel_efficiency: float = 1.0
    # Words of torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3"), all of which must
    # appear as whole words (case-insensitive): "H200" is not a word of "NVIDIA GH200 480GB".
    match: tuple[str, ...] = field(default_factory=tuple)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def peak_flops(self, dtype: str) -> float | None:
        """Dense peak in FLOP/s for ``dtype`` (bfloat16, float16, float8, float32), or None."""
        value = self.peak_tflops.get(dtype)
        return None if value is None else float(value) * 1e12

    def mfu_peak(self, compute_dtype: str) -> float | None:
        """The MFU denominator, the one rule for a run's log and the plan: the dense peak
        of the compute dtype (bf16 for an fp8 run too: fp8 speeds up some matmuls, MFU
        stays comparable across precisions, as torchtitan reports it), fp32's for fp32."""
        return self.peak_flops(compute_dtype) or self.peak_flops("bfloat16")


def _load_file(path: Path) -> GpuSpec:
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise GpuError(f"{path}: expected a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(raw) - set(KEYS))
    missing = [k for k in ("name", "memory_gib", "peak_tflops", "nvlink_gbps", "network_gbps")
               if k not in raw]
    if unknown or missing:
        raise GpuError(f"{path}: unknown keys {unknown or 'none'}, missing keys {missing or 'none'}"
                       f" (a GPU file has: {', '.join(KEYS)})")
    raw["match"] = tuple(raw.get("match") or ())
    raw["peak_tflops"] = {str(k): float(v) for k, v in raw["peak_tflops"].items()}
    return GpuSpec(**raw)


def _dirs(extra: tuple[str, ...]) -> list[Path]:
    dirs = [CONF_GPU_DIR]
    env = os.environ.get(ENV_VAR)
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    return dirs + [Path(p) for p in extra]


@functools.lru_cache(maxsize=8)
def load_gpus(extra: tuple[str, ...] = ()) -> dict[str, GpuSpec]:
    """Every known GPU type by name: conf/gpu, then $PRETRAIN_GPU_TABLE, then ``extra``
    (files or directories of YAML files); later definitions replace earlier ones."""
    table: dict[str, GpuSpec] = {}
    for f in (f for d in _dirs(extra) for f in _yaml_files(d)):
        spec = _load_file(f)
        table[spec.name] = spec
    return table


def _yaml_files(d: Path) -> list[Path]:
    """The GPU files a table path names: itself (a file) or its YAML files (a directory)."""
    if d.is_file():
        return [d]
    if d.is_dir():
        return sorted(d.glob("*.yaml"))
    if d == CONF_GPU_DIR:  # an installed package without the checkout's conf/
        return []
    raise GpuError(f"GPU table path {d} does not exist")


def get_gpu(name: str, extra: tuple[str, ...] = ()) -> GpuSpec:
    table = load_gpus(extra)
    if name not in table:
        raise GpuError(f"unknown GPU type {name!r}; known types: {', '.join(sorted(table))}. "
                       f"Add one as a YAML file in conf/gpu/ (same keys as "
                       f"conf/gpu/h100-80gb.yaml) or in a directory named by ${ENV_VAR}.")
    return table[name]


def gpu_for_device_name(device_name: str) -> GpuSpec | None:
    """The table entry for a CUDA device name ("NVIDIA H100 80GB HBM3"): of the types whose
    ``match`` words all appear as words of the name, the most specific (most words); None
    when none does: an unknown GPU is never given another one's peaks or memory."""
    words = set(device_name.upper().replace("-", " ").split())
    full = [s for s in load_gpus().values()
            if s.match and all(m.upper() in words for m in s.match)]
    return max(full, key=lambda s: len(s.match)) if full else None


def local_gpu(device_type: str, world_size: int = 1) -> GpuSpec:
    """The GPU type a run is on, for ``parallel=auto`` inside the trainer: the table entry
    matching the CUDA device name; an unknown CUDA GPU gets its real memory and the A100's
    peaks and links (stated fallback); a CPU run gets a stand-in whose memory is this host's
    RAM shared by ``world_size`` processes and whose peaks are those measured on large
    matmuls on a 2-core AVX512-BF16 CPU (421 GFLOP/s bf16, 197 fp32)."""
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        spec = gpu_for_device_name(name)
        if spec is not None:
            return spec
        memory = torch.cuda.get_device_properties(0).total_memory / GIB
        base = load_gpus().get("a100-80gb")
        return GpuSpec(name=name, memory_gib=memory,
                       peak_tflops=dict(base.peak_tflops) if base else {"bfloat16": 312.0},
                       nvlink_gbps=base.nvlink_gbps if base else 300.0,
                       network_gbps=base.network_gbps if base else 25.0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return GpuSpec(name="cpu", memory_gib=ram / max(1, world_size),
                   peak_tflops={"bfloat16": 0.421, "float32": 0.197, "float16": 0.197},
                   nvlink_gbps=10.0, network_gbps=10.0, gpus_per_node=max(1, world_size),
                   default_mfu=0.3)
