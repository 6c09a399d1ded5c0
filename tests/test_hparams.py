"""Learning rate and batch size from the compute budget (src/pretrain/budget/hparams.py): the
published DeepSeek rules against values computed by hand from the paper's formula, how a
rule's values reach the plan and the layout, and the fit of both laws to a sweep."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pretrain.analysis.hparam_fit import SweepPoint, best_of_budget, fit_hparam_laws
from pretrain.budget.compute import BudgetError
from pretrain.budget.hparams import DEEPSEEK, deepseek_flops_per_token, round_batch
from pretrain.config.schema import ConfigError, ModelConfig
from pretrain.decision.checks import check
from pretrain.decision.resolve import resolve_auto, resolve_plan
from pretrain.train.trainer import run

RULES = ["optim.lr_rule=deepseek", "train.batch_rule=deepseek"]


def test_deepseek_flops_per_token_is_the_papers_formula():
    # M = 72 n_layer d^2 + 12 n_layer d l_seq (arXiv 2401.02954, sec. 3.2)
    m = ModelConfig(n_layer=24, n_head=16, d_model=2048, seq_len=2048, vocab_size=50257)
    assert deepseek_flops_per_token(m) == 72 * 24 * 2048**2 + 12 * 24 * 2048 * 2048


def test_gpt3_1_3b_dry_run_prints_the_published_values(compose, capsys, tmp_path):
    """python train.py +recipe=gpt3-1.3b optim.lr_rule=deepseek train.batch_rule=deepseek
    dry_run=true, in process: the JSON line on stdout holds the rules' values."""
    cfg = compose(["+recipe=gpt3-1.3b", *RULES, "dry_run=true"])
    run(cfg, tmp_path)
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # by hand: M = 72 * 24 * 2048^2 + 12 * 24 * 2048 * 2048 = 8,455,716,864 FLOPs/token,
    # D = 300e9 tokens, C = M D = 2.5367e21
    c = 8_455_716_864 * 300e9
    lr = 0.3118 * c ** -0.1250  # 6.582e-4
    batch = 0.2920 * c ** 0.3271  # 2.929e6 tokens = 1430.2 sequences of 2048
    assert lr == pytest.approx(6.5818e-4, rel=1e-4)
    assert batch == pytest.approx(2.929e6, rel=1e-3)
    rules = plan["hparam_rules"]
    assert rules["compute"] == pytest.approx(c)
    assert plan["lr"] == pytest.approx(lr) and rules["lr"]["lr"] == pytest.approx(lr)
    assert rules["batch"]["tokens_raw"] == pytest.approx(batch)
    # micro batch 4 x dp 1: the multiple of 4 nearest 1430.2 is 1432
    assert plan["global_batch_size"] == rules["batch"]["global_batch_size"] == 1432
    assert plan["global_batch_tokens"] == 1432 * 2048
    assert plan["tokens"] >= 300e9 and plan["steps"] == math.ceil(300e9 / (1432 * 2048))
    assert "deepseek" in rules["lr"]["rule"] and "deepseek" in rules["batch"]["rule"]


def test_fixed_rules_change_nothing(compose):
    cfg = compose(["+recipe=gpt3-1.3b"])
    resolved, notes = resolve_auto(cfg, 1)
    assert "hparam_rules" not in notes
    plan = resolve_plan(resolved).plan
    assert plan["lr"] == 2e-4 and plan["global_batch_size"] == 512
    assert plan["hparam_compute"] == pytest.approx(8_455_716_864 * 300e9)


def test_batch_rounds_to_micro_batch_times_dp(compose):
    """dp is the world size's (parallel.dp=null): 8 ranks x micro batch 4 -> a multiple of
    32 sequences."""
    cfg = compose(["+recipe=gpt3-1.3b", "parallel.dp=null", *RULES])
    resolved, notes = resolve_auto(cfg, 8)
    assert notes["hparam_rules"]["batch"]["multiple"] == 32
    assert resolved.train.global_batch_size == 1440  # 1430.2 -> 45 x 32
    check(resolved, 8)
    # nearest in log scale: 10 sequences -> 12 (not 8), 9 -> 8; never below one multiple
    assert round_batch(100, 10, 4) == 12 and round_batch(90, 10, 4) == 8
    assert round_batch(1, 10, 4) == 4


def test_rule_lr_is_not_rescaled_by_the_reference_batch(compose):
    cfg = compose(["+recipe=llama-1b-fineweb", "optim.lr_rule=deepseek"])
    assert cfg.optim.lr_scaling == "sqrt"
    resolved, notes = resolve_auto(cfg, 1)
    plan = resolve_plan(resolved).plan
    assert plan["lr"] == pytest.approx(DEEPSEEK.lr(notes["hparam_rules"]["compute"]))
    assert "not applied" in notes["hparam_rules"]["lr"]["note"]


def test_power_rule_and_refusals(compose):
    cfg = compose(["+recipe=tiny", "optim.lr_rule=power", "optim.lr_law=[0.5,-0.1]"])
    resolved, notes = resolve_auto(cfg, 1)
    assert resolved.optim.lr == pytest.approx(0.5 * notes["hparam_rules"]["compute"] ** -0.1)
    with pytest.raises(ConfigError, match="optim.lr_law"):
        check(compose(["+recipe=tiny", "optim.lr_rule=power"]))
    with pytest.raises(BudgetError, match="budget.kind=steps"):
        resolve_auto(compose(["budget=steps", "budget.steps=10", "train.batch_rule=deepseek"]),
                     1)


# -- the fit ------------------------------------------------------------------------------

TRUE_LR, TRUE_BATCH = (0.5, -0.15), (0.3, 0.33)


def synthetic_sweep(noise: float, seed: int = 0) -> list[SweepPoint]:
    """5 budgets, 1e17..1e20, each a 5 x 5 grid of lr and batch (a fixed geometric grid per
    budget, not centred on the optimum); loss a bowl in (log lr, log batch) around the
    true optimum, with a cross term, plus Gaussian noise."""
    rng = np.random.default_rng(seed)
    points = []
    for c in np.logspace(17, 20, 5):
        lr_opt = TRUE_LR[0] * c ** TRUE_LR[1]
        b_opt = TRUE_BATCH[0] * c ** TRUE_BATCH[1]
        lr_grid = lr_opt * np.exp(rng.uniform(-0.4, 0.4)) * np.logspace(-0.6, 0.6, 5)
        b_grid = b_opt * np.exp(rng.uniform(-0.4, 0.4)) * np.logspace(-0.6, 0.6, 5)
        for lr in lr_grid:
            for b in b_grid:
                u, v = math.log(lr / lr_opt), math.log(b / b_opt)
                loss = 2.0 + 0.08 * u * u + 0.04 * v * v + 0.02 * u * v
                points.append(SweepPoint(float(c), float(lr), float(b),
                                         loss + noise * rng.standard_normal()))
    return points


def test_fit_recovers_known_constants():
    """Exponents within 0.02, coefficients within 15%, with loss noise of 0.002 (the bowl
    rises 0.05-0.1 across the grid)."""
    laws, optima = fit_hparam_laws(synthetic_sweep(noise=0.002))
    assert len(optima) == 5 and all(o.how == "quadratic" for o in optima)
    assert laws.lr.exponent == pytest.approx(TRUE_LR[1], abs=0.02)
    assert laws.batch_tokens.exponent == pytest.approx(TRUE_BATCH[1], abs=0.02)
    assert laws.lr.coef == pytest.approx(TRUE_LR[0], rel=0.15)
    assert laws.batch_tokens.coef == pytest.approx(TRUE_BATCH[0], rel=0.15)
    exact, _ = fit_hparam_laws(synthetic_sweep(noise=0.0))
    assert exact.lr.exponent == pytest.approx(TRUE_LR[1], abs=1e-6)
    assert exact.batch_tokens.coef == pytest.approx(TRUE_BATCH[0], rel=1e-5)


def test_best_of_budget_falls_back_to_the_best_run_at_the_grid_edge():
    pts = [SweepPoint(1e18, lr, b, 1.0 + math.log(lr) + math.log(b) + 0.1 * math.log(b) ** 2)
           for lr in (1e-3, 2e-3, 4e-3) for b in (1e5, 2e5, 4e5)]  # best is the corner
    best = best_of_budget(pts)
    assert (best.how, best.lr, best.batch_tokens) == ("grid", 1e-3, 1e5)
    assert set(best.edges) == {"lr", "batch"}


def test_scaling_law_tool_hparams_mode(tmp_path, capsys):
    """tools/scaling_law.py --hparams on run directories as a sweep leaves them."""
    for i, p in enumerate(synthetic_sweep(noise=0.0)):
        run_dir = tmp_path / "sweep" / f"run{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "plan.json").write_text(json.dumps(
            {"hparam_compute": p.compute, "lr": p.lr, "global_batch_tokens": p.batch_tokens}))
        (run_dir / "result.json").write_text(json.dumps({"final_val_loss": p.loss}))
    from pretrain.tools import scaling_law

    assert scaling_law.main(["--hparams", str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert "0.3118 C^-0.1250" in out and "0.5 C^-0.1500" in out
    assert "optim.lr_rule=power 'optim.lr_law=[0.5,-0.15]'" in out
    saved = json.loads((tmp_path / "sweep" / "scaling_law" / "hparams.json").read_text())
    assert saved["batch_tokens"]["exponent"] == pytest.approx(0.33)
