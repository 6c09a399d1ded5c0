"""Where a run continues from, decided before its model exists (a resumed run skips
initialising its weights), and whether that checkpoint fits this run.

Rank 0 alone looks at the disk and reads meta.json; every rank gets its answer or raises its
error (``folder.on_rank0``), so a checkpoint of another model, another loss-scaling
state or another optimizer is refused with the fix named, before DCP would report a shape mismatch
or a
missing ``param_groups`` key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pretrain.checkpoint.branch import (
    check_branch,
    is_inside,
    recorded_branch,
    source_checkpoint,
)
from pretrain.checkpoint.folder import (
    CheckpointError,
    newest_checkpoint,
    on_rank0,
    read_meta,
    require_intact,
    resolve_checkpoint,
    verify_checksums,
)
from pretrain.checkpoint.manager import CheckpointManager
from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.config.schema import Config

log = logging.getLogger("pretrain")
# Model keys a checkpoint may differ in: they change no weight's shape or meaning.
NEUTRAL_MODEL_KEYS = ("attention", "name", "dropout")


# What fixes a model mismatch, by how the run uses the checkpoint (check_compatible's
# ``use``): each names only what works for that use (a branch always reads its source, and
# resume_from is read whatever checkpoint.resume says).
MODEL_FIX = {
    "resume": "Use the same model settings, another run_name, or checkpoint.resume=false to "
              "start afresh.",
    "resume_from": "Use the same model settings, or another checkpoint.resume_from.",
    "branch": "A cooldown branch continues its source's model: use the checkpoint's model "
              "settings, or train this model from scratch without checkpoint.branch_from "
              "(under another run_name).",
    "weights": "Use the checkpoint's model settings: checkpoint.load_weights_only loads "
               "every weight, so every shape must match.",
}


def check_compatible(path: Path, cfg: Config, use: str = "resume") -> None:
    """Refuse a checkpoint of another model before DCP reports a shape mismatch. ``use``:
    how this run continues from it (a MODEL_FIX key); "weights" reads the model alone, so
    its optimizer and loss scaling may differ. Reads meta.json: call it on rank 0 only,
    inside ``on_rank0``, which gives every rank the same error."""
    saved = read_meta(path).get("config", {})
    now = OmegaConf.to_container(OmegaConf.structured(cfg.model))
    diff = [f"model.{k}={now[k]!r} (checkpoint: {v!r})" for k, v in saved.get("model", {}).items()
            if k not in NEUTRAL_MODEL_KEYS and k in now and now[k] != v]
    if diff:
        raise CheckpointError(
            f"{path} holds a different model: {'; '.join(diff)}. {MODEL_FIX[use]}")
    if use == "weights":
        return
    _check_precision(path, saved.get("precision", {}), cfg, use)
    _check_optimizer(path, saved.get("optim", {}), cfg, use)


def _afresh(path: Path, use: str) -> str:
    """How to start afresh from ``path``'s weights: what works for this ``use``."""
    drop = " (and without checkpoint.resume_from)" if use == "resume_from" else ""
    return (f"start afresh from its weights: checkpoint.load_weights_only={path} "
            f"checkpoint.resume=false{drop}")


def _check_optimizer(path: Path, saved: dict, cfg: Config, use: str) -> None:
    """The optimizer's state is one optimizer's (AdamW's moments, LARS's or Muon's
    momentum): resuming with another would fail inside DCP on a missing state key. A
    checkpoint from before ``optim.name`` existed is AdamW's."""
    name = saved.get("name", "adamw") if saved else cfg.optim.name
    if name == cfg.optim.name:
        return
    fix = (f"A cooldown branch continues its source's optimizer state: use optim={name}."
           if use == "branch" else
           f"Resume with optim={name}, or {_afresh(path, use)} with a new optimizer.")
    raise CheckpointError(
        f"{path} holds the state of optim={name} and this run is optim={cfg.optim.name}. "
        + fix)


def _check_precision(path: Path, saved: dict, cfg: Config, use: str) -> None:
    """Loss scaling is state the checkpoint holds or lacks (fp16's scaler): resuming
    across it would fail inside DCP with a message about param_groups. Other precision
    changes (bf16 <-> fp32) resume fine: the weights and AdamW state are fp32 either way."""
    if not saved or bool(saved.get("loss_scaling")) == cfg.precision.loss_scaling:
        return
    fix = (f"A cooldown branch continues its source's loss-scaler state: use precision="
           f"{saved.get('name')}." if use == "branch" else
           f"Resume with the checkpoint's precision, or {_afresh(path, use)}.")
    raise CheckpointError(
        f"{path} was saved with precision={saved.get('name')} "
        f"(loss_scaling={saved.get('loss_scaling')}) and this run is "
        f"precision={cfg.precision.name} (loss_scaling="
        f"{cfg.precision.loss_scaling}): fp16's loss-scaler state is in one and not "
        f"the other. {fix}")


def choose_resume(cfg: Config, run_dir: Path, skip: Sequence[Path] = ()) -> Path | None:
    """The checkpoint this run continues from, in this process alone: resume_from, else
    (checkpoint.resume) the newest complete one of this run but those in ``skip``; None for
    a new run."""
    ck = cfg.checkpoint
    if ck.branch_from:  # its own newest (a requeued branch), else the source's branch point
        own = newest_checkpoint(Path(run_dir) / "checkpoints", skip) if ck.resume else None
        path = own or source_checkpoint(cfg)
        check_compatible(path, cfg, "branch")
        if own is None:
            check_branch(path, cfg, run_dir)
        return path
    if ck.resume_from:
        path = resolve_checkpoint(ck.resume_from, "checkpoint.resume_from")
    elif ck.resume:
        path = newest_checkpoint(Path(run_dir) / "checkpoints", skip)
    else:
        return None
    if path is not None:
        check_compatible(path, cfg, "resume_from" if ck.resume_from else "resume")
    return path


def resume_path(cfg: Config, run_dir: Path) -> Path | None:
    """``choose_resume`` decided by rank 0, the same answer (or error) on every rank, and
    its checksums verified (every rank hashes its share of the files): a corrupt one is
    skipped with a warning naming the file, and the next newest tried; a corrupt
    ``resume_from`` or branch source is an error. Every rank calls it, once the process group
    exists."""
    skip: list[Path] = []
    while (path := on_rank0(lambda: choose_resume(cfg, run_dir, skip))) is not None:
        if cfg.checkpoint.resume_from or not is_inside(path, run_dir):
            require_intact(path, "Resume from another checkpoint.")
            return path
        why = verify_checksums(path)
        if why is None:
            return path
        log.warning("checkpoint %s is corrupt (%s): skipping it, not deleting it; trying the "
                    "next newest", path, why)
        skip.append(path)
    return None


def branch_record(cfg: Config, run_dir: Path, path: Path | None) -> dict | None:
    """``branch.recorded_branch`` of the checkpoint this run continues from, as rank 0 reads
    it, on every rank: what a cooldown branch writes into result.json and its meta.json."""
    return on_rank0(lambda: recorded_branch(path, cfg, run_dir))


def _weights_checkpoint(src: Path, cfg: Config) -> Path | None:
    """Rank 0: None for a transformers model directory, else the complete checkpoint of
    ours that ``src`` names, checked against the model config."""
    if (src / "config.json").exists() and not (src / ".metadata").exists():
        return None
    path = resolve_checkpoint(src, "checkpoint.load_weights_only")
    check_compatible(path, cfg, "weights")
    return path


def load_weights(source: str, cfg: Config, parts: list[torch.nn.Module], attention: str
                 ) -> None:
    """Weights only into this rank's model ``parts`` (new optimizer, new schedule): a
    checkpoint of ours, or a transformers model directory."""
    src = Path(source)
    path = on_rank0(lambda: _weights_checkpoint(src, cfg))
    if path is not None:
        require_intact(path, "Start from another checkpoint.")
        CheckpointManager.load(path, {"model_optim": ModelOptimizer(parts, None)})
        log.info("initialised from the weights of %s (new optimizer and schedule)", path)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from pretrain.model.gpt import build_model
    from pretrain.model.hf import load_hf_weights

    full = build_model(cfg, torch.device("cpu"), attention, cfg.train.seed)
    load_hf_weights(full, cfg.model, str(src))
    for part in parts:
        set_model_state_dict(part, full.state_dict(),
                             options=StateDictOptions(full_state_dict=True, strict=False))
    log.info("initialised from the transformers model in %s", src)
