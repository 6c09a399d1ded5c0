"""Errors raised while a recipe's interpolations resolve (its rules: head counts from a
width, a rung's batch and beta2, validation batches; or a key an interpolation names that
is not there) reach the user as every other config mistake does: one ``error:`` line
naming the key, exit 2, not OmegaConf's traceback (issue 62). Every resolver the project
registers has a case here, so a new one cannot be added without one."""

from __future__ import annotations

import pytest
from train_forks import train_py

from pretrain.config.schema import ConfigError
from pretrain.errors import UserError

LADDER = "+recipe=ladder-pinned"
# resolver -> (overrides that make it raise, the key named, words of its message)
CASES = {
    "pretrain_heads": ([LADDER, "model.d_model=104"], "model.n_head",
                       "use a width such as 102 or 108"),
    "pretrain_ladder_batch": (
        [LADDER, "train.global_batch_size=${pretrain_ladder_batch:16,0,16}"],
        "parallel.micro_batch_size",  # the first key to use it (the schema's order)
        "target batch must be positive"),
    "pretrain_eval_batches": ([LADDER, "train.eval_batches=${pretrain_eval_batches:0,4}"],
                              "train.eval_batches", "windows and batch must be positive"),
    "pretrain_beta2": ([LADDER, "optim.betas=[0.9,'${pretrain_beta2:4,16,1.5}']"],
                       "optim.betas[1]", "reference beta2 in (0, 1)"),
    # the others take what the config gives them; a wrong call is still one line
    "pretrain_sweep_source": (["data.name=${pretrain_sweep_source:only_one}"], "data.name",
                              "missing 1 required positional argument"),
    "pretrain_run_name": (["data.name=${pretrain_run_name:extra}"], "data.name",
                          "takes 0 positional arguments"),
    "pretrain_sweep_name": (["data.name=${pretrain_sweep_name:extra}"], "data.name",
                            "multiple values"),
    "pretrain_neutral_keys": (["data.name=${pretrain_neutral_keys:extra}"], "data.name",
                              "takes 0 positional arguments"),
}


def test_every_registered_resolver_has_a_case():
    from omegaconf.basecontainer import BaseContainer

    registered = {name for name in BaseContainer._resolvers if name.startswith("pretrain_")}
    assert registered == set(CASES)


@pytest.mark.parametrize("resolver", sorted(CASES))
def test_a_resolver_error_is_one_line_naming_the_key(compose, resolver):
    overrides, key, words = CASES[resolver]
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert isinstance(info.value, UserError)
    [line] = info.value.lines()
    assert line.startswith(f"{key}: ") and words in line, line
    assert "Traceback" not in line and "resolving interpolation" not in line


@pytest.mark.parametrize("override, line", [
    ("model.d_model=104", "error: model.n_head: model.d_model=104 does not split into heads "
                          "at least 16 wide"),
    ("train.eval_batches=${pretrain_eval_batches:0,4}",  # resolved by Hydra, outside train.py
     "error: train.eval_batches: pretrain_eval_batches: windows and batch must be positive"),
])
def test_train_py_answers_a_rule_error_in_one_line_with_exit_2(tmp_path, override, line):
    proc = train_py(LADDER, override, "dry_run=true", f"runs_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(line) and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr[-3000:]
