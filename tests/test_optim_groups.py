"""Each optimizer group's own values (conf/optim/NAME.yaml) reach the built optimizer unless a
recipe or the command line sets them, and a run with an LR far outside the optimizer's usual
range says so in its plan."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from pretrain.config.paths import CONF_DIR
from pretrain.decision.resolve import describe_run
from pretrain.model.gpt import GPT
from pretrain.optim.factory import scaled_lr
from pretrain.optim.specs import build_optimizer

CPU = torch.device("cpu")


def _group_file(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "optim" / f"{name}.yaml"))


def _built(cfg) -> torch.optim.Optimizer:
    lr = scaled_lr(cfg.optim, cfg.train.global_batch_size * cfg.model.seq_len)
    return build_optimizer(GPT(cfg.model), cfg.optim, lr, CPU)


def _is_muon(group: dict) -> bool:
    return "ns_steps" in group


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "muon"])
def test_the_groups_own_values_reach_the_optimizer(compose, name):
    """Before, conf/config.yaml's optim.lr=3e-3 overrode every group's lr (LARS's 2.0)."""
    own = _group_file(name)
    opt = _built(compose(["model=nano", f"optim={name}"]))
    assert opt.param_groups and {g["lr"] for g in opt.param_groups} == {own["lr"]}
    decays = {g["weight_decay"] for g in opt.param_groups}
    assert decays == {own["weight_decay"], 0.0}  # matrices decay, the rest does not
    for g in opt.param_groups:
        if name == "lars" or (name == "muon" and _is_muon(g)):
            assert g["momentum"] == own["momentum"]
        else:
            assert tuple(g["betas"]) == tuple(own["betas"]) and g["eps"] == own["eps"]
    if name == "muon":
        assert any(_is_muon(g) for g in opt.param_groups)


def test_the_default_run_keeps_its_values(compose):
    """`python train.py` (AdamW on tiny) resolves to the same optimizer as before the groups
    owned their values: lr 3e-3 (then conf/config.yaml's), betas, eps, decay, clip."""
    o = compose([]).optim
    assert (o.name, o.lr, o.betas, o.eps, o.weight_decay, o.grad_clip) == \
        ("adamw", 3e-3, [0.9, 0.95], 1e-8, 0.1, 1.0)


@pytest.mark.parametrize("overrides,lr,decay", [
    # a recipe's values win over the group's: tiny sets lr alone, gpt3-125m AdamW's decay too
    (["+recipe=tiny", "optim=lars"], 3e-3, 1e-4),
    (["+recipe=gpt3-125m", "optim=lamb"], 6e-4, 0.1),
    (["optim=lars", "optim.lr=0.5"], 0.5, 1e-4),  # and the command line's over both
    (["+recipe=gpt3-125m", "optim=lamb", "optim.lr=1e-2", "optim.weight_decay=0"], 1e-2, 0.0),
])
def test_a_recipe_or_the_command_line_wins(compose, overrides, lr, decay):
    o = compose(overrides).optim
    assert (o.lr, o.weight_decay) == (lr, decay)


def _plan(compose, overrides: list[str]) -> dict:
    from pretrain.budget.compute import resolve_budget

    cfg = compose(["model=nano", *overrides])
    return describe_run(cfg, 1, resolve_budget(cfg.model, cfg.budget,
                                               cfg.train.global_batch_size))


@pytest.mark.parametrize("overrides,needle", [
    (["optim=lars", "optim.lr=3e-3"], "lr 0.003 is far below optim=lars's usual range 0.1 "),
    (["optim=adamw", "optim.lr=2.0"], "lr 2 is far above optim=adamw's usual range"),
    (["optim=lamb", "optim.lr=1e-5"], "far below optim=lamb's"),
    # the LR the run uses, after batch scaling: 3e-3 x 512 / 8 = 0.192
    (["optim=adamw", "optim.lr_scaling=linear", "optim.ref_batch_tokens=8"], "lr 0.192 "),
])
def test_an_lr_far_outside_the_optimizers_range_is_in_the_plan(compose, overrides, needle):
    assert needle in _plan(compose, overrides)["lr_warning"]


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "muon"])
def test_the_groups_own_lr_gives_no_warning(compose, name):
    assert "lr_warning" not in _plan(compose, [f"optim={name}"])
