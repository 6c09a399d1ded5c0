"""A precision policy: param, compute and reduce dtypes, and loss scaling."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pretrain.config import PrecisionConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PrecisionError(ValueError):
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
        """The key of the datasheet peak that bounds this policy's matmuls (for MFU)."""
        return "float8" if self.fp8 and not self.fp8_emulate else \
            str(self.compute_dtype).removeprefix("torch.")

    def autocast(self, device: torch.device):
        """Autocast to the compute dtype when it differs from the parameters' dtype."""
        if self.compute_dtype == self.param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.loss_scaling else None


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
        from pretrain.fp8 import require_torchao

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
