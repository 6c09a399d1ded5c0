"""Cooldown branches: one stable run, several budgets (Hägele et al. 2024, arXiv 2405.18392).

A WSD run holds its peak LR until the last ``schedule.decay_fraction`` of its steps. Up to
that point a run of budget D and a run of budget D' > D are the same run: same weights, same
optimizer state, same data. So a long run can store checkpoints where shorter budgets would
start their decay (``checkpoint.branch_tokens_per_param``, the *branch points*), and a
cooldown branch (``checkpoint.branch_from``) continues from one of them, in its own run
directory, with its own budget: stable LR up to its decay start, then the decay. Its final
loss is what a from-scratch WSD run of that budget reaches, for the price of the decay
alone, and each branch is one (N, D) point for L(N, D) (analysis/branches.py).

What is refused, before the model is built, with the fix named: a source that is not a
stable-phase WSD (or constant-LR) checkpoint, a branch point after the branch's decay start,
a source whose model, optimizer, data, batch or warmup differ from the branch's (the
continuation would not be the source's), and a branch run directory that is the source's
(the source is only ever read).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from omegaconf import OmegaConf

from pretrain.budget.compute import resolve_budget
from pretrain.checkpoint.folder import (
    CheckpointError,
    complete_checkpoints,
    read_meta,
    require_exists,
    resolve_checkpoint,
)
from pretrain.config.schema import BudgetConfig, Config, ConfigError
from pretrain.optim.factory import wsd_decay_start

# What a branch must share with its source, so that its first step is the step the source
# would have taken next: the data and its order, the batch, the optimizer and its LR up to
# the decay (the model and the loss-scaling state are check_compatible's).
MUST_MATCH = ("optim", "train.global_batch_size", "schedule.warmup_steps",
              "schedule.warmup_tokens", "model.seq_len")
# Data keys that change neither the tokens nor their order.
DATA_NEUTRAL = ("num_proc", "root", "auto_prepare", "max_epochs", "tokens", "shard_tokens")
OPTIM_NEUTRAL = ("fused",)
# A mixture's weights from the decay start on (data/weights.py): the branch's own cooldown
# mix. The branch point is at or before both runs' decay starts, so the source never used them.
BRANCH_MAY_CHANGE = ("data.cooldown_weights",)


def run_steps(cfg: Config, budget: BudgetConfig | None = None) -> int:
    """The optimizer steps of ``cfg``'s run (or of ``budget`` with its model and batch)."""
    return resolve_budget(cfg.model, budget or cfg.budget, cfg.train.global_batch_size).steps


def branch_points(cfg: Config) -> list[int]:
    """The steps a run saves and keeps for its cooldown branches: for each budget of
    ``checkpoint.branch_tokens_per_param``, the step where a WSD branch of that budget (with
    this run's ``schedule.decay_fraction``) starts its decay. The checkpoint saved after
    that many steps is the one the branch continues from."""
    steps = set()
    for k in cfg.checkpoint.branch_tokens_per_param:
        budget = dataclasses.replace(cfg.budget, kind="tokens_per_param", tokens_per_param=k)
        steps.add(wsd_decay_start(run_steps(cfg, budget), cfg.schedule))
    return sorted(steps)


def _branch_point_problems(cfg: Config) -> list[str]:
    """Branch points the run never reaches in its stable phase."""
    ck = cfg.checkpoint
    if not ck.branch_tokens_per_param:
        return []
    if cfg.schedule.decay not in ("wsd", "constant"):
        return [f"checkpoint.branch_tokens_per_param needs a stable phase to branch from: "
                f"schedule=wsd (or schedule.decay=constant), not decay={cfg.schedule.decay}"]
    own = run_steps(cfg)
    end = wsd_decay_start(own, cfg.schedule) if cfg.schedule.decay == "wsd" else own
    points = branch_points(cfg)
    if any(k <= 0 for k in ck.branch_tokens_per_param) or points[0] < 1 or points[-1] > end:
        return [f"checkpoint.branch_tokens_per_param={list(ck.branch_tokens_per_param)} puts "
                f"branch points at steps {points}: each must be positive and at or before "
                f"step {end}, where this run's stable phase ends ({own} steps): lower the "
                "largest, or raise this run's budget"]
    return []


def _branch_from_problems(cfg: Config) -> list[str]:
    """Keys that do not go with checkpoint.branch_from."""
    ck, p = cfg.checkpoint, []
    if not ck.branch_from:
        return p
    if cfg.schedule.decay != "wsd":
        p.append(f"checkpoint.branch_from is a cooldown branch: it needs schedule=wsd (stable, "
                 f"then the decay), not decay={cfg.schedule.decay}")
    for key in ("resume_from", "load_weights_only"):
        if getattr(ck, key):
            p.append(f"checkpoint.branch_from and checkpoint.{key} both name a starting "
                     f"point: keep one")
    for key, rule in (("optim.lr_rule", cfg.optim.lr_rule),
                      ("train.batch_rule", cfg.train.batch_rule)):
        if rule != "fixed":
            p.append(f"{key}={rule} gives a branch of another budget another value than its "
                     f"source had: use {key}=fixed with the source's value")
    return p


def check_branch_config(cfg: Config) -> tuple[int, ...]:
    """ConfigError naming every problem of the branch keys (before any data or process
    group exists: resolve_plan calls it); else the branch points the run keeps (none
    without checkpoint.branch_tokens_per_param), for its RunDecision."""
    problems = _branch_from_problems(cfg) + _branch_point_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return tuple(branch_points(cfg)) if cfg.checkpoint.branch_tokens_per_param else ()


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _differences(saved: dict, cfg: Config) -> list[str]:
    """The MUST_MATCH and data keys where ``cfg`` differs from the source's config."""
    now = _flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    then = _flat(saved)
    keys = [k for k in now if k.startswith(MUST_MATCH) or k.startswith("data.")]
    keys = [k for k in keys if k.split(".")[-1] not in
            (DATA_NEUTRAL if k.startswith("data.") else OPTIM_NEUTRAL)
            and not k.startswith(BRANCH_MAY_CHANGE)]
    return [f"{k}={now[k]!r} (source: {then[k]!r})" for k in keys
            if k in then and then[k] != now[k]]


def _source_config(saved: dict) -> Config:
    """The source run's config as the schema (keys it lacks take today's defaults)."""
    known = OmegaConf.structured(Config)
    merged = OmegaConf.merge(known, {k: v for k, v in saved.items() if k in known})
    return OmegaConf.to_object(merged)


def source_checkpoint(cfg: Config) -> Path:
    """The checkpoint ``checkpoint.branch_from`` names: a step directory as is; a run (or
    its checkpoints folder): its newest complete checkpoint at or before this branch's decay
    start. Rank 0's view (call inside ``on_rank0``)."""
    src = require_exists(cfg.checkpoint.branch_from, "checkpoint.branch_from")
    start = wsd_decay_start(run_steps(cfg), cfg.schedule)
    if src.name.startswith("step_"):
        return resolve_checkpoint(src, "checkpoint.branch_from")
    folder = src / "checkpoints" if (src / "checkpoints").is_dir() else src
    found = complete_checkpoints(folder)
    usable = [p for s, p in found if s <= start]
    if not usable:
        raise CheckpointError(_no_source_message(cfg, src, start, [s for s, _ in found]))
    return usable[-1]


def _no_source_message(cfg: Config, src: Path, start: int, steps: list[int]) -> str:
    """Why no checkpoint of ``src`` can start this branch (decay from step ``start``), with
    only the advice that helps: with no checkpoint at all, how to make them in the source;
    else the smallest budget whose decay starts at or after the source's first one."""
    head = f"checkpoint.branch_from={src}: "
    make = ("make them in the source run: checkpoint.enabled=true with "
            "checkpoint.interval_steps=<steps> checkpoint.keep_every=<steps> (periodic saves, "
            "kept), or "
            "checkpoint.branch_tokens_per_param=[<tokens per param of each branch>] (a kept "
            f"checkpoint where each branch starts its decay; this one starts at step {start})"
            ", then run (or resume) the source and branch again")
    if not steps:
        return (head + "the source holds no complete checkpoint to branch from (it saved "
                "none: checkpoint.enabled=false, or it stopped before its first save); " + make)
    total = (
        math.ceil(steps[0] / (1 - cfg.schedule.decay_fraction))
        if cfg.schedule.decay_fraction < 1
        else steps[0] + 1
    )
    while wsd_decay_start(total, cfg.schedule) < steps[0]:
        total += 1
    return (head + f"no complete checkpoint at or before step {start}, where this branch "
            f"starts its decay (found steps {steps}). Branch to a budget of at least {total} "
            f"steps (budget=steps budget.steps={total}: its decay starts at step "
            f"{wsd_decay_start(total, cfg.schedule)}), or " + make)


def _source_run(path: Path) -> Path:
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def check_branch(path: Path, cfg: Config, run_dir: Path) -> None:
    """Refuse a source checkpoint this branch cannot continue from, naming the fix.
    ``check_compatible`` (model, optimizer, loss scaling) is the caller's."""
    meta = read_meta(path)
    step, saved = int(meta["step"]), meta.get("config", {})
    source_run = _source_run(path)
    here = Path(run_dir).resolve()
    if here == source_run.resolve() or source_run.resolve() in here.parents:
        raise CheckpointError(
            f"the branch's run directory {run_dir} is its source's ({source_run}): a branch "
            "never writes into its source; give it another run_name (or runs_dir)")
    diff = _differences(saved, cfg)
    if diff:
        raise CheckpointError(
            f"{path} cannot be continued by this branch: {'; '.join(diff)}. A branch keeps "
            "the source's data, batch, optimizer and warmup; only the budget, the decay and "
            "where it runs may differ.")
    _check_stable(path, step, _source_config(saved))
    total = run_steps(cfg)
    start = wsd_decay_start(total, cfg.schedule)
    if step > start:
        raise CheckpointError(
            f"checkpoint.branch_from={path} is at step {step}, after this branch's decay "
            f"start (step {start} of {total}: its last schedule.decay_fraction="
            f"{cfg.schedule.decay_fraction}); branch from a checkpoint at or before step "
            f"{start}, or give the branch a larger budget")


def _check_stable(path: Path, step: int, source: Config) -> None:
    """The source was at its peak LR up to ``step``: constant, or WSD before its decay."""
    sched = source.schedule
    if sched.decay == "constant":
        return
    if sched.decay != "wsd":
        raise CheckpointError(
            f"{path} comes from a run with schedule.decay={sched.decay}: its LR was already "
            "decaying, there is no stable phase to branch from. Branch from a schedule=wsd "
            "(or schedule.decay=constant) run.")
    total = run_steps(source)
    start = wsd_decay_start(total, sched)
    if step > start:
        raise CheckpointError(
            f"{path} (step {step}) is inside its run's own decay (from step {start} of "
            f"{total}): branch from a checkpoint of its stable phase, at or before step "
            f"{start}")


def is_inside(path: Path, run_dir: Path) -> bool:
    """Whether checkpoint ``path`` is one of ``run_dir``'s own (not a branch source)."""
    return Path(run_dir).resolve() in Path(path).resolve().parents


def recorded_branch(path: Path | None, cfg: Config, run_dir: Path) -> dict | None:
    """What a branch records (result.json, its own checkpoints' meta.json): the source run,
    checkpoint, step and tokens; None for a run that is no branch. Read from its own
    checkpoint's meta.json when it resumes one of its own (a requeued branch). Rank 0."""
    if not cfg.checkpoint.branch_from or path is None:
        return None
    meta = read_meta(path)
    if is_inside(path, run_dir):
        return meta.get("branch")
    return {"source": str(_source_run(path)), "checkpoint": str(path),
            "step": int(meta["step"]), "tokens": meta.get("tokens")}
