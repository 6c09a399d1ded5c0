"""Advice that works: each refusal's suggested override is applied and the problem is gone;
advice that cannot help (fp16 advice to a bf16 run, a larger budget to a source run with no
checkpoints) is not given."""

from __future__ import annotations

import math
import re

import pytest
from helpers import problems
from test_reliability import NANO

from pretrain.checkpoint.manager import CheckpointError
from pretrain.decision.checks import check
from pretrain.train.trainer import run


def suggested(message: str, key: str) -> str:
    """The value the advice gives ``key`` (its last mention: the first may be the value
    refused)."""
    return re.findall(rf"\b{re.escape(key)}=(\S+?)[),.;:]*(?:\s|$)", message)[-1]


@pytest.mark.parametrize("parametrization", ["sp", "mup", "completep"])
@pytest.mark.parametrize("value", [0, -1])
def test_output_mult_not_positive_is_refused_under_every_parametrization(
        compose, parametrization, value):
    extra = [] if parametrization == "sp" else ["model.base_width=32"]
    cfg = compose(["model=nano", f"model.parametrization={parametrization}", *extra,
                   f"model.output_mult={value}"])
    assert any(p.startswith("model.output_mult=") and "must be positive" in p
               for p in problems(cfg, 1))


def test_an_lr_far_outside_the_range_is_refused_and_the_suggested_lr_is_not(compose):
    said = problems(compose(["model=nano", "optim=lars", "optim.lr=1e9"]), 1)
    [refusal] = [p for p in said if p.startswith("optim.lr=")]
    assert "optim.allow_lr_out_of_range=true" in refusal
    lr = suggested(refusal, "optim.lr")
    check(compose(["model=nano", "optim=lars", f"optim.lr={lr}"]), 1)  # no error
    check(compose(["model=nano", "optim=lars", "optim.lr=1e9",
                   "optim.allow_lr_out_of_range=true"]), 1)


def test_a_non_finite_stop_advises_an_lr_that_trains(compose, prepared, tmp_path):
    """LARS at lr=1e9 (allowed) diverges into non-finite steps and stops; the stop's advice
    names no precision change (fp32 run) and an LR; resumed with it, the run finishes."""
    common = [*NANO, f"data.root={prepared.parent}", "budget.steps=8", "optim=lars",
              "checkpoint.enabled=true", "checkpoint.interval_steps=2",
              "train.stop_check_interval=1", "train.max_nonfinite_steps=2"]
    with pytest.raises(FloatingPointError) as stop:
        run(compose([*common, "optim.lr=1e9", "optim.allow_lr_out_of_range=true"]),
            tmp_path / "run")
    message = str(stop.value)
    assert "fp16" not in message and "bf16" not in message, message
    lr = suggested(message, "optim.lr")
    result = run(compose([*common, f"optim.lr={lr}"]), tmp_path / "run")
    assert result["steps"] == 8 and math.isfinite(result["final_loss"])


def branch_base(prepared, runs) -> list[str]:
    from test_branches import base

    return [*base(prepared, runs), "budget=steps", "train.eval_interval=1000"]


def test_a_branch_from_a_run_without_checkpoints_says_how_to_make_them(compose, prepared,
                                                                       tmp_path):
    common = branch_base(prepared, tmp_path)
    source, branch = tmp_path / "source", tmp_path / "branch"
    run(compose([*common, "budget.steps=8", "checkpoint.enabled=false"]), source)
    branch_cfg = compose([*common, "budget.steps=6", f"checkpoint.branch_from={source}"])
    with pytest.raises(CheckpointError) as e:
        run(branch_cfg, branch)
    message = str(e.value)
    assert "holds no complete checkpoint" in message and "larger budget" not in message
    assert "checkpoint.interval_steps=" in message and "checkpoint.keep_every=" in message
    # followed: the source saves (and keeps) periodic checkpoints; the branch then runs
    run(compose([*common, "budget.steps=8", "checkpoint.enabled=true",
                 "checkpoint.interval_steps=2", "checkpoint.keep_every=2"]), source)
    assert run(branch_cfg, branch)["steps"] == 6


def test_a_branch_before_the_first_checkpoint_gets_a_budget_that_works(compose, prepared,
                                                                       tmp_path):
    common = branch_base(prepared, tmp_path)
    source = tmp_path / "source"
    run(compose([*common, "budget.steps=20", "checkpoint.enabled=true",
                 "checkpoint.interval_steps=6", "checkpoint.keep_every=6"]), source)
    with pytest.raises(CheckpointError) as e:
        run(compose([*common, "budget.steps=5", f"checkpoint.branch_from={source}"]),
            tmp_path / "short")
    assert "budget.steps=" in str(e.value), str(e.value)
    steps = suggested(str(e.value), "budget.steps")
    assert steps == "8", str(e.value)
    result = run(compose([*common, f"budget.steps={steps}", f"checkpoint.branch_from={source}"]),
                 tmp_path / "branch")
    assert result["steps"] == 8 and result["branch"]


def test_local_text_without_files_reports_every_problem_at_once(compose):
    said = problems(compose(["model=nano", "data=local-text"]), 1)
    assert any(p.startswith("data.tokenizer_vocab_size=") for p in said), said
    assert any("data.data_files is empty" in p for p in said), said
