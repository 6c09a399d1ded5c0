"""The rules that train a ladder's rungs like its target (src/pretrain/config/ladder_rules.py):
each size's batch from the target's by DeepSeek's exponent, beta2 at a constant horizon in
tokens, the LR with the square root of the batch; and recipes/ladder-pinned.yaml using them."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from helpers import compose_config

from pretrain.config.ladder_rules import BATCH_EXPONENT, eval_batches, ladder_batch, token_beta2
from pretrain.decision.resolve import dry_run

WIDTHS = {16: 1, 24: 1, 32: 2, 48: 3, 60: 4, 72: 6, 160: 16}


def test_each_size_batch_follows_the_target_by_the_compute_exponent():
    assert {w: ladder_batch(w, 160, 16) for w in WIDTHS} == WIDTHS
    # C ~ width^4 at fixed tokens/param: doubling the width is 2^(4 x 0.3271) = 2.48x the batch
    assert ladder_batch(80, 20, 1) == round((80 / 20) ** (4 * BATCH_EXPONENT))
    with pytest.raises(ValueError, match="must be positive"):
        ladder_batch(0, 160, 16)


def test_beta2_keeps_its_horizon_in_tokens():
    assert token_beta2(16, 16, 0.95) == pytest.approx(0.95)
    assert token_beta2(1, 16, 0.95) == pytest.approx(1 - 0.05 / 16)
    # tokens averaged ~ batch / (1 - beta2): the same at every batch
    assert 4 / (1 - token_beta2(4, 16, 0.95)) == pytest.approx(16 / 0.05)
    with pytest.raises(ValueError, match="beta2"):
        token_beta2(4, 16, 1.5)


def test_every_size_is_scored_on_the_same_validation_windows():
    # micro-batches x batch covers the same 1,024 windows at every batch (to within one batch)
    for batch in (1, 2, 3, 4, 6, 16):
        n = eval_batches(1024, batch)
        assert 1024 <= n * batch < 1024 + batch
    with pytest.raises(ValueError, match="must be positive"):
        eval_batches(1024, 0)


@pytest.mark.parametrize("width", [16, 60, 160])
def test_the_pinned_ladder_recipe_composes_the_rules(width):
    cfg = compose_config(["+recipe=ladder-pinned", f"model.d_model={width}"])
    batch = WIDTHS[width]
    assert cfg.train.global_batch_size == batch == cfg.parallel.micro_batch_size
    assert cfg.optim.betas[1] == pytest.approx(token_beta2(batch, 16, 0.95))
    assert cfg.optim.lr_scaling.value == "sqrt" and cfg.optim.ref_batch_tokens == 2048
    assert cfg.train.eval_batches == eval_batches(1024, batch)


def test_the_lr_of_a_rung_is_the_square_root_rule_of_its_batch():
    for width, batch in ((16, 1), (72, 6)):
        cfg = compose_config(["+recipe=ladder-pinned", f"model.d_model={width}",
                              "data.auto_prepare=false"])
        with contextlib.redirect_stdout(io.StringIO()):
            plan = dry_run(cfg)
        assert plan["lr"] == pytest.approx(1e-2 * math.sqrt(batch / 16))
