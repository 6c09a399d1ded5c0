"""Deterministic run names, so the same command finds the same run directory again."""

from __future__ import annotations

import hashlib
import re

from omegaconf import OmegaConf

# Overrides that do not change what is trained, and so do not change the run directory.
NEUTRAL_PREFIXES = ("+recipe=", "recipe=", "run_name=", "runs_dir=", "dry_run=", "logging.",
                    "logging=", "checkpoint.resume", "train.sample_", "data.num_proc=",
                    "data.root=", "hydra.", "train.device=", "cluster.", "cluster=",
                    "train.time_limit_minutes=", "train.exit_interval=",
                    "train.stop_check_interval=")


def run_name(recipe: str | None, overrides: list[str]) -> str:
    """``<recipe or 'default'>`` plus the training-relevant overrides, e.g.
    ``gpt2-124m__model.n_layer=6``; long names end in a hash instead."""
    base = recipe or "default"
    rest = sorted(o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith(NEUTRAL_PREFIXES))
    if not rest:
        return base
    suffix = re.sub(r"[^A-Za-z0-9._=,-]+", "-", ",".join(rest))
    if len(suffix) > 80:
        suffix = suffix[:60] + "-" + hashlib.sha1(suffix.encode()).hexdigest()[:10]
    return f"{base}__{suffix}"


def _from_hydra() -> str:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    return run_name(hc.runtime.choices.get("recipe"), list(hc.overrides.task))


def _sweep_name(_root_) -> str:
    """The sweep directory's name: the recipe. Read from the config itself because Hydra's
    sweeper resolves ``hydra.sweep.dir`` before HydraConfig exists (``-m`` failed with
    "HydraConfig was not set")."""
    return OmegaConf.select(_root_, "hydra.runtime.choices.recipe", default=None) or "default"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("pretrain_run_name"):
        OmegaConf.register_new_resolver("pretrain_run_name", lambda: _from_hydra())
        OmegaConf.register_new_resolver("pretrain_sweep_name", _sweep_name)
