"""optim=adafactor (torch.optim.Adafactor, added through its spec alone: optim/specs.py's
entry, conf/optim/adafactor.yaml and this test): the trainer's loss falls over a few steps
on a nano model, the planner counts its factored state exactly, (rows + cols) per matrix,
not AdamW's 2 x rows x cols, and the layouts whose DTensor parameters torch's Adafactor
cannot step (FSDP2 over several processes, TP) are refused before anything is built."""

from __future__ import annotations

import pytest
import torch
from helpers import MARKOV_DATA, problems

from pretrain.parallel.layout import resolve_layout
from pretrain.planning.memory import rank_memory
from pretrain.train.trainer import Trainer

STEPS = 8


def test_adafactor_trains_a_nano_model_and_the_plan_counts_its_state(compose, markov_root,
                                                                     tmp_path):
    cfg = compose(
        [
            "model=nano",
            "optim=adafactor",
            "optim.lr=0.1",
            *MARKOV_DATA,
            f"data.root={markov_root}",
            "budget=steps",
            f"budget.steps={STEPS}",
            "train.global_batch_size=4",
            "parallel.micro_batch_size=4",
            "schedule.warmup_steps=0",
            "schedule.decay=constant",
            "train.eval_interval=1000",
            "train.sample_tokens=0",
            "logging=quiet",
            "precision=fp32",
        ]
    )
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.setup()
        opt = trainer.module.optimizer
        assert isinstance(opt, torch.optim.Adafactor)
        losses = [float(trainer.train_step()[0]) for _ in range(STEPS)]
        real = sum(t.numel() * t.element_size() for s in opt.state.values()
                   for t in s.values() if torch.is_tensor(t))
        params = list(trainer.module.model.parameters())
    finally:
        trainer.close()
    assert losses[-1] < losses[0] - 1.0, losses  # measured 8.327 -> 6.659
    planned = rank_memory(cfg, resolve_layout(cfg, 1), 0, device="cpu").parts["optimizer state"]
    assert planned == real
    adamw = sum(2 * 4 * p.numel() + 4 for p in params)
    assert real < adamw / 20, (real, adamw)  # factored: a small fraction of AdamW's moments


@pytest.mark.parametrize("layout,refused", [
    (["parallel.dp=2", "parallel.dp_mode=zero3"], "FSDP2 (parallel.dp_mode=zero3)"),
    (["parallel.tp=2", "parallel.dp=1"], "which TP makes"),
])
def test_layouts_with_dtensor_parameters_are_refused(compose, layout, refused):
    found = problems(compose(["model=nano", "optim=adafactor", *layout]))
    assert any(refused in p and "parallel.dp_mode=ddp" in p for p in found), found


def test_ddp_and_one_process_are_accepted(compose):
    from pretrain.decision.checks import check

    check(compose(["model=nano", "optim=adafactor", "parallel.dp=2", "parallel.dp_mode=ddp",
                   "parallel.micro_batch_size=4"]))
    check(compose(["model=nano", "optim=adafactor"]))
