"""Deterministic run names, so the same command finds the same run directory again."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pretrain.config.schema import Config
from pretrain.errors import UserError, exit_on_user_error

# Keys that do not change what is trained, and so name neither a run (run_name) nor a point
# of a sweep (conf/config.yaml's hydra.job.config.override_dirname.exclude_keys reads them
# through the ${pretrain_neutral_keys:} resolver). A group (logging, cluster) stands for
# every key under it.
NEUTRAL_KEYS = ("recipe", "run_name", "runs_dir", "dry_run", "hydra", "logging", "cluster",
                "eval", "checkpoint.resume", "checkpoint.resume_from", "data.num_proc", "data.root",
                "train.device", "train.sample_tokens", "train.sample_prompt",
                "train.sample_temperature", "train.sample_top_k", "train.time_limit_minutes",
                "train.exit_interval", "train.stop_check_interval", "train.gc_interval",
                "profile", "comm")


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


def heads(d_model: int, min_head_width: int) -> int:
    """``model.n_head: ${pretrain_heads:${model.d_model},16}``: as many heads as fit at
    least ``min_head_width`` wide (d_model // 16), so a width sweep (a ladder's sizes) never
    makes a head narrower than the rule; the width must split evenly into them."""
    d_model, min_head_width = int(d_model), int(min_head_width)
    n_head = d_model // min_head_width if min_head_width > 0 else 0
    if n_head < 1 or d_model % n_head:
        ok = [d for d in range(max(min_head_width, 1), 2 * d_model + 1)
              if d % max(d // max(min_head_width, 1), 1) == 0]
        near = sorted(ok, key=lambda d: abs(d - d_model))[:2]
        raise ValueError(f"model.d_model={d_model} does not split into heads at least "
                         f"{min_head_width} wide (d_model // {min_head_width} heads must "
                         f"divide it): use a width such as {' or '.join(map(str, sorted(near)))}")
    return n_head


# One item of a sweep point's directory name: a split before every "key=" (values such as
# [1,4] or [{name:a,weight:1.0}] hold commas, never a "key=").
_ITEM = re.compile(r",(?=[+~]?[A-Za-z_][\w.]*=)")


def _source_items(items) -> list[str]:
    """A sweep point's overrides less those a branch sets for itself (its budget, its own
    branch points, where it branches from), sorted as Hydra's override_dirname sorts them."""
    skip = ("budget.", "checkpoint.branch_")
    return sorted(o for o in items if not is_neutral(o) and not o.lstrip("+~").startswith(skip))


def sweep_source(sweep_dir: str, fallback: str) -> str:
    """``checkpoint.branch_from: ${pretrain_sweep_source:<source sweep dir>,<fallback>}``:
    the run of the source sweep that this cooldown branch continues: the point of that sweep
    with this job's overrides, less what the source and its branches set apart (budgets and
    branch points). So ``model.d_model=16,train.seed=7`` is the source of the branch
    ``budget.tokens_per_param=3,model.d_model=16,train.seed=7``: branches find their source
    whatever else the sweep varies (sizes, seeds, LRs, branch points). Outside a Hydra job
    (a composed config, a dry run) it is ``<sweep dir>/<fallback>``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # HydraConfig was not set: not inside a job
        return f"{sweep_dir}/{fallback}"
    want = _source_items(overrides)
    root = Path(sweep_dir)
    if root.is_dir():
        for point in sorted(root.iterdir()):
            if point.is_dir() and _source_items(_ITEM.split(point.name)) == want:
                return str(point)
    return f"{sweep_dir}/{','.join(want) or fallback}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("pretrain_run_name"):
        OmegaConf.register_new_resolver("pretrain_run_name", lambda: _from_hydra())
        OmegaConf.register_new_resolver("pretrain_sweep_name", _sweep_name)
        OmegaConf.register_new_resolver("pretrain_neutral_keys", neutral_keys)
    if not OmegaConf.has_resolver("pretrain_heads"):
        OmegaConf.register_new_resolver("pretrain_heads", heads)
        OmegaConf.register_new_resolver("pretrain_sweep_source", sweep_source)
    if not OmegaConf.has_resolver("pretrain_ladder_batch"):
        from pretrain.config.ladder_rules import eval_batches, ladder_batch, token_beta2

        OmegaConf.register_new_resolver("pretrain_ladder_batch", ladder_batch)
        OmegaConf.register_new_resolver("pretrain_beta2", token_beta2)
        OmegaConf.register_new_resolver("pretrain_eval_batches", eval_batches)


class RecipeNameError(UserError, ValueError):
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


class RunsDirError(UserError, NotADirectoryError):
    pass


def check_runs_dir(runs_dir: str | Path) -> None:
    """``runs_dir`` must be a directory or a path that can become one: the first of it and
    its parents that exists is a directory. Checked before Hydra makes the run directory
    (RunsDirCheck) and by every tool that composes a config (compose.compose_config)."""
    path = Path(runs_dir)
    for part in (path, *path.parents):
        if not part.exists():
            continue
        if part.is_dir():
            return
        where = "is a file" if part == path else f"is under {part}, which is a file"
        raise RunsDirError(
            f"runs_dir={runs_dir} {where}, not a directory: each run writes "
            "runs_dir/<run_name>/ (train.log, checkpoints, result.json); set runs_dir to a "
            f"directory (e.g. runs_dir=runs), or move {part} out of the way")


class RunsDirCheck(Callback):
    """A Hydra callback (conf/config.yaml ``hydra.callbacks``): ``runs_dir`` checked before
    Hydra makes ``runs_dir/<run_name>`` (it does so before train.py's task function runs,
    where a file would fail as a bare NotADirectoryError). One line, exit 2."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with exit_on_user_error():
            check_runs_dir(config.runs_dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_run_start(config)


class ResolutionCheck(Callback):
    """A Hydra callback (conf/config.yaml ``hydra.callbacks``, first): every value resolved
    before Hydra resolves ``hydra.run.dir`` outside train.py's task function, so an error a
    recipe's rule raises (``${pretrain_heads:...}`` refusing a width, a key an
    interpolation names missing) is one line, exit 2, not OmegaConf's traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        from pretrain.config.structured import resolve_every_value

        HydraConfig.instance().set_config(config)  # as Hydra's run_job does next
        with exit_on_user_error():
            resolve_every_value(config)


class OverrideError(UserError, ConfigCompositionException):
    """An override Hydra cannot apply (a bad value, a key the schema lacks), still the
    ConfigCompositionException Hydra raises; its line leaves out Hydra's indented details
    (full_key, reference_type), which repeat the key the first line names."""

    def lines(self) -> list[str]:
        text = str(self).splitlines()
        return [" ".join(" ".join(s for s in text if s and not s[0].isspace()).split())]


class MissingOptionError(OverrideError, MissingConfigException):
    """A group option or recipe that does not exist (Hydra's MissingConfigException, whose
    message lists the options one a line): one line with the options."""

    def lines(self) -> list[str]:
        first = str(self).splitlines()[0]
        if "the nearest:" in first or "options:" in first:  # check_override_values's line
            return [first]
        return [f"{first}; the options: {', '.join(self.options or [])}"]


_PLAIN_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _unknown_part(parts: list[str]) -> tuple[int, list[str]] | None:
    """The index of the first part of a dotted key that the schema lacks, and the keys it
    has there; None when the key exists or lies under a field the schema leaves open (a
    dict, a list, a value that is not a dataclass)."""
    node: Any = Config
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return i, sorted(fields)
        factory = fields[part].default_factory
        node = factory if callable(factory) and dataclasses.is_dataclass(factory) else None
    return None


def _schema_keys(node: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (the sections' own names too)."""
    out = []
    for f in dataclasses.fields(node):
        out.append(prefix + f.name)
        if callable(f.default_factory) and dataclasses.is_dataclass(f.default_factory):
            out += _schema_keys(f.default_factory, f"{prefix}{f.name}.")
    return out


def check_override_keys(overrides: list[str]) -> None:
    """A plain override (``key=value``) of a key the schema lacks, refused in one line with
    the nearest key, before Hydra composes: Hydra's own message for it suggests the ``+``
    prefix, which config/structured.to_config refuses in turn. ``+``/``~`` overrides, Hydra's
    own keys and group paths are Hydra's to check."""
    for override in overrides:
        key, eq, _ = override.partition("=")
        if not eq or key.startswith(("+", "~", "-", "hydra")) or not _PLAIN_KEY.fullmatch(key):
            continue
        parts = key.split(".")
        if (found := _unknown_part(parts)) is None:
            continue
        i, known = found
        where = ".".join(parts[:i])
        near = ([k for k in _schema_keys() if k.split(".")[-1] == parts[-1]]
                or [".".join([*parts[:i], k])
                    for k in difflib.get_close_matches(parts[i], known, n=1)])
        hint = (f"did you mean {' or '.join(near[:3])}?" if near else
                f"the keys{' of ' + where if where else ''} are: {', '.join(known)}")
        extra = " (a recipe is added: +recipe=NAME)" if key == "recipe" else ""
        raise OverrideError(
            f"{override}: {key} is not a config key{extra}; {hint} (python train.py --cfg "
            "job prints every key; src/pretrain/config/schema.py defines them)")


def _choice_type(parts: list[str]) -> type | None:
    """The Choice enum of the schema key ``parts`` (None: not a Choice key, or no key)."""
    import typing

    from pretrain.config.choices import Choice

    node: Any = Config
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        if i == len(parts) - 1:
            kind = hints[part]
            options = [a for a in typing.get_args(kind) if isinstance(a, type)] or [kind]
            return next((k for k in options if isinstance(k, type) and issubclass(k, Choice)),
                        None)
        fields = {f.name: f for f in dataclasses.fields(node)}
        factory = fields[part].default_factory
        node = factory if callable(factory) and dataclasses.is_dataclass(factory) else None
    return None


def check_override_values(overrides: list[str], conf_dir: Path | None = None) -> None:
    """Two of Hydra's own errors as one line each, before it composes (Hydra prints them as
    many lines and exits 1): a config group option or recipe that does not exist
    (``+recipe=nonexistent``, ``model=gpt5``: the three nearest names), and a value outside a key's
    closed set (``model.norm=batchnorm``: the
    options)."""
    from pretrain.config.paths import CONF_DIR

    conf = Path(conf_dir or CONF_DIR)
    for override in overrides:
        key, eq, value = override.lstrip("+~").partition("=")
        if not eq or not value or value.startswith("${") or key.startswith("hydra"):
            continue
        group = conf / key
        if "." not in key and group.is_dir():
            options = sorted(p.stem for p in group.glob("*.yaml"))
            if value not in options:
                near = difflib.get_close_matches(value, options, n=3, cutoff=0.0)
                what = "recipe" if key == "recipe" else f"{key} option"
                where = "recipes/" if key == "recipe" else f"conf/{key}/"
                hint = f"the nearest: {', '.join(near)} (all {len(options)}: ls {where})"
                raise MissingOptionError(f"{override}: no {what} named {value!r} in {where}; "
                                         f"{hint}", None, options)
            continue
        choice = _choice_type(key.split(".")) if _PLAIN_KEY.fullmatch(key) else None
        if choice is not None and value not in choice.__members__:
            options = list(choice.__members__)
            raise OverrideError(f"{override}: {value!r} is not a value of {key}; the options: "
                                f"{', '.join(options)}")
