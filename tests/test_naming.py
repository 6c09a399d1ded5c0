"""Which overrides name a run: one list (pretrain.config.naming.NEUTRAL_KEYS) for the run directory
and for the point of a Hydra sweep (conf/config.yaml's override_dirname.exclude_keys)."""

from __future__ import annotations

import dataclasses

from helpers import CONF_DIR
from hydra import compose, initialize_config_dir

from pretrain.config.naming import is_neutral, neutral_keys, run_name
from pretrain.config.schema import Config


def hydra_job(overrides: list[str]):
    """Hydra's own job node for these overrides (what names a sweep point)."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides, return_hydra_config=True).hydra.job


def schema_keys() -> list[str]:
    keys = ["recipe"]
    for section in dataclasses.fields(Config):
        keys.append(section.name)
        if dataclasses.is_dataclass(section.default_factory):
            keys += [
                f"{section.name}.{f.name}" for f in dataclasses.fields(section.default_factory)
            ]
    return keys


def test_hydra_excludes_the_keys_that_name_no_run():
    excluded = list(hydra_job([]).config.override_dirname.exclude_keys)
    assert excluded == neutral_keys()
    for key in schema_keys():  # the run name and the sweep point agree on every key
        assert is_neutral(f"{key}=1") == (key in excluded), key


def test_run_name_and_sweep_point_name_the_same_overrides():
    overrides = ["+recipe=tiny", "model.n_layer=2", "logging.log_interval=3", "train.device=cpu",
                 "optim.lr=0.001", "runs_dir=elsewhere", "dry_run=true", "cluster.nodes=2",
                 "checkpoint.resume=false", "train.sample_tokens=0"]
    job = hydra_job(overrides)
    assert job.override_dirname == "model.n_layer=2,optim.lr=0.001"
    assert run_name("tiny", overrides) == f"tiny__{job.override_dirname}"


def test_what_names_a_run():
    neutral = ["+recipe=tiny", "logging.wandb=online", "logging=quiet", "checkpoint.resume=false",
               "checkpoint.resume_from=runs/x", "train.sample_prompt=x", "cluster.env.NCCL_X=1",
               "data.root=/data", "data.num_proc=8", "train.time_limit_minutes=5",
               "train.exit_interval=10", "train.stop_check_interval=1", "hydra.verbose=true"]
    assert run_name("tiny", neutral) == "tiny"
    assert run_name(None, ["model.n_layer=6", *neutral]) == "default__model.n_layer=6"
    long = run_name("tiny", [f"model.d_model={d}" for d in range(1000, 1030)])
    assert long.startswith("tiny__model.d_model=1000,") and len(long) == len("tiny__") + 71
