"""What document-aware attention (model.attention_mask=document) costs: its attention work
and its mask's memory, as the planner counts them.

The model's FLOP count (budget/compute.py: 12 L d T a token for attention, causal or not)
stays the model's: it is the scaling law's x. What changes is the hardware's work:

- ``flex`` (CUDA, FlexAttention's block mask): the kernel skips every 128 x 128 block that
  is wholly masked. Documents of mean length D in a window of T tokens leave about
  (D + 128)^2 / (D T) of the causal blocks (each document its own triangle of blocks, one
  partial block row and column at each boundary); at most 1. D is the prepared training
  split's tokens per document (index.json), or unknown (then 1: the causal work, an upper
  bound). The block mask itself: a few int32 tensors of (batch, T/128, T/128).
- ``sdpa`` / ``eager`` (the CPU, or asked for on a GPU): a dense boolean mask, so no block is
  skipped (SDPA with an ``attn_mask`` does every query-key pair; the causal count is what
  the planner charges for causal attention already): work 1, and the mask's memory, seq x
  seq bytes a micro batch, built once a forward and shared by every layer.

Both keep a micro batch's document ids (int32) and positions (int64) on every stage, and
under RoPE the per-token rotary tables (2 x head_dim fp32 a token).
"""

from __future__ import annotations

import json

from pretrain.config.schema import Config
from pretrain.data.prepare import INDEX, data_dir

BLOCK = 128  # FlexAttention's default block size (torch 2.13)


def is_document(cfg: Config) -> bool:
    return cfg.model.attention_mask == "document"


def document_kernel(cfg: Config, device: str = "cuda") -> str:
    """The kernel ``auto`` resolves to (model/attention.resolve_document_backend)."""
    if cfg.model.attention == "auto":
        return "flex" if device == "cuda" else "sdpa"
    return str(cfg.model.attention)


def mean_document_tokens(cfg: Config) -> float | None:
    """Tokens per document of the prepared training split, or None when not prepared."""
    path = data_dir(cfg.data) / INDEX
    if not path.exists():
        return None
    train = json.loads(path.read_text())["splits"].get("train", {})
    docs = train.get("documents") or 0
    return train.get("tokens", 0) / docs if docs else None


def attention_work(cfg: Config, device: str = "cuda") -> float:
    """The share of causal attention's work document masking does (1 without it)."""
    if not is_document(cfg) or document_kernel(cfg, device) != "flex":
        return 1.0
    d, t = mean_document_tokens(cfg), cfg.model.seq_len
    if d is None or d >= t:
        return 1.0
    return min(1.0, (d + BLOCK) ** 2 / (d * t))


def mask_bytes(cfg: Config, micro_batch: int, device: str = "cuda") -> float:
    """Bytes one micro batch's document mask, ids, positions (and RoPE rows) hold."""
    if not is_document(cfg):
        return 0.0
    m = cfg.model
    t = m.seq_len
    per_token = 4 + 8 + (2 * (m.d_model // m.n_head) * 4 if m.pos_emb == "rope" else 0)
    if document_kernel(cfg, device) == "flex":
        blocks = -(-t // BLOCK)
        mask = 4 * 4 * blocks * blocks  # kv counts and indices, full and partial blocks
    else:
        mask = t * t
    return micro_batch * (t * per_token + mask)


def describe(cfg: Config, micro_batch: int, device: str = "cuda") -> str | None:
    """The plan's line on document masking (None without it)."""
    if not is_document(cfg):
        return None
    kernel = document_kernel(cfg, device)
    work, d = attention_work(cfg, device), mean_document_tokens(cfg)
    docs = f"{d:,.0f} tokens a document (prepared data)" if d else "document length unknown"
    what = (f"FlexAttention block mask skips wholly masked {BLOCK}x{BLOCK} blocks: "
            f"{work:.0%} of the causal attention work counted ({docs})"
            if kernel == "flex" else
            f"{kernel} with a dense boolean mask: the causal attention work counted in full, "
            f"no block skipped")
    return (f"attention block-causal within documents (model.attention_mask=document, end "
            f"token model.eod_id={cfg.model.eod_id}, positions restart): {what}; mask, ids "
            f"and positions {mask_bytes(cfg, micro_batch, device) / 2**20:,.2f} MiB a micro "
            f"batch of {micro_batch}")
