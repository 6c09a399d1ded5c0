"""Checks on a composed config, run before any data, process group or tensor exists.

Each problem is one ``ConfigError`` that names the key and a fix. All problems found are
reported together, so a user fixes a recipe in one pass.
"""

from __future__ import annotations

from pretrain.attention import BACKENDS
from pretrain.config import Config

CHOICES = {
    "model.pos_emb": ("learned", "rope"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.mlp": ("gelu", "swiglu"),
    "model.attention": BACKENDS,
    "budget.kind": ("tokens", "tokens_per_param", "flops", "steps"),
    "budget.param_count": ("total", "non_embedding"),
    "optim.lr_scaling": ("none", "sqrt", "linear"),
    "schedule.decay": ("cosine", "linear", "wsd", "constant"),
    "parallel.dp_mode": ("ddp", "zero2", "zero3"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b", "zbv"),
    "parallel.activation_checkpointing": ("none", "selective", "full"),
    "precision.param_dtype": ("float32", "bfloat16", "float16"),
    "precision.compute_dtype": ("float32", "bfloat16", "float16"),
    "precision.reduce_dtype": ("float32", "bfloat16", "float16"),
    "precision.fp8_recipe": ("tensorwise", "rowwise"),
    "logging.wandb": ("disabled", "offline", "online"),
}

POSITIVE = (
    "model.n_layer", "model.n_head", "model.d_model", "model.vocab_size", "model.seq_len",
    "model.pad_vocab_to", "train.global_batch_size", "parallel.micro_batch_size",
    "parallel.tp", "parallel.pp", "parallel.virtual_stages", "train.eval_batches",
    "logging.log_interval", "train.eval_interval", "data.shard_tokens",
)


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check(cfg: Config, world_size: int = 1) -> None:
    """Raise ConfigError listing every problem with ``cfg``; return None when it is sound."""
    p: list[str] = []
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            p.append(f"{key}={value!r} is not one of: {', '.join(allowed)}")
    for key in POSITIVE:
        value = _get(cfg, key)
        if value is None or value <= 0:
            p.append(f"{key}={value} must be a positive integer")
    m = cfg.model
    if m.n_head > 0 and m.d_model > 0 and m.d_model % m.n_head:
        p.append(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                 f"pick a head count that divides it (e.g. {m.d_model // 64 or 1} heads of 64)")
    kv = m.n_kv_head or m.n_head
    if kv <= 0 or (m.n_head > 0 and m.n_head % kv):
        p.append(f"model.n_kv_head={m.n_kv_head} must be positive and divide "
                 f"model.n_head={m.n_head}")
    if m.pos_emb == "rope" and m.n_head > 0 and (m.d_model // m.n_head) % 2:
        p.append("RoPE needs an even head dimension (model.d_model / model.n_head)")
    if m.d_ff is not None and m.d_ff <= 0:
        p.append(f"model.d_ff={m.d_ff} must be positive (or null for the default width)")
    if not 0 <= m.dropout < 1:
        p.append(f"model.dropout={m.dropout} must be in [0, 1)")

    par = cfg.parallel
    tp, pp = max(par.tp, 1), max(par.pp, 1)
    dp = par.dp if par.dp is not None else world_size // (tp * pp)
    if dp <= 0 or tp * pp * dp != world_size:
        p.append(f"parallel layout tp={par.tp} x pp={par.pp} x dp={par.dp} needs "
                 f"{tp * pp * max(dp, 1)} processes but the world size is {world_size}; "
                 f"launch that many processes or change parallel.tp/pp/dp")
    gbs, mbs = cfg.train.global_batch_size, par.micro_batch_size
    if gbs > 0 and mbs > 0 and dp > 0 and gbs % (mbs * dp):
        p.append(f"train.global_batch_size={gbs} is not divisible by parallel.micro_batch_size"
                 f"={mbs} x dp={dp}; use a global batch that is a multiple of {mbs * dp}")

    prec = cfg.precision
    if prec.loss_scaling and prec.compute_dtype != "float16":
        p.append("precision.loss_scaling=true only makes sense with compute_dtype=float16")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        p.append(f"schedule.min_lr_ratio={cfg.schedule.min_lr_ratio} must be in [0, 1]")
    if cfg.schedule.warmup_steps is not None and cfg.schedule.warmup_tokens is not None:
        p.append("set schedule.warmup_steps or schedule.warmup_tokens, not both")
    if cfg.optim.lr <= 0:
        p.append(f"optim.lr={cfg.optim.lr} must be positive")
    if cfg.optim.lr_scaling != "none" and not cfg.optim.ref_batch_tokens:
        p.append(f"optim.lr_scaling={cfg.optim.lr_scaling} needs optim.ref_batch_tokens, the "
                 "global batch (in tokens) that optim.lr was tuned for")
    if cfg.data.tokenizer == "bpe" and cfg.data.tokenizer_vocab_size > m.vocab_size:
        p.append(f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size} exceeds "
                 f"model.vocab_size={m.vocab_size}: token ids would fall outside the embedding;"
                 f" set model.vocab_size={cfg.data.tokenizer_vocab_size}")
    if p:
        raise ConfigError(p)
