"""The one decision path before a run: a config plus a device (this machine's, or a GPU
type of the planner's table) in, the resolved config and its plan out.

The real run (trainer.py), the dry run (``dry_run=true``) and ``tools/plan.py`` all call
it, so they cannot disagree about what ``auto`` means. The ``auto`` settings are decided in
one order, because each depends on the one before: precision from the device, then LR and
batch from their compute rules (src/pretrain/budget/hparams.py), then the layout
(``parallel=auto``: planning/autolayout.choose_layout), whose memory depends on both.
Nothing here touches weights or a process group; of data, only the task files of
``eval.tasks`` are read (decision/tasks.py: a missing one stops the run here).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

import torch

from pretrain.budget.batch_ramp import RampError, RampSpec, ramp_spec
from pretrain.budget.batch_ramp import describe as describe_ramp
from pretrain.budget.batch_ramp import describe_line as describe_ramp_line
from pretrain.budget.compute import Budget, resolve_budget
from pretrain.budget.hparams import apply_rules, describe, hparam_compute
from pretrain.checkpoint.branch import check_branch_config
from pretrain.checkpoint.manager import describe_policy
from pretrain.config.decision import RunDecision, SourceShare, WeightStage
from pretrain.config.schema import Config, ConfigError
from pretrain.data.epochs import check_epochs, check_mixture_epochs
from pretrain.data.source_checks import missing_file_problems
from pretrain.data.weights import source_shares, weight_stages
from pretrain.decision.checks import check, run_warnings
from pretrain.decision.tasks import describe_line as describe_tasks_line
from pretrain.decision.tasks import describe_tasks
from pretrain.hardware.device import pick_device
from pretrain.hardware.gpus import GpuSpec
from pretrain.model.attention import resolve_backend
from pretrain.model.parametrization import describe as describe_parametrization
from pretrain.optim.factory import scaled_lr, wsd_decay_start
from pretrain.optim.specs import lr_range_warning
from pretrain.parallel.activation_checkpoint import describe as describe_checkpointing
from pretrain.parallel.layout import (
    Layout,
    declared_world_size,
    resolve_layout,
    world_size_from_env,
)
from pretrain.parallel.mesh import env_rank
from pretrain.planning.document import describe as describe_documents
from pretrain.precision.policy import Policy, resolve_auto_precision, resolve_policy

log = logging.getLogger("pretrain")
# The order the ``auto`` settings are decided in (each depends on the ones before it).
AUTO_ORDER = ("precision", "hparam_rules", "parallel")
# Layout candidates a plan lists for parallel=auto, best first.
TOP_CANDIDATES = 5


def resolve_auto(cfg: Config, world_size: int, device: torch.device | GpuSpec | None = None,
                 top: int = TOP_CANDIDATES) -> tuple[Config, dict]:
    """``cfg`` with every ``auto`` setting decided for ``world_size`` processes on
    ``device`` (default: this machine's, ``train.device``), in ``AUTO_ORDER``, and what was
    decided, for the plan (``precision_auto``, ``hparam_rules``, ``parallel_auto``: the
    ``top`` layout candidates, and ``auto_why``). Deterministic per machine kind, so every
    rank decides the same."""
    if device is None:
        device = pick_device(cfg.train.device)
    notes: dict = {}
    cfg, why = resolve_auto_precision(cfg, device)
    if why:
        notes["precision_auto"] = why
    # LR and batch from their rules before the layout: parallel=auto then lays out the
    # batch the rule gave (rounded to the declared micro batch x dp)
    cfg, rules = apply_rules(cfg, world_size)
    if rules:
        notes["hparam_rules"] = rules
    cfg, candidates = _auto_layout(cfg, world_size, device, top)
    if candidates:
        from pretrain.planning.autolayout import why_first

        notes["parallel_auto"] = [c.summary() for c in candidates]
        notes["auto_why"] = why_first(candidates)
    return cfg, notes


def _auto_layout(cfg: Config, world_size: int, device: torch.device | GpuSpec, top: int
                 ) -> tuple[Config, list]:
    """``parallel=auto``: ``cfg`` with the layout ``choose_layout`` picks for this world
    size and device (a GPU type, or this machine's: ``local_gpu``), and the ranked
    candidates; unchanged, and no candidates, otherwise."""
    if cfg.parallel.name != "auto":
        return cfg, []
    from pretrain.hardware.gpus import local_gpu
    from pretrain.planning.autolayout import choose_layout, with_parallel

    gpu = device if isinstance(device, GpuSpec) else local_gpu(device.type, world_size)
    parallel, candidates = choose_layout(cfg, world_size, gpu, top)
    return with_parallel(cfg, parallel), candidates


def decide(cfg: Config, budget: Budget, attention: str | None = None,
           branch_points: tuple[int, ...] = ()) -> RunDecision:
    """The values a run reads back (config/decision.RunDecision): the LR its rule gives for
    the batch, and for a mixture its weights over the run's steps and what the budget
    takes from each source; ``attention``: the backend resolved for the device (None: no
    device, the planner's facts); ``branch_points``: check_branch_config's. ConfigError,
    before any work, when a mixture source still to prepare names local files that are
    not there."""
    if missing := missing_file_problems(cfg.data):
        raise ConfigError(missing)
    stages = mixture_stages(cfg, budget.steps) if cfg.data.mixture else ()
    shares = source_shares(cfg.data, stages, cfg.train.global_batch_size, budget.steps,
                           cfg.model.seq_len) if stages else ()
    return RunDecision(
        lr=scaled_lr(cfg.optim, budget.global_batch_tokens), attention=attention,
        precision=cfg.precision.name, branch_points=branch_points,
        branch_from=cfg.checkpoint.branch_from or None, mixture_stages=stages, sources=shares)


def describe_run(cfg: Config, world_size: int, budget: Budget,
                 decision: RunDecision | None = None) -> dict:
    """The plan's facts that do not depend on the device: what every plan states, the
    run's and ``tools/plan.py``'s (which extends it with memory, cost and time), around
    ``decision``'s own keys (RunDecision.as_plan; None: decided here, without a device);
    ``lr_warning`` only when the LR is outside the optimizer's usual range."""
    decision = decision or decide(cfg, budget)
    warning = lr_range_warning(cfg.optim.name, decision.lr)
    ramp = resolve_ramp(cfg, resolve_layout(cfg, world_size), budget)
    return {
        **budget.as_dict(),
        "compile": cfg.train.compile,
        "layout": resolve_layout(cfg, world_size).as_dict(),
        "activation_checkpointing": describe_checkpointing(
            cfg.model, cfg.parallel.activation_checkpointing, cfg.parallel.ac_every_n_layers,
            cfg.parallel.sequence_parallel and cfg.parallel.tp > 1),
        "model": cfg.model.name,
        # the width and parametrisation tools/scaling_law.py --transfer groups runs by
        "width": cfg.model.d_model,
        "parametrization": str(cfg.model.parametrization),
        **describe_parametrization(cfg.model),  # its multipliers, under mup/completep
        "data": cfg.data.name,
        **describe_data(cfg, budget, decision.sources),
        **({"lr_warning": warning} if warning else {}),
        "checkpoint": describe_policy(cfg.checkpoint),
        "global_batch_size": cfg.train.global_batch_size,
        # C in DeepSeek's convention (non-embedding FLOPs/token x tokens), the x of the
        # hyperparameter rules (src/pretrain/budget/hparams.py); tools/scaling_law.py --hparams
        # groups a sweep's runs by it
        "hparam_compute": hparam_compute(cfg)[0],
        **decision.as_plan(),
        **({"batch_ramp": describe_ramp(ramp, decision.lr, budget.steps,
                                        cfg.batch_ramp.start_tokens)} if ramp else {}),
    }


def mixture_stages(cfg: Config, steps: int) -> tuple[WeightStage, ...]:
    """A mixture's weights over the run's ``steps``: data.stages, and data.cooldown_weights
    from the WSD decay start (ConfigError when a stage would fall inside the decay)."""
    start = wsd_decay_start(steps, cfg.schedule) if cfg.schedule.decay == "wsd" else None
    late = [st.step for st in cfg.data.stages if start is not None and st.step >= start]
    if cfg.data.cooldown_weights and late:
        raise ConfigError([f"data.stages at steps {late} fall in the decay (from step {start} "
                           "of this WSD run), where data.cooldown_weights applies: move them "
                           "before it, or fold them into data.cooldown_weights"])
    return weight_stages(cfg.data, start)


def describe_data(cfg: Config, budget: Budget, shares: tuple[SourceShare, ...]) -> dict:
    """The plan's data entries: the corpus's size and epochs; for a mixture (``shares``:
    per source, decide's), per source too (``data_sources``)."""
    if not cfg.data.mixture:
        return check_epochs(cfg.data, budget.tokens)
    return check_mixture_epochs(cfg.data, shares)


def resolve_plan(cfg: Config, world_size: int | None = None) -> Resolved:
    """Everything a run on this machine decides before it starts: its decision, plan (the
    report), budget, device, precision policy and layout. ``world_size`` None: the layout
    as declared (see decision/checks.py's check)."""
    if world_size is None:
        world_size = declared_world_size(cfg)
    check(cfg, world_size)
    branch_points = check_branch_config(cfg)  # cooldown branches: their keys, their steps
    device = pick_device(cfg.train.device)
    cfg, auto_precision = resolve_auto_precision(cfg, device)
    policy = resolve_policy(cfg.precision, device)
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    warnings = run_warnings(cfg, budget)  # keys ignored; the schedule against the steps
    decision = decide(cfg, budget, resolve_backend(
        cfg.model.attention, device, policy.compute_dtype, cfg.model.attention_mask == "document"),
        branch_points)
    plan = {**describe_run(cfg, world_size, budget, decision), "device": str(device)}
    documents = describe_documents(cfg, cfg.parallel.micro_batch_size, device.type)
    if documents:  # model.attention_mask=document: what the planner counts for it
        plan["attention_mask"] = documents
    if auto_precision:
        plan["precision_auto"] = auto_precision
    if warnings:
        plan["warnings"] = warnings
    tasks = describe_tasks(cfg, budget)  # a missing task stops the run here, as the dry run
    if tasks:
        plan["eval_tasks"] = tasks
    if policy.fp8:
        plan["fp8"] = cfg.precision.fp8_recipe + (" (emulated)" if policy.fp8_emulate else "")
        if not cfg.train.compile and not policy.fp8_emulate:
            log.warning("precision=fp8 with train.compile=false: torchao's float8 casts run "
                        "as separate eager kernels, usually slower than bf16; set "
                        "train.compile=true (torchao's and torchtitan's advice)")
    if device.type == "cuda":
        plan["tf32"] = cfg.train.tf32
    layout = resolve_layout(cfg, world_size)
    ramp = resolve_ramp(cfg, layout, budget)
    return Resolved(cfg, decision, plan, budget, device, policy, layout, world_size, ramp)


def resolve_ramp(cfg: Config, layout: Layout, budget: Budget) -> RampSpec | None:
    """The run's batch ramp (budget/batch_ramp.py) on ``layout``; RampError for what it
    does not support yet, before any work."""
    spec = ramp_spec(cfg, layout, budget.steps)
    if spec is None:
        return None
    if spec.kind == "noise_scale" and layout.pp > 1:
        raise RampError("batch_ramp=noise_scale needs the noise scale, which is not measured "
                        "under pipeline parallelism (parallel.pp > 1): use batch_ramp=tokens")
    if cfg.data.mixture and spec.kind == "noise_scale":
        raise RampError("batch_ramp=noise_scale with a data.mixture is not supported yet (the "
                        "mixer's batches must be known before the run): use batch_ramp=tokens")
    if cfg.checkpoint.branch_from or cfg.checkpoint.branch_tokens_per_param:
        raise RampError("batch_ramp with cooldown branches (checkpoint.branch_from, "
                        "checkpoint.branch_tokens_per_param) is not supported yet: their "
                        "points are in steps of the full batch")
    if spec.kind == "noise_scale" and cfg.train.compile and spec.start == spec.unit:
        raise RampError("batch_ramp=noise_scale starting at one micro batch per rank with "
                        "train.compile=true cannot measure the noise scale (the measuring "
                        "step's half micro batch is a new shape): raise "
                        "batch_ramp.start_tokens to 2 micro batches x dp")
    return spec


@dataclass
class Resolved:
    """A run as decided before it starts: what its parts read (``decision``, the budget,
    device, policy and layout, all typed) and what it reports (``plan``)."""

    cfg: Config  # every ``auto`` replaced by its decision
    decision: RunDecision
    plan: dict  # the report: plan.json and the first log line; written, never read back
    budget: Budget
    device: torch.device
    policy: Policy
    layout: Layout
    world_size: int
    ramp: RampSpec | None = None  # the batch ramp (batch_ramp=none: None)


def resolve_run(cfg: Config, world_size: int | None = None) -> Resolved:
    """The whole path for a run on this machine: ``auto`` decided, then the plan (with the
    ``auto`` notes in it). ``world_size`` None: this process's, from the launcher's
    environment (1 without one)."""
    if world_size is None:
        world_size = world_size_from_env()
    cfg, notes = resolve_auto(cfg, world_size)
    run = resolve_plan(cfg, world_size)
    run.plan.update(notes)
    return run


def announce(run: Resolved, device: torch.device, notes: tuple[str, ...] = ()) -> None:
    """A run's first log lines: the plan, the decisions taken for ``auto`` settings,
    ``notes`` (what the services will measure), and the run in one line (``device``: this
    process's, once it has joined)."""
    cfg, budget, plan, layout = run.cfg, run.budget, run.plan, run.layout
    log.info("plan: %s", json.dumps(plan))
    if "precision_auto" in plan:
        log.info("precision=auto -> %s", plan["precision_auto"])
    if "lr_warning" in plan:
        log.warning(plan["lr_warning"])
    for warning in plan.get("warnings", ()):
        log.warning(warning)
    if "hparam_rules" in plan:
        log.info(describe(plan["hparam_rules"]))
    if "batch_ramp" in plan:
        log.info(describe_ramp_line(plan["batch_ramp"]))
    for note in notes:
        log.info(note)
    log.info(
        "model %s: %s params (%s non-embedding%s%s), %s FLOPs/token | budget %s -> %s "
        "tokens in %d steps of %s tokens | precision %s | attention %s%s | layout %s | "
        "device %s",
        cfg.model.name, f"{budget.n_params:,}", f"{budget.n_params_non_embedding:,}",
        f"; {budget.n_params_active:,} active per token"
        if budget.n_params_active != budget.n_params else "",
        f"; + {budget.n_params_padding:,} in the vocabulary padded to "
        f"{cfg.model.pad_vocab_to}" if budget.n_params_padding else "",
        f"{budget.flops_per_token:,}", budget.rule, f"{budget.tokens:,}",
        budget.steps, f"{budget.global_batch_tokens:,}",
        " ".join(filter(None, [run.decision.precision, plan.get("fp8"),
                               "(auto)" if "precision_auto" in plan else None])),
        " ".join(filter(None, [run.decision.attention, plan.get("attention_mask")])),
        f" | compile ({layout.compile_scope()})" if cfg.train.compile else "",
        layout.describe(), device,
    )


def dry_run(cfg: Config) -> dict:
    """``dry_run=true``: the plan of the layout as declared, printed as one JSON line on
    stdout (rank 0), nothing run."""
    plan = resolve_run(cfg, declared_world_size(cfg)).plan
    if env_rank() == 0:
        if "hparam_rules" in plan:  # the JSON line alone goes to stdout
            print(describe(plan["hparam_rules"]), file=sys.stderr, flush=True)
        if "eval_tasks" in plan:
            print(describe_tasks_line(plan["eval_tasks"]), file=sys.stderr, flush=True)
        for warning in plan.get("warnings", ()):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        if "batch_ramp" in plan:
            print(describe_ramp_line(plan["batch_ramp"]), file=sys.stderr, flush=True)
        print(json.dumps(plan), flush=True)
    return plan
