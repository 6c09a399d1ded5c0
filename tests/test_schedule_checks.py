"""The schedule against the run's length (decision/schedule_checks.py), and the z-loss bound
(decision/checks.py): each through the real check function, and through ``train.py
dry_run=true`` as a user meets it."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import problems
from train_forks import train_py

from pretrain.budget.compute import resolve_budget
from pretrain.config.schema import ConfigError
from pretrain.decision.schedule_checks import check_schedule, schedule_problems
from pretrain.optim.factory import lr_multiplier, warmup_steps

# mixture-tiny at 100k tokens: 40 steps of 2,560 tokens, warmup 50, WSD decay from step 32
SHORT_MIX = ["+recipe=mixture-tiny", "budget.tokens=100_000"]


def budget_of(cfg):
    return resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)


def warnings_for(compose, *overrides: str) -> tuple[list[str], int]:
    cfg = compose(list(overrides))
    budget = budget_of(cfg)
    return check_schedule(cfg, budget), budget.steps


def test_a_run_shorter_than_its_warmup_is_warned_with_both_numbers(compose):
    cfg = compose(SHORT_MIX)
    budget = budget_of(cfg)
    assert budget.steps == 40 and warmup_steps(cfg.schedule, budget.global_batch_tokens) == 50
    # what the warning is about: the last step's LR is below the peak and never decayed
    last = lr_multiplier(budget.steps - 1, budget.steps, 50, cfg.schedule)
    assert last == pytest.approx(40 / 50)
    first, cooldown = check_schedule(cfg, budget)
    assert "schedule.warmup_steps=50 (50 steps) is not shorter than this run, 40 steps" in first
    assert "set schedule.warmup_steps=4" in first
    # the cooldown mix starts at the WSD decay start (step 32), before the LR's peak (50)
    assert "data.cooldown_weights (the cooldown mix) start at step 32 of 40" in cooldown
    assert "until step 50" in cooldown and "schedule.warmup_steps=16 or lower" in cooldown


def test_warmup_in_tokens_is_named_as_given(compose):
    (w,), steps = warnings_for(compose, "budget.tokens=100_000", "schedule.warmup_steps=null",
                               "schedule.warmup_tokens=200_000")
    assert steps == 49 and "schedule.warmup_tokens=200000 (98 steps)" in w


def test_a_wsd_decay_before_the_peak_alone(compose):
    """Long enough to peak, too short for the decay to start after it (no cooldown mix)."""
    (w,), steps = warnings_for(compose, "schedule=wsd", "budget=steps", "budget.steps=60")
    assert steps == 60 and w.startswith("the WSD decay starts at step 48 of 60")


def test_a_sound_schedule_is_silent(compose):
    assert warnings_for(compose, "+recipe=mixture-tiny")[0] == []  # 254 steps, warmup 50
    assert warnings_for(compose, "budget=steps", "budget.steps=500")[0] == []


def test_a_stage_past_the_end_is_refused(compose):
    cfg = compose(["+recipe=mixture-tiny", "data.stages=[{step: 100, weights: {stdlib: 1}}, "
                   "{step: 254, weights: {site-docs: 1}}]"])
    budget = budget_of(cfg)
    assert budget.steps == 254
    (p,) = schedule_problems(cfg, budget)  # step 100 is inside the run
    assert p.startswith("data.stages[1].step=254 is past the end of this run, 254 steps")
    assert "give it a step below 254" in p
    with pytest.raises(ConfigError):
        check_schedule(cfg, budget)


def test_a_spike_guard_that_never_arms_is_said(compose):
    w, steps = warnings_for(compose, "optim.spike_guard=true", "budget=steps",
                            "budget.steps=60", "schedule.warmup_steps=5")
    assert steps == 60
    (g,) = w
    assert g.startswith("optim.spike_warmup=64 counted steps is not shorter than this run's "
                        "60 steps") and "optim.spike_warmup=15" in g
    assert warnings_for(compose, "budget=steps", "budget.steps=60",
                        "schedule.warmup_steps=5")[0] == []  # the guard is off by default


@pytest.mark.parametrize("z,refused", [(100.0, True), (0.05, True), (1e-2, False), (1e-4, False)])
def test_z_loss_has_an_upper_bound(compose, z, refused):
    cfg = compose([f"train.z_loss={z}"])
    if not refused:
        return
    (p,) = problems(cfg)
    assert p.startswith(f"train.z_loss={z:g} is above 0.01 (100x PaLM's 1e-4)")
    assert "model.vocab_size=4096" in p and "use train.z_loss=1e-4" in p


def dry_run(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return train_py(*overrides, "dry_run=true", f"runs_dir={tmp_path / 'runs'}", cwd=tmp_path)


def test_dry_run_states_the_warnings(tmp_path):
    proc = dry_run(tmp_path, *SHORT_MIX, "data.stages=[{step: 10, weights: {stdlib: 1}}]")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2 and "(50 steps) is not shorter than this run, 40 steps" in warned[0]
    plan = json.loads(proc.stdout)
    assert plan["steps"] == 40 and plan["warnings"] == [w[9:] for w in warned]


def test_dry_run_refuses_a_stage_past_the_end(tmp_path):
    late = dry_run(tmp_path, *SHORT_MIX, "data.stages=[{step: 40, weights: {stdlib: 1}}]")
    assert late.returncode == 2 and late.stdout == ""
    assert late.stderr.splitlines() == [
        "error: data.stages[0].step=40 is past the end of this run, 40 steps (fixed 100,000 "
        "tokens / 2,560 tokens a step): that stage would never apply; give it a step below "
        "40, drop it, or raise the budget"]
