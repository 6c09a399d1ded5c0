"""The update-to-weight ratio hook (train/services/update_ratio.py), a hook that is one file:
||ΔW|| / ||W|| per block and per other top-level module, against a hand computation on a
tiny model; logged on the logging steps that are multiples of train.update_ratio_interval,
off by default."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import read_metrics

from pretrain.train.hooks import LoopContext
from pretrain.train.services.update_ratio import UpdateRatio, build, group_of
from pretrain.train.trainer import run

NANO = ["model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "data.name=tinytext", "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
        "train.global_batch_size=8", "parallel.micro_batch_size=8", "budget=steps",
        "budget.steps=4", "logging=quiet", "logging.wandb=disabled", "logging.log_interval=2",
        "train.eval_batches=1", "train.eval_interval=4", "train.sample_tokens=0",
        "schedule.warmup_steps=1", "checkpoint.enabled=false"]


class Tiny(torch.nn.Module):
    """Parameters named as the GPT's are: an embedding, two blocks, a final norm."""

    def __init__(self):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(1, 2)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 1, bias=False)
                                           for i in range(2)})
        self.norm = torch.nn.LayerNorm(1, bias=False)
        with torch.no_grad():
            self.tok_emb.weight.copy_(torch.tensor([[3.0, 4.0]]))  # ||W|| 5
            self.layers["0"].weight.copy_(torch.tensor([[1.0, 0.0]]))
            self.layers["1"].weight.copy_(torch.tensor([[0.0, 2.0]]))
            self.norm.weight.copy_(torch.tensor([1.0]))


def context(model: torch.nn.Module, clock: SimpleNamespace, interval: int) -> LoopContext:
    cfg = SimpleNamespace(train=SimpleNamespace(update_ratio_interval=interval))
    return LoopContext(cfg=cfg, module=SimpleNamespace(parts=[model]),
                       device=torch.device("cpu"), rank0=True, layout=None, dp_rank=0,
                       world_size=1, total_steps=10, batch_tokens=64,
                       tokenizer=None, logs=lambda step: step % 2 == 0,
                       _step=lambda: clock.step)


def test_the_ratios_are_the_steps_change_over_the_weights_per_group():
    model, clock = Tiny(), SimpleNamespace(step=3)
    ctx = context(model, clock, interval=4)
    hook = build(ctx)
    assert isinstance(hook, UpdateRatio)
    hook.before_step(ctx)  # step 4: a logging step and a multiple of 4
    with torch.no_grad():  # an SGD step with lr 0.1 on hand-picked gradients
        lr = 0.1
        model.tok_emb.weight -= lr * torch.tensor([[3.0, 4.0]])  # ||lr g|| = 0.5
        model.layers["0"].weight -= lr * torch.tensor([[0.0, 1.0]])  # 0.1
        model.layers["1"].weight -= lr * torch.tensor([[6.0, 8.0]])  # 1.0
        # norm untouched
    clock.step = 4
    line: dict = {}
    hook.step_end(ctx.collecting(line))
    assert line == pytest.approx({
        "update_ratio/tok_emb": 0.5 / 5.0, "update_ratio/layers.0": 0.1 / 1.0,
        "update_ratio/layers.1": 1.0 / 2.0, "update_ratio/norm": 0.0}, rel=1e-6)
    assert hook.before is None  # the copy is dropped at once

    hook.before_step(ctx.collecting(None))  # step 5: not a logging step, no copy
    assert hook.before is None
    clock.step = 5
    hook.before_step(ctx)  # step 6: logging, not a multiple of 4
    assert hook.before is None


def test_groups_are_blocks_and_top_level_modules():
    assert group_of("layers.11.attn.wq.weight") == "layers.11"
    assert group_of("_orig_mod.layers.2.mlp.w1.weight") == "layers.2"
    assert group_of("layers.0._checkpoint_wrapped_module.attn.wo.weight") == "layers.0"
    assert group_of("lm_head.weight") == "lm_head" and group_of("norm.weight") == "norm"


def test_a_run_logs_them_when_asked_and_not_by_default(compose, prepared, tmp_path):
    base = [*NANO, f"data.root={prepared.parent}"]
    on = run(compose([*base, "train.update_ratio_interval=4"]), tmp_path / "on")
    assert on["steps"] == 4
    rows = {r["step"]: r for r in read_metrics(tmp_path / "on") if "loss" in r}
    logged = {s: sorted(k for k in r if k.startswith("update_ratio/")) for s, r in rows.items()}
    assert logged[2] == [] and logged[1] == []
    # nano: two blocks, learned positions, the head tied to the embedding (counted once)
    assert logged[4] == ["update_ratio/layers.0", "update_ratio/layers.1",
                         "update_ratio/norm", "update_ratio/pos_emb", "update_ratio/tok_emb"]
    assert all(0 < rows[4][k] < 1 and math.isfinite(rows[4][k]) for k in logged[4])

    run(compose(base), tmp_path / "off")
    assert not any(k.startswith("update_ratio/") for r in read_metrics(tmp_path / "off")
                   for k in r)
    assert build(SimpleNamespace(cfg=compose(base))) is None  # off by default
