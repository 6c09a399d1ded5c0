"""Checks on a composed config, run before any data, process group or tensor exists.

Each problem is one ``ConfigError`` that names the key and a fix. All problems found are
reported together, so a user fixes a recipe in one pass.
"""

from __future__ import annotations

import math

from pretrain.config import Config
from pretrain.model import ffn_dim, padded_vocab_size
from pretrain.parallel.layout import MULTI_STAGE_SCHEDULES, SCHEDULES, declared_world_size

POSITIVE = (
    "model.n_layer", "model.n_head", "model.d_model", "model.vocab_size", "model.seq_len",
    "model.pad_vocab_to", "train.global_batch_size", "parallel.micro_batch_size",
    "parallel.tp", "parallel.pp", "parallel.virtual_stages", "train.eval_batches",
    "logging.log_interval", "train.eval_interval", "data.shard_tokens",
    "train.stop_check_interval",
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


def check(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem with ``cfg``; return None when it is sound.

    A key's closed set of values is its type's (the ``Choice`` enums of pretrain.config,
    enforced at composition); what is checked here relates several keys or bounds a number.
    ``world_size`` is the number of processes launched, checked against the layout the
    recipe declares; None: WORLD_SIZE when a launcher set it, else the layout as declared
    (tp * pp * dp), which is what a dry run checks."""
    if world_size is None:
        world_size = declared_world_size(cfg)
    p: list[str] = []
    for key in POSITIVE:
        value = _get(cfg, key)
        if value is None or value <= 0:
            p.append(f"{key}={value} must be a positive integer")
    _check_model(cfg, p)
    _check_layout(cfg, world_size, p)
    _check_precision(cfg, p)
    _check_optim(cfg, p)
    if cfg.data.tokenizer == "bpe" and cfg.data.tokenizer_vocab_size > cfg.model.vocab_size:
        p.append(f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size} exceeds "
                 f"model.vocab_size={cfg.model.vocab_size}: token ids would fall outside the "
                 f"embedding; set model.vocab_size={cfg.data.tokenizer_vocab_size}")
    if p:
        raise ConfigError(p)


def _check_model(cfg: Config, p: list[str]) -> None:
    """The model's shape: heads against width, KV heads against heads, RoPE's head size."""
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


def _check_precision(cfg: Config, p: list[str]) -> None:
    prec = cfg.precision
    if prec.loss_scaling and prec.compute_dtype != "float16":
        p.append("precision.loss_scaling=true only makes sense with compute_dtype=float16")
    if prec.fp8 and prec.compute_dtype != "bfloat16":
        p.append(f"precision.fp8=true runs the non-fp8 parts in bf16; compute_dtype="
                 f"{prec.compute_dtype} is not supported with it: use precision=fp8 as is")


def _check_optim(cfg: Config, p: list[str]) -> None:
    """The LR, its schedule and the LR/batch rules against the budget."""
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        p.append(f"schedule.min_lr_ratio={cfg.schedule.min_lr_ratio} must be in [0, 1]")
    if cfg.schedule.warmup_steps is not None and cfg.schedule.warmup_tokens is not None:
        p.append("set schedule.warmup_steps or schedule.warmup_tokens, not both")
    if cfg.optim.lr <= 0:
        p.append(f"optim.lr={cfg.optim.lr} must be positive")
    for key, rule, law in (("optim.lr", cfg.optim.lr_rule, cfg.optim.lr_law),
                           ("train.batch", cfg.train.batch_rule, cfg.train.batch_law)):
        if rule == "power" and (law is None or len(law) != 2):
            p.append(f"{key}_rule=power needs {key}_law=[coef,exponent] ({key.split('.')[1]} "
                     "= coef x C^exponent; tools/scaling_law.py --hparams fits them)")
    if cfg.train.batch_rule != "fixed" and cfg.budget.kind == "steps":
        p.append("train.batch_rule needs a token budget (budget=tokens, chinchilla or flops): "
                 "with budget.kind=steps the tokens, and so the compute, depend on the batch")
    if not 0 <= cfg.train.noise_scale_ema < 1:
        p.append(f"train.noise_scale_ema={cfg.train.noise_scale_ema} must be in [0, 1)")
    if cfg.optim.lr_scaling != "none" and not cfg.optim.ref_batch_tokens:
        p.append(f"optim.lr_scaling={cfg.optim.lr_scaling} needs optim.ref_batch_tokens, the "
                 "global batch (in tokens) that optim.lr was tuned for")


def _check_layout(cfg: Config, world_size: int, p: list[str]) -> None:
    """The parallel layout against the world size, the model shape and the batch."""
    par, m = cfg.parallel, cfg.model
    if min(par.tp, par.pp, par.virtual_stages, par.micro_batch_size) <= 0:
        return  # already reported as non-positive
    tp, pp = par.tp, par.pp
    if par.dp is not None and par.dp <= 0:
        p.append(f"parallel.dp={par.dp} must be a positive integer (or null: world / (tp*pp))")
        return
    dp = par.dp if par.dp is not None else world_size // (tp * pp)
    if par.dp is None and (dp <= 0 or world_size % (tp * pp)):
        p.append(f"parallel.dp=null takes dp = world size / (tp x pp), but the world size "
                 f"{world_size} is not a multiple of tp={tp} x pp={pp} = {tp * pp}; launch a "
                 f"multiple of {tp * pp} processes or set parallel.dp")
        dp = max(dp, 1)
    elif par.dp is not None and tp * pp * dp != world_size:
        need = tp * pp * dp
        p.append(f"parallel layout tp={tp} x pp={pp} x dp={dp} needs {need} processes but the "
                 f"world size is {world_size}; launch {need} (torchrun --nproc_per_node={need}"
                 ", or tools/run_local.py) or change parallel.tp/pp/dp")

    if tp > 1:
        kv = m.n_kv_head or m.n_head
        if m.n_head % tp:
            p.append(f"model.n_head={m.n_head} is not divisible by parallel.tp={tp}: each TP "
                     f"rank holds whole heads; use a tp that divides {m.n_head}")
        if m.n_kv_head not in (None, m.n_head) and kv % tp:  # GQA; MHA is the line above
            p.append(f"model.n_kv_head={kv} is not divisible by parallel.tp={tp}: each TP rank "
                     f"holds whole key/value heads; use a tp that divides {kv} (or more KV heads)")
        vocab = padded_vocab_size(m)
        if vocab % tp:
            pad = math.lcm(tp, 64)
            p.append(f"the vocabulary ({vocab} rows) is not divisible by parallel.tp={tp} for "
                     f"the vocab-parallel embedding and head; pad it: model.pad_vocab_to={pad}")
        if ffn_dim(m) % tp:
            p.append(f"the MLP width {ffn_dim(m)} (model.d_ff) is not divisible by "
                     f"parallel.tp={tp}; choose a d_ff that is")
        if par.sequence_parallel and m.seq_len % tp:
            p.append(f"parallel.sequence_parallel shards model.seq_len={m.seq_len} over "
                     f"parallel.tp={tp}; use a seq_len divisible by {tp}")
    elif par.sequence_parallel:
        p.append("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the "
                 "sequence over the tensor-parallel ranks); set parallel.tp or turn it off")

    gbs, mbs = cfg.train.global_batch_size, par.micro_batch_size
    if gbs > 0 and gbs % (mbs * dp):
        p.append(f"train.global_batch_size={gbs} is not divisible by parallel.micro_batch_size"
                 f"={mbs} x dp={dp}; use a global batch that is a multiple of {mbs * dp}")
    microbatches = gbs // (mbs * dp) if gbs > 0 else 0

    if pp > 1 and par.pp_schedule in SCHEDULES:
        vs = par.virtual_stages
        multi = par.pp_schedule in MULTI_STAGE_SCHEDULES
        if par.pp_schedule == "zbv" and vs != 2:
            p.append(f"parallel.pp_schedule=zbv runs exactly 2 stages per rank (a V); set "
                     f"parallel.virtual_stages=2 (got {vs})")
        elif multi and vs < 2:
            p.append(f"parallel.pp_schedule={par.pp_schedule} needs parallel.virtual_stages "
                     f">= 2 stages per rank (got {vs}); or use pp_schedule=1f1b")
        elif not multi and vs != 1:
            p.append(f"parallel.pp_schedule={par.pp_schedule} runs one stage per rank; set "
                     f"parallel.virtual_stages=1 or use pp_schedule=interleaved_1f1b")
        if m.n_layer % (pp * vs):
            p.append(f"model.n_layer={m.n_layer} is not divisible by parallel.pp={pp} x "
                     f"parallel.virtual_stages={vs} = {pp * vs} pipeline stages; choose "
                     "pp/virtual_stages so every stage gets the same number of layers")
        if 0 < microbatches < pp:
            p.append(f"the pipeline gets {microbatches} microbatch(es) per step (global batch "
                     f"{gbs} / (micro batch {mbs} x dp {dp})) but {par.pp_schedule} needs at "
                     f"least parallel.pp={pp}; lower parallel.micro_batch_size or raise "
                     f"train.global_batch_size to {mbs * dp * pp}")
        elif multi and microbatches % max(1, microbatches // pp):
            p.append(f"{par.pp_schedule} needs the microbatches per step ({microbatches}) to "
                     f"be a multiple of {max(1, microbatches // pp)} (rounds of pp={pp}); "
                     f"use a multiple of pp")
        if par.pp_schedule == "zbv" and cfg.train.compile:
            p.append("parallel.pp_schedule=zbv splits backward into input and weight parts, "
                     "which torch.compile does not support; set train.compile=false")

    if par.dp_mode != "ddp" and dp > 0:
        rep = par.dp_replicate
        if rep <= 0 or dp % rep:
            p.append(f"parallel.dp_replicate={rep} must divide dp={dp} (HSDP: dp = "
                     "dp_replicate x dp_shard)")
        elif par.dp_shard is not None and par.dp_shard * rep != dp:
            p.append(f"parallel.dp_replicate={rep} x parallel.dp_shard={par.dp_shard} must "
                     f"equal dp={dp}; set dp_shard={dp // rep} (or leave it null)")
    if par.ac_every_n_layers < 0:
        p.append(f"parallel.ac_every_n_layers={par.ac_every_n_layers} must be >= 0")
