"""Causal self-attention kernels behind one signature, and the choice among them.

Every backend takes q, k, v shaped (batch, seq, heads, head_dim), the layout flash-attn
uses natively, with k and v possibly having fewer (grouped) heads, and returns
(batch, seq, heads, head_dim). ``scale`` is the softmax scale of q.k: None for
1/sqrt(head_dim), muP's sqrt(base head_dim)/head_dim otherwise (pretrain.model.parametrization).

``mask`` (``model.attention_mask=document``): attention block-causal within the documents of
a packed window (Zhao et al. 2024; torchtitan's block_causal, Megatron's
--reset-attention-mask). A document ends at the end-of-document token, which belongs to the
document it ends. The model derives document ids from its input tokens (``document_ids``)
and builds the mask once per forward with the kernel's own builder (``MASK_BUILDERS``): a
boolean (batch, 1, seq, seq) tensor for eager and SDPA (the CPU's way: torch 2.13's
FlexAttention has no CPU backward), a FlexAttention ``BlockMask`` for ``flex`` (CUDA: the
kernel skips blocks that are wholly masked). None: plain causal attention, today's path.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pretrain.config.schema import AttentionBackend
from pretrain.errors import UserError

BACKENDS = tuple(AttentionBackend)


class AttentionBackendError(UserError, ValueError):
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


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype,
                    document: bool = False) -> str:
    """Turn ``model.attention`` into the backend that will run, or raise naming the fix.

    ``auto`` prefers flash-attn (CUDA before Hopper, fp16/bf16 compute), else SDPA, which is
    itself a fused kernel (cuDNN, flash or memory-efficient: ``sdpa_priority``) on GPUs and a
    fused CPU kernel otherwise. ``document`` (model.attention_mask=document): ``auto`` is
    FlexAttention on CUDA, SDPA with a boolean mask elsewhere (``resolve_document_backend``).
    """
    if requested not in BACKENDS:
        raise AttentionBackendError(
            f"model.attention={requested!r} is not a backend; choose one of {', '.join(BACKENDS)}"
        )
    if document:
        return resolve_document_backend(requested, device)
    if requested == "flex":
        raise AttentionBackendError(
            "model.attention=flex is for document masking (model.attention_mask=document); "
            "plain causal attention runs model.attention=sdpa (or auto)")
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
        return "flash" if ok and not hopper and dtype in (torch.float16, torch.bfloat16) else "sdpa"
    return requested


def resolve_document_backend(requested: str, device: torch.device) -> str:
    """The backend of block-causal document attention: FlexAttention's block mask on CUDA
    (``auto``, or ``flex``), SDPA or eager with a boolean mask anywhere. flash-attn's plain
    kernel knows no documents (its varlen kernel is not wired here)."""
    if requested == "flash":
        raise AttentionBackendError(
            "model.attention=flash with model.attention_mask=document: flash-attn's varlen "
            "kernel is not wired here; use model.attention=flex (CUDA: FlexAttention's block "
            "mask) or sdpa (a boolean mask), or auto to pick")
    if requested == "flex" and device.type != "cuda":
        raise AttentionBackendError(
            f"model.attention=flex needs CUDA (torch's FlexAttention has no backward on "
            f"'{device.type}'); use model.attention=sdpa (a boolean block-causal mask) or auto")
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
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
    if backend == "flex":
        return flex_attention_kernel
    priority = sdpa_priority(device) if backend == "sdpa" else None
    return functools.partial(sdpa_attention, backends=priority) if priority else KERNELS[backend]


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(batch, seq) int32 index of each token's document within its window: the number of
    end-of-document tokens before it (an EOD token belongs to the document it ends)."""
    eod = (tokens == eod_id).to(torch.int32)
    return eod.cumsum(1, dtype=torch.int32) - eod


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int64 position of each token within its document (0 where one starts;
    the window's first, partial document counts from the window's start): Megatron's
    --reset-position-ids."""
    t = docs.shape[1]
    idx = torch.arange(t, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(1).values


def dense_document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) booleans, True where a query may attend: its own document, at or
    before itself (SDPA's and eager's ``attn_mask``; seq x seq bytes a micro batch)."""
    t = docs.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def block_document_mask(docs: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask of the same rule: the kernel skips wholly masked blocks
    (torchtitan's block_causal). Built once a forward, shared by every layer."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    b, t = docs.shape
    return create_block_mask(mask_mod, b, None, t, t, device=docs.device)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    scale: float | None = None, mask: torch.Tensor | None = None):
    """Reference implementation: explicit causal (or ``mask``) mask, softmax in fp32."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    t = q.shape[2]
    scores = (
        (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if scale is None
        else (q @ k.transpose(-2, -1)) * scale
    )
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs @ v).transpose(1, 2)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   scale: float | None = None, backends: tuple[SDPBackend, ...] | None = None,
                   mask: torch.Tensor | None = None):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(list(backends), set_priority=True) if backends else nullcontext():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
            enable_gqa=k.shape[1] != q.shape[1], scale=scale)
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once (its fused kernel; eager it materialises the scores).
    Inside a compiled model dynamo inlines it."""
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          dropout_p: float = 0.0, scale: float | None = None,
                          mask: BlockMask | None = None):
    """FlexAttention under ``mask`` (a ``BlockMask``: block_document_mask). No dropout."""
    if dropout_p > 0:
        raise AttentionBackendError("model.attention=flex has no attention dropout; set "
                                    "model.dropout=0 or model.attention=sdpa")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = _compiled_flex()(q, k, v, block_mask=mask, scale=scale,
                           enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    scale: float | None = None):
    from flash_attn import flash_attn_func  # optional dependency, checked by resolve_backend

    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=True)


KERNELS = {"eager": eager_attention, "sdpa": sdpa_attention, "flash": flash_attention,
           "flex": flex_attention_kernel}
# backend -> the builder of its document mask from document ids
MASK_BUILDERS = {"eager": dense_document_mask, "sdpa": dense_document_mask,
                 "flex": block_document_mask}
