"""A precision policy: param, compute and reduce dtypes, and loss scaling."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from pretrain.config.paths import CONF_DIR
from pretrain.config.schema import Config, PrecisionConfig
from pretrain.errors import UserError
from pretrain.hardware.gpus import GpuSpec

# The one table of dtype names a config may use: precision policies, the planner's byte
# counts (``dtype_bytes``) and tools/export_hf.py's --dtype all read it.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_bytes(name: str) -> int:
    """Bytes per element of the dtype a config names ("bfloat16": 2)."""
    return DTYPES[name].itemsize


class PrecisionError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    loss_scaling: bool
    fp8: bool
    fp8_recipe: str = "tensorwise"
    fp8_filter: str = "auto"
    # fp8 matmuls emulated in high precision (no fp8 tensor cores here; allowed by the user)
    fp8_emulate: bool = False

    @property
    def peak_dtype(self) -> str:
        """The compute dtype's name, whose datasheet peak is the MFU denominator
        (``GpuSpec.mfu_peak``: bf16 for fp8 runs too, the same rule as the planner's)."""
        return str(self.compute_dtype).removeprefix("torch.")

    @property
    def mixed(self) -> bool:
        """Compute in a lower dtype than the parameters are held in. In a multi-process
        layout FSDP2's ``MixedPrecisionPolicy`` does the casting (a data-parallel group of
        one where there is no data parallelism), as torchtitan does under FSDP: parameters
        gathered in the compute dtype, activations and the residual stream in it, norms
        upcast inside themselves. One process autocasts instead, with no wrapper
        (parallel/data_parallel.autocasts)."""
        return self.compute_dtype != self.param_dtype

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.loss_scaling else None


AUTO = "auto"
PRESET_DIR = CONF_DIR / "precision"
# What ``precision=auto`` takes from the preset it picks; everything else (param and
# reduce dtypes, a user's overrides) stays as the config has it.
AUTO_KEYS = ("name", "compute_dtype", "loss_scaling")


def choose_auto(device: torch.device | GpuSpec) -> tuple[str, str]:
    """The precision ``auto`` means on ``device``, and why. A capability check, not a
    timing: free, and the same answer in every process of a run.

    CUDA: bf16 from compute capability 8.0 (A100, H100, RTX 30xx+), else fp16 with loss
    scaling (V100, T4). CPU: bf16 only where the CPU multiplies bf16 in hardware, else fp32
    (emulated bf16 matmuls run 7-100x slower than fp32 there). A GPU type of the planner's
    table (``conf/gpu/``, no GPU at hand): bf16 when it lists a bf16 peak, else fp16."""
    from pretrain.hardware.device import cpu_native_matmul

    if isinstance(device, GpuSpec):
        if device.peak_flops("bfloat16"):
            return "bf16", f"{device.name} has bf16 tensor cores (conf/gpu)"
        return "fp16", f"{device.name} lists no bf16 peak (conf/gpu): fp16 with loss scaling"
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]})"
        if cc >= (8, 0):
            return "bf16", f"{gpu} has bf16 tensor cores"
        return "fp16", f"{gpu} has no bf16 tensor cores: fp16 with loss scaling"
    if device.type == "cpu":
        native, why = cpu_native_matmul(torch.bfloat16)
        if native:
            return "bf16", f"this CPU has native bf16 matmuls ({why})"
        return "fp32", f"this CPU has no native bf16 matmul ({why})"
    return "fp32", f"no reduced-precision rule for device type '{device.type}'"


def load_preset(name: str) -> PrecisionConfig:
    """``conf/precision/NAME.yaml`` as a PrecisionConfig: the one definition of a preset."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(PrecisionConfig),
                             OmegaConf.load(PRESET_DIR / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def resolve_auto_precision(cfg: Config, device: torch.device | GpuSpec
                           ) -> tuple[Config, str | None]:
    """``cfg`` with ``precision=auto`` replaced by the preset ``choose_auto`` picks, and the
    reason ("fp32: this CPU has no native bf16 matmul (...)"); unchanged (reason None) for
    a named precision, which is always run exactly as named."""
    if cfg.precision.name != AUTO:
        return cfg, None
    name, why = choose_auto(device)
    preset = load_preset(name)
    out = copy.copy(cfg)
    out.precision = dataclasses.replace(
        cfg.precision, **{k: getattr(preset, k) for k in AUTO_KEYS})
    return out, f"{name}: {why}"


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"this run is on '{device.type}', fp8 needs a CUDA GPU"
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        return False, f"this GPU has compute capability {cc[0]}.{cc[1]}, fp8 needs >= 8.9"
    return True, ""


def resolve_policy(cfg: PrecisionConfig, device: torch.device) -> Policy:
    """Check the policy can run on ``device`` and return it, or raise naming the fix."""
    emulate = False
    if cfg.fp8:
        ok, why = fp8_supported(device)
        if not ok and not cfg.fp8_allow_emulation:
            raise PrecisionError(
                f"precision=fp8 cannot run: {why} (H100/H200/L40S/RTX 40xx). Use precision=bf16, "
                "or set precision.fp8_allow_emulation=true to emulate it (slow, for tests)."
            )
        emulate = not ok
        from pretrain.precision.fp8 import require_torchao

        require_torchao()
    return Policy(
        name=cfg.name,
        param_dtype=DTYPES[cfg.param_dtype],
        compute_dtype=DTYPES[cfg.compute_dtype],
        reduce_dtype=DTYPES[cfg.reduce_dtype],
        loss_scaling=cfg.loss_scaling,
        fp8=cfg.fp8,
        fp8_recipe=cfg.fp8_recipe,
        fp8_filter=cfg.fp8_filter,
        fp8_emulate=emulate,
    )
