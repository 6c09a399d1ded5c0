"""AdamW parameter groups, the LR schedules and LR scaling with batch size."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from pretrain.model.gpt import GPT
from pretrain.optim.factory import (
    build_scheduler,
    lr_multiplier,
    scaled_lr,
    warmup_steps,
)
from pretrain.optim.specs import build_optimizer

CPU = torch.device("cpu")
NANO = dict(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=300)


def groups_by_name(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0
                for p in g["params"]}
    return decay, no_decay


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_weight_decay_only_on_matrices(tie):
    model = GPT(ModelConfig(**NANO, tie_embeddings=tie))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), 1e-3, CPU)
    decay, no_decay = groups_by_name(model, opt)
    matrices = {f"layers.{i}.{m}.weight" for i in range(2)
                for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2")}
    if not tie:
        matrices.add("lm_head.weight")
    assert decay == matrices
    assert "tok_emb.weight" in no_decay and "pos_emb.weight" in no_decay
    assert {n for n in no_decay if "norm" in n} == {
        "norm.weight", "norm.bias",
        *(f"layers.{i}.{m}_norm.{w}" for i in range(2) for m in ("attn", "mlp")
          for w in ("weight", "bias"))}
    assert all(n.endswith(".bias") for n in no_decay - {"tok_emb.weight", "pos_emb.weight"}
               if "norm" not in n)
    # Every parameter in exactly one group, the tied head/embedding once.
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert decay.isdisjoint(no_decay)


def test_decay_applied_to_matrices_only_in_a_step():
    """With zero gradients AdamW's update is pure decay: p <- p * (1 - lr * wd)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**NANO))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), 0.5, CPU)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["layers.0.mlp.w1.weight"].detach(),
                               before["layers.0.mlp.w1.weight"] * 0.95)
    for name in ("tok_emb.weight", "pos_emb.weight", "layers.0.attn_norm.weight",
                 "layers.0.mlp.w1.bias"):
        assert torch.equal(after[name].detach(), before[name]), name


COS = ScheduleConfig(decay="cosine", min_lr_ratio=0.1)
LIN = ScheduleConfig(decay="linear", min_lr_ratio=0.0)
WSD = ScheduleConfig(decay="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
CONST = ScheduleConfig(decay="constant")


@pytest.mark.parametrize("cfg,step,expected", [
    # Linear warmup over 10 steps: (step + 1) / 10, peak at step 9.
    (COS, 0, 0.1), (COS, 4, 0.5), (COS, 9, 1.0),
    # Cosine over the remaining 90 steps: halfway (step 54) at the mean of 1 and 0.1,
    # ending exactly at min_lr_ratio on the last step (99).
    (COS, 54, 0.55), (COS, 31, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 22 / 90))),
    (COS, 99, 0.1),
    (LIN, 0, 0.1), (LIN, 54, 0.5), (LIN, 99, 0.0),
    # WSD: peak until the last 20% (steps 80..99), then linear to 0.
    (WSD, 4, 0.5), (WSD, 10, 1.0), (WSD, 79, 1.0), (WSD, 80, 0.95), (WSD, 89, 0.5),
    (WSD, 99, 0.0),
    (CONST, 3, 0.4), (CONST, 50, 1.0), (CONST, 99, 1.0),
])
def test_lr_multiplier(cfg, step, expected):
    assert lr_multiplier(step, 100, 10, cfg) == pytest.approx(expected, abs=1e-12)


def test_schedule_is_monotone_after_warmup():
    for cfg in (COS, LIN, WSD):
        values = [lr_multiplier(s, 100, 10, cfg) for s in range(9, 100)]
        assert all(a >= b for a, b in zip(values, values[1:], strict=False)), cfg.decay


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = build_scheduler(opt, ScheduleConfig(decay="cosine", warmup_steps=10,
                                                min_lr_ratio=0.1), 100, 1024)
    seen = []
    for _ in range(100):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(2e-4)
    assert seen[9] == pytest.approx(2e-3)
    assert seen[54] == pytest.approx(1.1e-3)
    assert seen[99] == pytest.approx(2e-4)


def test_warmup_in_tokens():
    cfg = ScheduleConfig(warmup_tokens=375_000_000)
    assert warmup_steps(cfg, 256 * 2048) == 716  # ceil(375e6 / 524288) = ceil(715.26)
    assert warmup_steps(ScheduleConfig(warmup_steps=30), 4096) == 30
    assert warmup_steps(ScheduleConfig(), 4096) == 0
    with pytest.raises(ValueError, match="warmup_steps or schedule.warmup_tokens"):
        warmup_steps(ScheduleConfig(warmup_steps=5, warmup_tokens=10), 4096)


@pytest.mark.parametrize("rule,batch_tokens,expected", [
    ("none", 1_048_576, 3e-3),
    ("sqrt", 1_048_576, 3e-3 * math.sqrt(2)),
    ("linear", 1_048_576, 6e-3),
    ("sqrt", 131_072, 1.5e-3),
    ("linear", 131_072, 0.75e-3),
])
def test_lr_scaling_from_reference_batch(rule, batch_tokens, expected):
    cfg = OptimConfig(lr=3e-3, ref_batch_tokens=524_288, lr_scaling=rule)
    assert scaled_lr(cfg, batch_tokens) == pytest.approx(expected)
