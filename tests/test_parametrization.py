"""model.parametrization=sp|mup|completep: the rules (init, per-group LR/epsilon/decay,
multipliers), the refusal for optimizers without a rule, and the coordinate check."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pretrain.config.schema import Config, ConfigError, ModelConfig, OptimConfig
from pretrain.decision.checks import check
from pretrain.model.gpt import GPT
from pretrain.optim.specs import build_optimizer

CPU = torch.device("cpu")


def tiny(**kw) -> ModelConfig:
    return ModelConfig(n_layer=2, n_head=4, d_model=kw.pop("d_model", 64), vocab_size=128,
                       seq_len=16, tie_embeddings=kw.pop("tie_embeddings", True), **kw)


def built(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.init_weights(0)
    return model


def test_base_width_mup_starts_from_the_sp_weights():
    sp, mup = built(tiny()), built(tiny(parametrization="mup", base_width=64))
    for (name, a), (_, b) in zip(sp.named_parameters(), mup.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_base_width_mup_computes_sp():
    """The attention keeps the base width's scale (sqrt(d_head_base) / d_head: the mup
    package's attn_mult), so the base model is sp's to the bit; before, 1/d_head made its
    scores 1/sqrt(d_head) = 1/4 of sp's here."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    sp, mup = built(tiny()), built(tiny(parametrization="mup", base_width=64))
    assert torch.equal(sp(tokens), mup(tokens))


@pytest.mark.parametrize("width,scale", [(64, 1 / 4), (256, 1 / 16), (1024, 1 / 64)])
def test_attention_scale_is_one_over_d_head_from_the_bases_sp_scale(width, scale):
    from pretrain.model.parametrization import attention_scale

    cfg = tiny(d_model=width, parametrization="mup", base_width=64)  # 4 heads: d_head_base 16
    assert attention_scale(cfg) == pytest.approx(scale, rel=1e-12)
    assert attention_scale(tiny(d_model=width)) is None  # sp: the kernel's 1/sqrt(d_head)


def test_output_mult_is_the_bases_logit_multiplier_and_sp_ignores_it():
    """logits x output_mult x base_width / d_model under mup; sp's are as they were."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    base = built(tiny(parametrization="mup", base_width=64, output_mult=2.0))
    assert torch.equal(base(tokens), 2.0 * built(tiny())(tokens))
    assert built(tiny(d_model=128, parametrization="mup", base_width=64,
                      output_mult=3.0)).output_scale == 1.5
    assert built(tiny(output_mult=4.0)).output_scale == 1.0


def test_a_non_positive_output_mult_is_refused():
    from pretrain.model.parametrization import problems

    found = problems(tiny(parametrization="mup", base_width=64, output_mult=0.0))
    assert found == ["model.output_mult=0.0 must be positive (1: the base's logits unscaled)"]


def test_hidden_init_shrinks_with_width_and_vector_like_does_not():
    wide = built(tiny(d_model=256, parametrization="mup", base_width=64))
    sp = built(tiny(d_model=256))
    assert wide.layers["0"].attn.wq.weight.std().item() == pytest.approx(
        sp.layers["0"].attn.wq.weight.std().item() / 2, rel=0.05)
    assert torch.equal(wide.tok_emb.weight, sp.tok_emb.weight)
    assert wide.output_scale == 0.25 and sp.output_scale == 1.0


def test_completep_residual_init_and_multiplier_follow_the_base_depth():
    cfg = tiny(parametrization="completep", base_width=64, base_depth=1)
    model = built(cfg)
    assert model.layers["0"].residual == 0.5
    assert model.layers["1"].mlp.w2.weight.std().item() == pytest.approx(
        0.02 / math.sqrt(2), rel=0.05
    )


def groups(cfg: ModelConfig, name: str = "adamw"):
    optim = OptimConfig(name=name, lr=1e-2, eps=1e-8, weight_decay=0.1)
    return build_optimizer(built(cfg), optim, 1e-2, CPU).param_groups


def test_sp_groups_are_unchanged():
    decay, no_decay = groups(tiny())
    assert decay["lr"] == no_decay["lr"] == 1e-2 and decay["weight_decay"] == 0.1
    assert decay["eps"] == no_decay["eps"] == 1e-8 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("kind", ["mup", "completep"])
def test_mup_groups_scale_lr_eps_and_decay(kind):
    cfg = tiny(d_model=256, parametrization=kind, base_width=64, base_depth=1,
               tie_embeddings=False)
    other, hidden = groups(cfg)
    names = {id(p): n for n, p in built(cfg).named_parameters()}
    assert other["lr"] == 1e-2 and hidden["lr"] == pytest.approx(1e-2 / 4)
    assert other["eps"] == pytest.approx(1e-8 / 4)
    assert hidden["eps"] == pytest.approx(1e-8 / 4 / (2 if kind == "completep" else 1))
    # x width under both: lr x decay stays the base's (the mup package's MuAdamW, coupled
    # decay; mup kept 0.1 before, so its per-step decay fell with the width)
    assert hidden["weight_decay"] == pytest.approx(0.1 * 4)
    assert len(hidden["params"]) == 2 * 6 and len(other["params"]) == len(names) - 12


def test_muon_takes_the_width_rule_and_steps():
    cfg = tiny(d_model=128, parametrization="mup", base_width=64, tie_embeddings=False)
    model = built(cfg)
    opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-2), 1e-2, CPU)
    # Muon's matrices, then AdamW's vector-like group (no 3-D experts: no AdamW hidden group)
    muon, adam_other = opt.param_groups
    assert muon["lr"] == pytest.approx(5e-3) and adam_other["lr"] == 1e-2
    assert adam_other["eps"] == pytest.approx(1e-8 / 2)
    tokens = torch.randint(0, 128, (2, 16))
    before = model.layers["0"].attn.wq.weight.detach().clone()
    model(tokens).float().logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(before, model.layers["0"].attn.wq.weight)


def test_lamb_and_lars_are_refused_by_name():
    cfg = Config(model=tiny(parametrization="mup"), optim=OptimConfig(name="lamb"))
    with pytest.raises(ConfigError, match="parametrization=mup with optim=lamb"):
        check(cfg)
    with pytest.raises(ValueError, match="no rule for optim=lars"):
        groups(tiny(parametrization="completep"), "lars")


@pytest.mark.parametrize("kind", ["sp", "mup", "completep"])
@pytest.mark.parametrize("value", [0, -8])
def test_a_base_width_that_is_no_width_is_refused_under_every_parametrization(
        compose, kind, value):
    """Before anything is built (resolve_run: a run's first step): the key and the fix
    named, sp included (it ignores the base, but a sweep shares the recipe with mup)."""
    from pretrain.decision.resolve import resolve_run

    cfg = compose(["model=nano", f"model.parametrization={kind}",
                   f"model.base_width={value}"])
    with pytest.raises(ConfigError, match=rf"model.base_width={value} must be positive: the "
                                          r"d_model the hyperparameters were tuned at \(or "
                                          "null"):
        resolve_run(cfg)


def test_a_model_narrower_than_its_base_width_is_stated_in_the_plan(compose):
    """muP's rules are ratios that hold on both sides of the base (the mup package and
    Tensor Programs V's sweeps span widths below it), so m < 1 is run, and said."""
    from pretrain.decision.resolve import resolve_plan

    narrow = compose(["model=nano", "model.parametrization=mup",
                      "model.base_width=" + str(2 * compose(["model=nano"]).model.d_model)])
    plan = resolve_plan(narrow).plan
    assert plan["width_multiplier"] == 0.5
    assert "narrower than model.base_width" in plan["width_note"]
    assert "LR is 2x the tuned one" in plan["width_note"]
    wide = resolve_plan(compose(["model=nano", "model.parametrization=mup",
                                 "model.base_width=16"])).plan
    assert "width_note" not in wide and wide["width_multiplier"] > 1
    assert "width_multiplier" not in resolve_plan(compose(["model=nano"])).plan  # sp


def test_coord_check_flat_under_mup_and_completep_not_under_sp(tmp_path):
    """The issue's bar on a cheap subset: widths 64..256, 3 steps, fp32."""
    from pretrain.tools.coord_check import main

    assert main(["--widths", "64", "128", "256", "--steps", "3", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "coord_check.json").read_text())
    slopes = {k: r["max_slope"] for k, r in result["parametrizations"].items()}
    assert slopes["mup"] < 0.1 and slopes["completep"] < 0.1, slopes
    assert slopes["sp"] > 0.3, slopes
    assert (tmp_path / "coord_check.png").stat().st_size > 0


def write_run(root, kind: str, width: int, lr: float, loss: float) -> None:
    run = root / f"{kind}-{width}-{lr}"
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"parametrization": kind, "width": width,
                                               "lr": lr}))
    (run / "result.json").write_text(json.dumps({"final_val_loss": loss}))


def test_transfer_finds_each_widths_optimum_and_the_drift(tmp_path):
    """Synthetic sweep: loss = 3 + 0.1 (log2 lr - log2 best)^2, the best LR fixed for
    'mup' and halving per doubling of width for 'sp' (off grid by a quarter step)."""
    from pretrain.tools.scaling_law import main

    grid = [1e-3 * 2 ** k for k in range(6)]
    for width in (64, 128, 256, 512):
        k = math.log2(width / 64)
        for kind, best in (("mup", 4e-3 * 2 ** 0.25), ("sp", 1.6e-2 * 2 ** (0.25 - k))):
            for lr in grid:
                write_run(tmp_path, kind, width, lr, 3 + 0.1 * math.log2(lr / best) ** 2)
    assert main(["--transfer", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "transfer.json").read_text())["report"]
    assert [o["lr"] for o in report["mup"]["optima"]] == pytest.approx([4e-3 * 2 ** .25] * 4)
    assert report["mup"]["drift_steps"] == pytest.approx(0, abs=1e-9)
    assert report["sp"]["drift_steps"] == pytest.approx(-3)
    assert report["sp"]["optima"][0]["loss"] == pytest.approx(3)
    assert (tmp_path / "out" / "transfer.png").stat().st_size > 0
