"""Token budgets from the scaling rules, steps, and FLOPs per token (by hand)."""

from __future__ import annotations

import math

import pytest

from pretrain.budget.compute import BudgetError, count_params, flops_per_token, resolve_budget
from pretrain.config.schema import BudgetConfig, ModelConfig

GPT2_124M = ModelConfig(name="gpt2-124m", n_layer=12, n_head=12, d_model=768, seq_len=1024,
                        vocab_size=50257)
N_124M = 124_439_808
N_124M_NON_EMB = 85_056_000  # 12 * (12 d^2 + 13 d) + 2 d, d = 768
BATCH = 480  # sequences: 480 x 1024 = 491,520 tokens per step


def test_flops_per_token_by_hand_gpt2_124m():
    # N_matmul: every parameter but the position table (the tied head counts once, as the
    # output projection); attention: 12 * L * d * T (PaLM appendix B).
    n_matmul = N_124M - 1024 * 768
    expected = 6 * n_matmul + 12 * 12 * 768 * 1024
    assert expected == 855_166_464
    assert flops_per_token(GPT2_124M) == expected


def test_flops_per_token_untied_counts_the_head_not_the_lookup():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=300,
                      tie_embeddings=False)
    counts = count_params(cfg)
    # Untied: the input table (300 x 64) and position table (64 x 64) are lookups.
    assert counts.matmul == counts.total - 300 * 64 - 64 * 64
    assert flops_per_token(cfg) == 6 * counts.matmul + 12 * 2 * 64 * 64


def test_tokens_per_param_chinchilla():
    b = resolve_budget(GPT2_124M, BudgetConfig(kind="tokens_per_param", tokens_per_param=20),
                       BATCH)
    d = 20 * N_124M  # 2,488,796,160
    assert b.n_params == N_124M
    assert b.n_params_non_embedding == N_124M_NON_EMB
    assert b.global_batch_tokens == 491_520
    assert b.steps == math.ceil(d / 491_520) == 5064
    assert b.tokens == b.steps * 491_520 >= d
    assert b.total_flops == pytest.approx(855_166_464 * b.tokens)


def test_tokens_per_param_kaplan_non_embedding():
    b = resolve_budget(GPT2_124M, BudgetConfig(kind="tokens_per_param", tokens_per_param=20,
                                               param_count="non_embedding"), BATCH)
    assert b.steps == math.ceil(20 * N_124M_NON_EMB / 491_520)


def test_flops_budget():
    c = 1e20
    b = resolve_budget(GPT2_124M, BudgetConfig(kind="flops", flops=c), BATCH)
    d = c / (6 * N_124M)  # about 1.339e11 tokens
    assert b.steps == math.ceil(d / 491_520) == 272_489
    assert b.tokens == b.steps * 491_520


def test_fixed_tokens_rounds_up_to_whole_steps():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, seq_len=256, vocab_size=4096)
    b = resolve_budget(cfg, BudgetConfig(kind="tokens", tokens=1_000_000), 16)
    assert b.global_batch_tokens == 4096
    assert b.steps == 245  # ceil(1e6 / 4096) = ceil(244.14)
    assert b.tokens == 245 * 4096


def test_fixed_steps():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=300)
    b = resolve_budget(cfg, BudgetConfig(kind="steps", steps=30), 16)
    assert (b.steps, b.tokens, b.global_batch_tokens) == (30, 30 * 16 * 64, 1024)
    assert b.total_flops == flops_per_token(cfg) * 30 * 1024


@pytest.mark.parametrize("budget,key", [
    (BudgetConfig(kind="tokens", tokens=None), "budget.tokens"),
    (BudgetConfig(kind="flops", flops=None), "budget.flops"),
    (BudgetConfig(kind="steps", steps=0), "budget.steps"),
    (BudgetConfig(kind="tokens_per_param", tokens_per_param=0), "budget.tokens_per_param"),
])
def test_budget_errors_name_the_key(budget, key):
    with pytest.raises(BudgetError, match=key.replace(".", r"\.")):
        resolve_budget(GPT2_124M, budget, BATCH)
