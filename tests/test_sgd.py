"""optim=sgd (torch.optim.SGD with Nesterov momentum), added as one module
(src/pretrain/optim/optimizers/sgd.py), its conf/optim/sgd.yaml and this test: the trainer's
loss falls over a few steps on a nano model, the planner counts its state (one momentum
buffer per parameter) exactly, and as an elementwise optimizer that steps DTensors it is
accepted on every layout."""

from __future__ import annotations

import pytest
import torch
from helpers import MARKOV_DATA

from pretrain.decision.checks import check
from pretrain.parallel.layout import resolve_layout
from pretrain.planning.memory import rank_memory
from pretrain.train.trainer import Trainer

STEPS = 8


def test_sgd_trains_a_nano_model_and_the_plan_counts_its_state(compose, markov_root, tmp_path):
    cfg = compose(["model=nano", "optim=sgd", *MARKOV_DATA, f"data.root={markov_root}",
                   "budget=steps", f"budget.steps={STEPS}", "train.global_batch_size=4",
                   "parallel.micro_batch_size=4", "schedule.warmup_steps=0",
                   "schedule.decay=constant", "train.eval_interval=1000",
                   "train.sample_tokens=0", "logging=quiet", "precision=fp32"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.setup()
        opt = trainer.module.optimizer
        assert isinstance(opt, torch.optim.SGD)
        assert [(g["momentum"], g["nesterov"]) for g in opt.param_groups] == [(0.9, True)] * 2
        losses = [float(trainer.train_step()[0]) for _ in range(STEPS)]
        real = sum(t.numel() * t.element_size() for s in opt.state.values()
                   for t in s.values() if torch.is_tensor(t))
        params = sum(p.numel() * p.element_size() for p in trainer.module.model.parameters())
    finally:
        trainer.close()
    assert losses[-1] < losses[0] - 1.0, losses  # lr 0.3: 8.327 -> 6.501 at step 8
    planned = rank_memory(cfg, resolve_layout(cfg, 1), 0, device="cpu").parts["optimizer state"]
    assert planned == real == params  # one momentum buffer like each parameter


@pytest.mark.parametrize("layout", [
    ["parallel.dp=2", "parallel.dp_mode=zero3"], ["parallel.tp=2", "parallel.dp=1"],
    ["parallel.dp=2", "parallel.dp_mode=zero3", "parallel.offload=params"]])
def test_every_layout_is_accepted(compose, layout):
    check(compose(["model=nano", "optim=sgd", "parallel.micro_batch_size=4", *layout]))
