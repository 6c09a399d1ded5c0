"""Which optim.* keys each optimizer reads (its spec's ``reads``, optim/registry.py) is true of
its builder, and a key the user changed that the chosen optimizer does not read is a one-line
warning naming the key and the optimizer (decision/checks.run_warnings, the plan's ``warnings``), in
process and from
``train.py ... dry_run=true``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from pretrain.budget.compute import resolve_budget
from pretrain.config.schema import ModelConfig, NsDtype, OptimConfig
from pretrain.decision.checks import check, run_warnings
from pretrain.model.gpt import GPT
from pretrain.optim.registry import SHARED_KEYS, OptimizerSpec, register
from pretrain.optim.specs import OPTIMIZERS, build_optimizer, ignored_key_warnings

NANO = dict(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=64)
# A value other than the default for every optimizer-specific key of OptimConfig
CHANGED = {"betas": [0.8, 0.9], "eps": 1e-3, "fused": True, "momentum": 0.5,
           "trust_coefficient": 0.01, "ns_steps": 3, "muon_ns_dtype": NsDtype.float32,
           "weight_decay": 0.3}
OWN_KEYS = {f.name for f in dataclasses.fields(OptimConfig)} - SHARED_KEYS


def fingerprint(name: str, **changed) -> tuple[list, torch.Tensor]:
    """optim=name built on a nano GPT with ``changed`` keys: its groups' hyperparameters,
    and the weights after two steps of fixed random gradients."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**NANO))
    opt = build_optimizer(model, OptimConfig(name=name, **changed), 1e-2, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return groups, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_every_own_key_is_read_by_some_optimizer_and_has_a_changed_value():
    assert set(CHANGED) == OWN_KEYS
    assert set().union(*(s.reads for s in OPTIMIZERS.values())) == OWN_KEYS


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_builder_reads_exactly_the_keys_its_spec_lists(name):
    """A key in ``reads`` changes the built optimizer or its steps; any other leaves both
    bit for bit the same."""
    groups, weights = fingerprint(name)
    for key in sorted(OWN_KEYS):
        g, w = fingerprint(name, **{key: CHANGED[key]})
        same = g == groups and torch.equal(w, weights)
        assert same != (key in OPTIMIZERS[name].reads), (name, key)


def test_a_changed_key_the_optimizer_ignores_is_one_warning(compose):
    cfg = compose(["optim=adafactor", "optim.momentum=0.5", "optim.betas=[0.9,0.95]"])
    check(cfg)  # a warning, not a problem
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    lines = [w for w in run_warnings(cfg, budget) if "is ignored" in w]
    readers = "|".join(n for n, s in OPTIMIZERS.items() if "momentum" in s.reads)
    assert lines == [  # betas at its default: nothing to say
        "optim.momentum=0.5 is ignored: optim=adafactor does not read it (of the optimizer's "
        f"own keys it reads optim.weight_decay); drop it, or use optim={readers}, which read "
        "it"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizers_own_group_sets_no_key_it_ignores(compose, name):
    assert ignored_key_warnings(compose([f"optim={name}"]).optim) == []


def test_the_warning_from_a_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "optim=adafactor", "optim.momentum=0.5",
                           "dry_run=true", f"runs_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "is ignored" in line]
    assert len(said) == 1 and said[0].startswith("warning: optim.momentum=0.5 is ignored")
    assert "optim=adafactor" in said[0]
    assert json.loads(proc.stdout)["warnings"] == [said[0].removeprefix("warning: ")]


def test_a_spec_reading_an_unknown_or_shared_key_is_refused_at_registration():
    for reads in ({"betaz"}, {"lr"}):
        bad = OptimizerSpec("x", lambda *a: None, lambda *a: 0, (1e-3, 1.0),
                            reads=frozenset(reads))
        with pytest.raises(ValueError, match="not optimizer-specific keys"):
            register(bad)
    with pytest.raises(ValueError, match="registered twice"):
        register(OPTIMIZERS["adamw"])
