"""Deterministic run names, so the same command finds the same run directory again."""

from __future__ import annotations

import dataclasses
import hashlib
import re

from omegaconf import OmegaConf

from pretrain.config.schema import Config

# Keys that do not change what is trained, and so name neither a run (run_name) nor a point
# of a sweep (conf/config.yaml's hydra.job.config.override_dirname.exclude_keys reads them
# through the ${pretrain_neutral_keys:} resolver). A group (logging, cluster) stands for
# every key under it.
NEUTRAL_KEYS = ("recipe", "run_name", "runs_dir", "dry_run", "hydra", "logging", "cluster",
                "eval", "checkpoint.resume", "checkpoint.resume_from", "data.num_proc", "data.root",
                "train.device", "train.sample_tokens", "train.sample_prompt",
                "train.sample_temperature", "train.sample_top_k", "train.time_limit_minutes",
                "train.exit_interval", "train.stop_check_interval", "train.gc_interval")


def neutral_keys() -> list[str]:
    """NEUTRAL_KEYS with every schema key under a group spelt out, as Hydra's exclude_keys
    needs them: it compares whole keys, never prefixes."""
    groups = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    out = list(NEUTRAL_KEYS)
    for key in NEUTRAL_KEYS:
        schema = groups.get(key)
        if dataclasses.is_dataclass(schema):
            out += [f"{key}.{f.name}" for f in dataclasses.fields(schema)]
    return out


def is_neutral(override: str) -> bool:
    """Whether a command-line override (``key=value``, ``+key=value``, ``~key``) leaves what
    is trained unchanged."""
    key = override.lstrip("+~").split("=", 1)[0]
    return key in NEUTRAL_KEYS or key.startswith(tuple(f"{k}." for k in NEUTRAL_KEYS))


def run_name(recipe: str | None, overrides: list[str]) -> str:
    """``<recipe or 'default'>`` plus the training-relevant overrides, e.g.
    ``gpt2-124m__model.n_layer=6``; long names end in a hash instead."""
    base = recipe or "default"
    rest = sorted(o.lstrip("+~") for o in overrides if not is_neutral(o))
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
        OmegaConf.register_new_resolver("pretrain_neutral_keys", neutral_keys)


class RecipeNameError(ValueError):
    pass


def check_recipe_overrides(overrides: list[str]) -> None:
    """A recipe is a name from recipes/, never a path: ``+recipe=../../x`` would load a YAML
    from outside recipes/ and name a run directory outside ``runs_dir``."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "recipe" and ("/" in value or "\\" in value or value.startswith(".")):
            raise RecipeNameError(
                f"{override}: a recipe is a name from recipes/ (e.g. +recipe=tiny), not a "
                f"path; copy the file into recipes/ and use its name")
