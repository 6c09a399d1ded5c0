"""The schema (config/schema.py) as Hydra's structured config: registered in the
ConfigStore, and a composed config turned into the dataclass tree, every value resolved
first so that a recipe rule's error names its key in one line (issue 62)."""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore

from pretrain.config.schema import Config, ConfigError
from pretrain.errors import UserError


def register_configs() -> None:
    """Register the schema; conf/config.yaml lists ``base_config`` first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)


class UnknownKeyError(UserError, KeyError):
    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def _unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    from dataclasses import fields, is_dataclass

    from omegaconf import DictConfig

    known = {f.name: f for f in fields(schema)}
    bad = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        if key not in known:
            bad.append(f"{prefix}{key}")
            continue
        sub_type = known[key].default_factory if callable(known[key].default_factory) else None
        child = node._get_node(key)
        if isinstance(child, DictConfig) and sub_type is not None and is_dataclass(sub_type):
            bad += _unknown_keys(child, sub_type, f"{prefix}{key}.")
    return bad


def to_config(cfg: Any) -> Config:
    """A composed Hydra DictConfig as the dataclass tree, refusing keys the schema lacks.

    The schema already rejects ``model.n_layr=3``; a key added with Hydra's ``+`` prefix
    (``+model.n_layr=3``, the fix Hydra's own message suggests) would otherwise be dropped
    silently, so it is caught here.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    unknown = [k for k in _unknown_keys(cfg, Config) if k not in ("hydra",)]
    if unknown:
        raise UnknownKeyError(
            f"unknown config key(s): {', '.join(unknown)}. Check the spelling against "
            "src/pretrain/config/schema.py (python train.py --cfg job prints every key)."
        )
    try:
        obj = OmegaConf.to_object(cfg)
    except InterpolationResolutionError as e:
        raise resolution_error(e) from e
    assert isinstance(obj, Config), type(obj)
    return obj


def resolve_every_value(cfg: Any) -> None:
    """Resolve every value of a composed config, group by group in the schema's order, then
    ``hydra.run.dir`` (which names the run, through every override): the first error comes
    as a ConfigError naming its own key (resolution_error). The hydra node's other values
    are Hydra's to resolve, when it has filled them in."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        for key in cfg:
            value = cfg[key] if key != "hydra" else None
            if OmegaConf.is_config(value):
                OmegaConf.to_container(value, resolve=True)
        if "hydra" in cfg:
            OmegaConf.select(cfg, "hydra.run.dir")
    except InterpolationResolutionError as e:
        raise resolution_error(e) from e


def resolution_error(e: Exception) -> ConfigError:
    """An error raised while a value's interpolation resolved (a recipe's rule such as
    ``${pretrain_heads:...}`` refusing a width, a key it names missing): the key, and the
    rule's own message, which says the fix, as one problem; not OmegaConf's traceback."""
    import re

    message = str(getattr(e, "msg", None) or e).splitlines()[0]
    message = re.sub(r"^\w+ raised while resolving interpolation: ", "", message)
    return ConfigError([f"{getattr(e, 'full_key', '') or '?'}: {message}"])
