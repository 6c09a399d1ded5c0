"""Compose the same config train.py sees, for the command-line tools.

Tools take Hydra overrides exactly as train.py does (``+recipe=NAME key=value ...``) but
do not need a run directory, so they use Hydra's compose API instead of ``@hydra.main``.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import open_dict

from pretrain.config.naming import (
    MissingOptionError,
    OverrideError,
    check_override_keys,
    check_override_values,
    check_recipe_overrides,
    check_runs_dir,
    register_resolvers,
)
from pretrain.config.paths import CONF_DIR
from pretrain.config.schema import Config
from pretrain.config.structured import register_configs, resolve_every_value, to_config


def compose_config(overrides: list[str], conf_dir: Path = CONF_DIR) -> Config:
    """The resolved, schema-checked config for these overrides (as train.py would run it)."""
    register_configs()
    register_resolvers()
    check_recipe_overrides(list(overrides))
    check_override_keys(list(overrides))
    if not conf_dir.is_dir():
        raise FileNotFoundError(
            f"no Hydra config directory at {conf_dir}; run the tools from a checkout of the repo"
        )
    check_override_values(list(overrides), conf_dir)  # the lines train.py prints for them
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        try:
            cfg = compose(config_name="config", overrides=list(overrides),
                          return_hydra_config=True)
        except MissingConfigException as e:  # a recipe or group option that is not there
            raise MissingOptionError(str(e), e.missing_cfg_file, e.options) from e
        except ConfigCompositionException as e:  # say why, as train.py prints it: a bad
            if e.__cause__ is None:  # value's key and the allowed values are in the cause
                raise OverrideError(str(e)) from e
            raise OverrideError(f"{e}: {e.__cause__}") from e.__cause__
        HydraConfig.instance().set_config(cfg)  # lets ${pretrain_run_name:} resolve
        resolve_every_value(cfg)  # a rule's error names its own key, as train.py's does
        with open_dict(cfg):
            cfg.run_name = str(cfg.run_name)
            del cfg["hydra"]
    out = to_config(cfg)
    check_runs_dir(out.runs_dir)  # before a tool makes or reads a run directory
    return out
