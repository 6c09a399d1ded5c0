"""Causal self-attention kernels behind one signature, and the choice among them.

Every backend takes q, k, v shaped (batch, seq, heads, head_dim), the layout flash-attn
uses natively, with k and v possibly having fewer (grouped) heads, and returns
(batch, seq, heads, head_dim). ``scale`` is the softmax scale of q.k: None for
1/sqrt(head_dim), muP's sqrt(base head_dim)/head_dim otherwise (pretrain.model.parametrization).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pretrain.config.schema import AttentionBackend

BACKENDS = tuple(AttentionBackend)


class AttentionBackendError(ValueError):
    pass


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_usable(device: torch.device) -> tuple[bool, str]:
    """Whether flash-attn can run here, and if not, why (for the error message)."""
    if device.type != "cuda":
        return False, f"flash-attn needs a CUDA device, this run is on '{device.type}'"
    if not flash_attn_installed():
        return False, "the flash-attn package is not installed (pip install '.[gpu]')"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"flash-attn 2 needs compute capability >= 8.0, this GPU has {major}.x"
    return True, ""


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn ``model.attention`` into the backend that will run, or raise naming the fix.

    ``auto`` prefers flash-attn (CUDA before Hopper, fp16/bf16 compute), else SDPA, which is
    itself a fused kernel (cuDNN, flash or memory-efficient: ``sdpa_priority``) on GPUs and a
    fused CPU kernel otherwise.
    """
    if requested not in BACKENDS:
        raise AttentionBackendError(
            f"model.attention={requested!r} is not a backend; choose one of {', '.join(BACKENDS)}"
        )
    if requested == "flash":
        ok, why = flash_attn_usable(device)
        if not ok:
            raise AttentionBackendError(
                f"model.attention=flash cannot run: {why}. "
                "Use model.attention=sdpa (or auto to pick the best available)."
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise AttentionBackendError(
                "model.attention=flash needs fp16/bf16 compute; set precision=bf16 "
                "or use model.attention=sdpa for fp32."
            )
        return "flash"
    if requested == "auto":
        ok, _ = flash_attn_usable(device)
        # Hopper and newer: SDPA with cuDNN first (sdpa_priority) outruns flash-attn 2
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
        return "flash" if ok and not hopper and dtype in (torch.float16, torch.bfloat16) \
            else "sdpa"
    return requested


def sdpa_priority(device: torch.device | None) -> tuple[SDPBackend, ...] | None:
    """The order SDPA tries its CUDA kernels in: cuDNN first on compute capability 9.0+
    (Hopper, Blackwell), as torchtitan does, where cuDNN's attention is the fastest; torch's
    own order (flash, memory-efficient, math) elsewhere. None off CUDA (torch's default)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    order = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    if torch.cuda.get_device_capability(device) >= (9, 0):
        return (SDPBackend.CUDNN_ATTENTION, *order)
    return order


def kernel(backend: str, device: torch.device | None = None):
    """The attention function for ``backend`` on ``device`` (SDPA with its kernel priority
    bound in, decided once here rather than on every call)."""
    priority = sdpa_priority(device) if backend == "sdpa" else None
    return functools.partial(sdpa_attention, backends=priority) if priority else \
        KERNELS[backend]


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    scale: float | None = None):
    """Reference implementation: explicit causal mask, softmax in fp32."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    t = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) if scale is None else \
        (q @ k.transpose(-2, -1)) * scale
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs @ v).transpose(1, 2)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   scale: float | None = None, backends: tuple[SDPBackend, ...] | None = None):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(list(backends), set_priority=True) if backends else nullcontext():
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=k.shape[1] != q.shape[1],
            scale=scale)
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    scale: float | None = None):
    from flash_attn import flash_attn_func  # optional dependency, checked by resolve_backend

    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=True)


KERNELS = {"eager": eager_attention, "sdpa": sdpa_attention, "flash": flash_attention}
