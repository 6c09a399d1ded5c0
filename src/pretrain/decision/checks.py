"""Checks on a composed config, run before any data, process group or tensor exists.

Each problem is one ``ConfigError`` that names the key and a fix. All problems found are
reported together, so a user fixes a recipe in one pass.
"""

from __future__ import annotations

import math

from pretrain.budget.compute import Budget
from pretrain.config.schema import Config, ConfigError
from pretrain.data.mixture_checks import mixture_problems
from pretrain.data.sources import LOCAL_FORMATS
from pretrain.decision.schedule_checks import check_schedule
from pretrain.model.parametrization import problems as parametrization_problems
from pretrain.optim.specs import (
    ignored_key_warnings,
    lr_out_of_range_problem,
    lr_rule_problems,
    mup_problems,
    name_problems,
)
from pretrain.parallel.layout import declared_world_size
from pretrain.parallel.rules import layout_problems

POSITIVE = (
    "model.n_layer", "model.n_head", "model.d_model", "model.vocab_size", "model.seq_len",
    "model.pad_vocab_to", "train.global_batch_size", "parallel.micro_batch_size",
    "parallel.tp", "parallel.pp", "parallel.virtual_stages", "train.eval_batches",
    "logging.log_interval", "train.eval_interval", "data.shard_tokens",
    "train.stop_check_interval",
)


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem with ``cfg``; return None when it is sound.

    A key's closed set of values is its type's (the ``Choice`` enums of pretrain.config.schema,
    enforced at composition); what is checked here relates several keys or bounds a number.
    ``world_size`` is the number of processes launched, checked against the layout the
    recipe declares; None: WORLD_SIZE when a launcher set it, else the layout as declared
    (tp * pp * dp), which is what a dry run checks."""
    if unknown := name_problems(cfg.optim.name):  # everything below reads its spec
        raise ConfigError(unknown)
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
    p.extend(mixture_problems(cfg.data, cfg.schedule.decay))
    _check_tasks(cfg, p)
    _check_stability(cfg, p)
    _check_profile(cfg, p)
    if (not cfg.data.mixture and cfg.data.tokenizer == "bpe"
            and cfg.data.tokenizer_vocab_size > cfg.model.vocab_size):
        p.append(f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size} exceeds "
                 f"model.vocab_size={cfg.model.vocab_size}: token ids would fall outside the "
                 f"embedding; set model.vocab_size={cfg.data.tokenizer_vocab_size}")
    if cfg.data.source in LOCAL_FORMATS and not cfg.data.data_files:
        p.append(f"data.source={cfg.data.source} reads local files but data.data_files is "
                 "empty; set data.data_files='[path/to/file, ...]' (globs allowed)")
    if p:
        raise ConfigError(p)


def head_suggestion(d_model: int) -> str:
    """A head count that divides ``d_model``, its heads nearest 64 wide (GPT's):
    ``12 heads of 64`` for 768, ``2 heads of 50`` for 100."""
    heads = min((h for h in range(1, d_model + 1) if d_model % h == 0),
                key=lambda h: (abs(d_model // h - 64), h))
    return f"{heads} head{'s' if heads > 1 else ''} of {d_model // heads}"


def device_problems(cfg: Config, device) -> None:
    """Keys the run's device cannot serve, refused before any work: a CUDA memory
    snapshot on a CPU run."""
    if cfg.profile.memory_snapshot and device.type != "cuda":
        raise ConfigError([f"profile.memory_snapshot=true needs a CUDA device (this run's is "
                           f"{device.type}): it records CUDA's caching allocator; drop the "
                           "key, or run on a GPU"])


def _check_profile(cfg: Config, p: list[str]) -> None:
    """The profiler's window and activities."""
    pr = cfg.profile
    if pr.active < 1 or min(pr.wait, pr.warmup, pr.repeat, pr.skip_first) < 0:
        p.append(f"profile.active={pr.active} must be at least 1 and profile.wait, warmup, "
                 "repeat, skip_first at least 0")
    if bad := [a for a in pr.activities if a not in ("cpu", "cuda")]:
        p.append(f"profile.activities has {bad}: the activities are cpu and cuda")
    if cfg.comm.init_timeout_s <= 0 or cfg.comm.train_timeout_s <= 0:
        p.append("comm.init_timeout_s and comm.train_timeout_s must be positive (seconds)")


def _check_model(cfg: Config, p: list[str]) -> None:
    """The model's shape: heads against width, KV heads against heads, RoPE's head size."""
    m = cfg.model
    if m.n_head > 0 and m.d_model > 0 and m.d_model % m.n_head:
        p.append(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                 f"pick a head count that divides it (e.g. {head_suggestion(m.d_model)})")
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
    p.extend(parametrization_problems(m))
    p.extend(mup_problems(str(m.parametrization), cfg.optim.name))
    _check_moe(cfg, p)


def _check_moe(cfg: Config, p: list[str]) -> None:
    """A mixture of experts' routing against its expert count; compile needs bf16."""
    m = cfg.model
    if not m.moe_experts:
        return
    # Under expert parallelism the experts run eager (parallel/apply.compile_block).
    if (
        cfg.train.compile
        and cfg.parallel.ep == 1
        and cfg.precision.name != "auto"
        and cfg.precision.compute_dtype != "bfloat16"
    ):
        p.append(f"train.compile with a mixture of experts needs bf16 compute (the grouped "
                 f"GEMMs compile in bf16 only; precision={cfg.precision.name} computes in "
                 f"{cfg.precision.compute_dtype}): use precision=bf16, train.compile=false, "
                 f"or parallel.ep > 1 (the experts then run eager)")
    if m.moe_experts < 0 or not 1 <= m.moe_top_k <= m.moe_experts:
        p.append(f"model.moe_top_k={m.moe_top_k} must be between 1 and model.moe_experts="
                 f"{m.moe_experts} (each token goes to top_k of the experts)")
    if not 0 <= m.moe_first_dense < m.n_layer:
        p.append(f"model.moe_first_dense={m.moe_first_dense} must leave at least one of the "
                 f"{m.n_layer} layers an MoE layer (0 = every layer)")
    for key in ("moe_aux_coeff", "moe_z_coeff", "moe_bias_rate"):
        if getattr(m, key) < 0:
            p.append(f"model.{key}={getattr(m, key)} must be >= 0")
    if m.moe_d_ff is not None and m.moe_d_ff <= 0:
        p.append(f"model.moe_d_ff={m.moe_d_ff} must be positive (or null for d_ff's width)")


def _check_precision(cfg: Config, p: list[str]) -> None:
    prec = cfg.precision
    if prec.loss_scaling and prec.compute_dtype != "float16":
        p.append("precision.loss_scaling=true only makes sense with compute_dtype=float16")
    if prec.fp8 and prec.compute_dtype != "bfloat16":
        p.append(f"precision.fp8=true runs the non-fp8 parts in bf16; compute_dtype="
                 f"{prec.compute_dtype} is not supported with it: use precision=fp8 as is")


def _check_optim(cfg: Config, p: list[str]) -> None:
    """The LR, its schedule and the LR/batch rules against the budget."""
    if not 0 < cfg.schedule.decay_fraction <= 1:
        p.append(f"schedule.decay_fraction={cfg.schedule.decay_fraction} must be in (0, 1]: "
                 "the fraction of the steps a WSD schedule decays over (0.2 is common)")
    if cfg.schedule.decay_shape != "linear" and cfg.schedule.decay != "wsd":
        p.append(f"schedule.decay_shape={cfg.schedule.decay_shape} shapes WSD's decay only: "
                 f"use schedule=wsd, or drop it (decay={cfg.schedule.decay})")
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
    if cfg.train.update_ratio_interval < 0:
        p.append(f"train.update_ratio_interval={cfg.train.update_ratio_interval} must be >= 0 "
                 "(0: off; N: the update-to-weight ratios on logging steps that are multiples "
                 "of N)")
    p.extend(lr_rule_problems(cfg.optim))
    if cfg.optim.lr_rule == "fixed" and (why := lr_out_of_range_problem(cfg.optim)):
        p.append(why)
    if cfg.optim.momentum is not None and not 0 <= cfg.optim.momentum < 1:
        p.append(f"optim.momentum={cfg.optim.momentum} must be in [0, 1)")
    if cfg.optim.ns_steps < 1:
        p.append(f"optim.ns_steps={cfg.optim.ns_steps} must be at least 1 (5 is torch's)")
    if cfg.optim.lr_scaling != "none" and not cfg.optim.ref_batch_tokens:
        p.append(f"optim.lr_scaling={cfg.optim.lr_scaling} needs optim.ref_batch_tokens, the "
                 "global batch (in tokens) that optim.lr was tuned for")


def run_warnings(cfg: Config, budget: Budget) -> list[str]:
    """Every warning of the decision, in one list (the plan's ``warnings``, logged by the run,
    printed as ``warning:`` lines by the dry run and tools/plan.py): an optim.* key the user
    changed that the chosen optimizer does not read (its spec's ``reads``), then the
    schedule's (decision/schedule_checks.py, which raises for what it refuses). The run goes
    on; each line names the key and the fix."""
    return [*ignored_key_warnings(cfg.optim), *check_schedule(cfg, budget)]


def _check_stability(cfg: Config, p: list[str]) -> None:
    """train.z_loss and the spike guard (optim.spike_*)."""
    z, o = cfg.train.z_loss, cfg.optim
    if z < 0:
        p.append(f"train.z_loss={z} must be >= 0 (0: off; OLMo-3 uses 1e-5, PaLM 1e-4)")
    p.extend(z_loss_bound_problems(cfg))
    if z > 0 and cfg.parallel.tp > 1:
        p.append(f"train.z_loss={z} is not computed on vocabulary-sharded logits "
                 f"(parallel.tp={cfg.parallel.tp}, loss_parallel): set train.z_loss=0, or "
                 "train with parallel.tp=1 (FSDP/DDP/pipeline layouts take z-loss)")
    if not o.spike_guard:
        return
    if o.spike_sigmas <= 0:
        p.append(f"optim.spike_sigmas={o.spike_sigmas} must be positive (6 is OLMo-core's)")
    if o.spike_window < 2 or o.spike_warmup < 2:
        p.append(f"optim.spike_window={o.spike_window} and optim.spike_warmup="
                 f"{o.spike_warmup} must be at least 2 (a standard deviation needs two steps)")
    elif o.spike_warmup > o.spike_window:
        p.append(f"optim.spike_warmup={o.spike_warmup} exceeds optim.spike_window="
                 f"{o.spike_window}: the window never holds that many steps; set "
                 f"optim.spike_warmup={o.spike_window // 2}")
    if cfg.precision.loss_scaling:
        p.append("optim.spike_guard=true with fp16 loss scaling: the scaler skips steps "
                 "itself; use precision=bf16 (no loss scaling), or optim.spike_guard=false")


# 100x PaLM's 1e-4: z_loss x logsumexp^2 with logsumexp ~ ln(vocab) (about 10.8 for 50k
# tokens) at init already adds 1.2 nats here, as much as the cross-entropy late in training.
Z_LOSS_MAX = 1e-2


def z_loss_bound_problems(cfg: Config) -> list[str]:
    """train.z_loss above Z_LOSS_MAX: the penalty on log Z would outweigh the loss itself."""
    z = cfg.train.z_loss
    if z <= Z_LOSS_MAX:
        return []
    at_init = z * math.log(max(2, cfg.model.vocab_size)) ** 2
    return [f"train.z_loss={z:g} is above {Z_LOSS_MAX:g} (100x PaLM's 1e-4): z_loss x "
            f"logsumexp(logits)^2 is about {at_init:.3g} at init with model.vocab_size="
            f"{cfg.model.vocab_size}, outweighing the cross-entropy (~"
            f"{math.log(max(2, cfg.model.vocab_size)):.1f}); use train.z_loss=1e-4 (PaLM) or "
            "1e-5 (OLMo-3)"]


def _check_layout(cfg: Config, world_size: int, p: list[str]) -> None:
    """The parallel layout against the world size, the model shape and the batch: the
    rules of ``parallel.rules``, which the ``parallel=auto`` search filters with too."""
    p.extend(layout_problems(cfg, world_size))


def _check_tasks(cfg: Config, p: list[str]) -> None:
    """Downstream tasks: scored at evaluation points, on layouts that hold whole logits."""
    e = cfg.eval
    if not e.tasks:
        return
    if e.max_examples <= 0:
        p.append(f"eval.max_examples={e.max_examples} must be a positive integer")
    if e.batch_size < 0:
        p.append(f"eval.batch_size={e.batch_size} must be >= 0 (0: parallel.micro_batch_size)")
    if e.task_interval < 0 or e.task_interval % cfg.train.eval_interval:
        p.append(f"eval.task_interval={e.task_interval} must be a multiple of "
                 f"train.eval_interval={cfg.train.eval_interval} (tasks are scored at "
                 "evaluation points), or 0 for every one")
    if cfg.parallel.pp > 1:
        p.append(f"eval.tasks={list(e.tasks)} with parallel.pp={cfg.parallel.pp}: task "
                 "scoring under pipeline parallelism is not implemented yet; score the "
                 "checkpoint afterwards with tools/evaluate.py, or set eval.tasks=[]")
