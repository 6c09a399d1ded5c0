"""LAMB, LARS and Muon (optim=lamb|lars|muon) train like one process on zero3 dp=2, tp=2
and pp=2 (CPU, gloo, fp32; tests/test_parallel_layouts.py's nano GPT, steps and bounds),
and resume exactly from a checkpoint, optimizer state included, on the layout that saved
it and (Muon) on another. All 2-process runs share one set of processes
(tests/optim_worker.py, forked by helpers.run_ranks).

The layouts and the one-process references train LAYOUT_STEPS = 3 steps, as the dense
layouts do (a wrong gradient shows in the first step, a wrong optimizer state from the
second on; observed after 3: loss 9.5e-7, param 2.0e-6, update 1.6e-5 against 1e-4, lr / 4
and 1e-3, native and under the AVX2 imitation), not COMMON's 5 (8 s of the file's 47 s of
CPU, issue 69). Each reference's loss falls at every step and by 0.048 (LAMB), 0.054
(LARS), 0.034 (Muon) in all, the same on both ISAs: LEARNS = 0.02 below the least. The
resume runs train RESUME_STEPS = 4, saving after K = 2 (a state of two gradients), and
continue 2 steps on the loading layout: the second one is the first whose loss shows the
loaded optimizer state, the only check on a layout that differs from the saving one.

The runs take micro-batches of 8 (MICRO_BATCH), not the layout test's 2: two a step on one
process, tp2 and pp2, one on each zero3 rank. An optimizer sees the accumulated gradient,
not how it was accumulated (accumulation over 8 micro-batches a step is
test_parallel_layouts's), and the group's fixture took 29-36 s instead of 40 (issue 69;
``pytest -q -p no:cacheprovider --durations=0 tests/test_optimizers.py``, one process).

Muon's runs set optim.muon_ns_dtype=float32. In bf16 (torch's and the GPU default) the
layouts gather the same fp32 momentum as one process up to reduction order (~1e-7
relative), but five bf16 iterations turn those last bits into ~1% of the orthogonalised
update (measured up to 1.1e-2 relative per matrix on zero3, and 4.1e-3 in the later
AdamW updates that depend on it), which needed bounds of 5e-2 and 2e-2. In fp32 the same
runs agree to 1.1e-5 (tp2), 9.6e-6 (zero3), 9.2e-6 (pp2) relative per tensor update after
5 steps, and 1.6e-5, 1.5e-5, 7.4e-6 after 3 (either ISA), so every bound (losses, grad
norms, every coordinate within lr / 4, each tensor's update within 1e-3) is the layout
test's own; bf16's iteration is torch's, checked on one process and on shards by the unit
tests below. A wrong shard or a
lost reduction still moves a whole update by O(1) (a gradient scaled by a constant is the
one error Muon cannot see: Newton-Schulz normalises it away). The unit tests compare the trust
ratios with a reference written from the
papers, and Muon's update of a matrix sharded on either dimension with the one-process
update (tests/optim_shard_worker.py, 2 processes)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from built_once import built_once
from helpers import HERE, compose_all, failed, one_thread, problems, run_ranks, write_spec
from test_parallel_layouts import BASE, LAYOUT_STEPS, assert_same_training

from pretrain.optim.muon import orthogonalisation_bytes

# The LR of each, for the nano model: LARS's step is lr x eta x ||w|| per matrix (AdamW's
# 1e-3 per element is ~lr x 1e-3 x 0.02 here) and plain momentum SGD on the rest.
OPTIMS = {
    "lamb": ["optim=lamb", "optim.lr=2e-3"],
    "lars": ["optim=lars", "optim.lr=0.5", "optim.trust_coefficient=0.02"],
    "muon": ["optim=muon", "optim.lr=1e-3", "optim.muon_ns_dtype=float32"],
}
LAYOUTS = {
    "zero3_dp2": ["parallel.dp=2", "parallel.dp_mode=zero3"],
    "tp2": ["parallel.tp=2", "parallel.dp=1"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=1f1b"],
}
MICRO_BATCH = "parallel.micro_batch_size=8"  # the module docstring: why not COMMON's 2
LEARNS = 0.02  # each reference's loss falls by more over LAYOUT_STEPS (module docstring)
K, RESUME_STEPS = 2, 4  # the resume runs: a checkpoint after K steps, RESUME_STEPS in all
# after the layouts' budget: the later override of budget.steps wins
CKPT = ["checkpoint.enabled=true", "checkpoint.async_save=false",
        f"budget.steps={RESUME_STEPS}"]
# name -> (optimizer, layout that saves, {load name: layout that resumes})
RESUMES = {
    "lamb_zero3": ("lamb", "zero3_dp2", {"same": "zero3_dp2"}),
    "lars_zero3": ("lars", "zero3_dp2", {"same": "zero3_dp2"}),
    "muon_zero3": ("muon", "zero3_dp2", {"same": "zero3_dp2", "tp2": "tp2"}),
}

def _run(root, common: list[str], nproc: int, layouts: dict, resumes: dict) -> dict:
    """helpers.run_group with tests/optim_worker.py (layouts, then resumes)."""
    out = root / f"world{nproc}"
    out.mkdir()

    def configs(overrides: dict[str, list[str]]):
        return compose_all({n: [*common, *o, "run_name=test"] for n, o in overrides.items()})

    spec = {"configs": configs(layouts), "eval_also": [], "resumes": {}}
    for name, (opt, save, loads) in resumes.items():
        # composed once per layout: a load on the saving layout takes a copy of its config
        cfgs = configs({lay: [*OPTIMS[opt], *LAYOUTS[lay], *CKPT]
                        for lay in {save, *loads.values()}})
        spec["resumes"][name] = {"save": cfgs[save], "k": K,
                                 "loads": {n: copy.deepcopy(cfgs[lay])
                                           for n, lay in loads.items()}}
    if nproc == 1:
        from optim_worker import run_layout

        with one_thread():
            for name, cfg in spec["configs"].items():
                run_layout(cfg, out, name, spec["eval_also"])
    else:
        spec_file = write_spec(out / "spec.pkl", **spec)
        proc = run_ranks(HERE / "optim_worker.py", str(out), str(spec_file), nproc=nproc,
                         cwd=root)
        assert proc.returncode == 0, failed(proc)
    return {n: torch.load(out / f"{n}.pt", weights_only=False) for n in [*layouts, *resumes]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, markov_root) -> dict[int, dict]:
    """Once per pytest run (tests/built_once.py)."""
    return built_once(tmp_path_factory, "optimizers", lambda root: train_all(root, markov_root))


def train_all(root: Path, markov_root: Path) -> dict[int, dict]:
    common = [*(o for o in BASE if not o.startswith("parallel.micro_batch_size=")),
              f"budget.steps={LAYOUT_STEPS}", MICRO_BATCH, f"data.root={markov_root}",
              f"runs_dir={root / 'runs'}"]
    one = _run(root, common, 1, {opt: o for opt, o in OPTIMS.items()}, {})
    two = _run(root, common, 2, {f"{opt}_{lay}": [*o, *LAYOUTS[lay]]
                                 for opt, o in OPTIMS.items() for lay in LAYOUTS}, RESUMES)
    return {1: one, 2: two}


@pytest.mark.slow
@pytest.mark.parametrize("opt", list(OPTIMS))
def test_the_reference_learns(runs, opt):
    losses = runs[1][opt]["losses"]
    print(f"{opt}: losses {', '.join(f'{x:.4f}' for x in losses)}")
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - LEARNS, losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("opt", list(OPTIMS))
def test_trains_like_one_process(runs, opt, layout):
    diffs = assert_same_training(runs[2][f"{opt}_{layout}"], runs[1][opt])
    print(f"{opt} {layout}: max loss diff {diffs['loss']:.1e}, param {diffs['param']:.1e}, "
          f"update {diffs['update']:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_resumes_exactly_from_a_checkpoint(runs, name):
    """The optimizer state loads as it was saved, bit for bit, on any layout; on the
    saving layout the remaining steps repeat the uninterrupted run's exactly, on another
    within the layout bounds."""
    got = runs[2][name]
    saved = got["saved_state"]
    assert saved and len(got["straight"]) == RESUME_STEPS - K
    for load_name, load in got["loads"].items():
        assert load["step"] == K
        assert load["state"].keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(load["state"][key], value), (load_name, key)
        if RESUMES[name][2][load_name] == RESUMES[name][1]:  # the saving layout
            assert load["losses"] == got["straight"]
            for key, value in got["straight_final"].items():
                assert torch.equal(load["final"][key], value), key
        else:
            for a, b in zip(load["losses"], got["straight"], strict=True):
                assert abs(a - b) <= 1e-4


# -- unit tests, one process ----------------------------------------------------------------


def _lamb_reference(w, grads, lr, betas, eps, wd):
    """LAMB (You et al. 2020, Algorithm 2) written out for one tensor."""
    m = v = torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        r = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps) + wd * w
        w = w - lr * (w.norm() / r.norm()) * r
    return w


def _lars_reference(w, grads, lr, momentum, wd, eta):
    """LARS (You et al. 2017, Algorithm 1) for one tensor."""
    buf = torch.zeros_like(w)
    for g in grads:
        d = g + wd * w
        buf = momentum * buf + eta * w.norm() / d.norm() * d
        w = w - lr * buf
    return w


def _steps(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()


def test_lamb_and_lars_trust_ratios_equal_the_papers():
    from pretrain.optim.trust_ratio import Lamb, Lars

    torch.manual_seed(0)
    w0, b0 = torch.randn(8, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    grads = [(torch.randn(8, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64))
             for _ in range(3)]
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    lamb = Lamb([{"params": [w]}, {"params": [b], "weight_decay": 0.0, "trust_ratio": False}],
                lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    _steps(lamb, [w, b], grads)
    torch.testing.assert_close(w.detach(), _lamb_reference(w0, [g for g, _ in grads], 0.01,
                                                           (0.9, 0.99), 1e-6, 0.1),
                               rtol=1e-12, atol=1e-12)
    # the excluded bias: plain Adam (a trust ratio of 1, no decay), torch's own numbers
    ref = torch.nn.Parameter(b0.clone())
    _steps(torch.optim.Adam([ref], lr=0.01, betas=(0.9, 0.99), eps=1e-6), [ref],
           [(g,) for _, g in grads])
    torch.testing.assert_close(b.detach(), ref.detach(), rtol=1e-12, atol=1e-12)

    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    lars = Lars([{"params": [w]}, {"params": [b], "weight_decay": 0.0, "trust_ratio": False}],
                lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)
    _steps(lars, [w, b], grads)
    torch.testing.assert_close(w.detach(), _lars_reference(w0, [g for g, _ in grads], 0.5,
                                                           0.9, 0.01, 0.02),
                               rtol=1e-12, atol=1e-12)
    ref = torch.nn.Parameter(b0.clone())
    _steps(torch.optim.SGD([ref], lr=0.5, momentum=0.9), [ref], [(g,) for _, g in grads])
    torch.testing.assert_close(b.detach(), ref.detach(), rtol=1e-12, atol=1e-12)


def test_muon_on_one_process_is_torchs_muon():
    """ShardedMuon on plain tensors is torch.optim.Muon, bit for bit; MuonWithAdamW's
    AdamW half is torch's AdamW; match_rms_adamw scales by 0.2 sqrt(max(m, n))."""
    from pretrain.optim.muon import MuonWithAdamW, ShardedMuon

    torch.manual_seed(0)
    w0, b0 = torch.randn(16, 8), torch.randn(8)
    grads = [(torch.randn(16, 8), torch.randn(8)) for _ in range(3)]
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    kw = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    opt = MuonWithAdamW(ShardedMuon([w], **kw), torch.optim.AdamW([b], lr=0.02))
    _steps(opt, [w, b], grads)
    rw, rb = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    _steps(torch.optim.Muon([rw], **kw), [rw], [(g,) for g, _ in grads])
    _steps(torch.optim.AdamW([rb], lr=0.02), [rb], [(g,) for _, g in grads])
    assert torch.equal(w, rw) and torch.equal(b, rb)
    # one step from zero momentum: the update's RMS is 0.2 lr (Moonlight's match to AdamW)
    p = torch.nn.Parameter(torch.zeros(64, 32))
    p.grad = torch.randn(64, 32)
    ShardedMuon([p], lr=1.0, weight_decay=0.0, adjust_lr_fn="match_rms_adamw").step()
    rms = p.detach().pow(2).mean().sqrt().item()
    assert rms == pytest.approx(0.2, rel=0.35)  # O has RMS 1/sqrt(64), x 0.2 sqrt(64)


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
def test_newton_schulz_in_float32_is_torchs_iteration(shape):
    """optim.muon_ns_dtype=float32 runs torch's quintic iteration in fp32: it agrees with
    the same iteration in float64 to fp32 rounding, with torch's bf16 one to bf16 rounding
    (a different iteration would differ by O(1)), and leaves its input as it was."""
    from pretrain.optim.muon import newton_schulz

    torch.manual_seed(0)
    m = torch.randn(*shape)
    before = m.clone()
    group = torch.optim.Muon([torch.nn.Parameter(m)]).param_groups[0]
    fp32 = newton_schulz(m, group, torch.float32)
    fp64 = newton_schulz(m.double(), group, torch.float64)
    bf16 = newton_schulz(m, group)  # torch's _zeropower_via_newtonschulz
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert ((fp32 - fp64).norm() / fp64.norm()).item() < 1e-5
    assert 1e-4 < ((bf16.float() - fp32).norm() / fp32.norm()).item() < 3e-2
    assert torch.equal(m, before)


def test_muon_state_round_trips_through_state_dict():
    from pretrain.config.compose import compose_config
    from pretrain.model.gpt import GPT
    from pretrain.optim.specs import build_optimizer

    cfg = compose_config(["model=nano", "optim=muon"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.optim, 1e-3, torch.device("cpu"))
    with one_thread():
        for _ in range(2):
            model(torch.randint(0, cfg.model.vocab_size, (2, 16))).float().mean().backward()
            opt.step()
            opt.zero_grad()
    again = build_optimizer(model, cfg.optim, 1e-3, torch.device("cpu"))
    again.load_state_dict(opt.state_dict())
    assert len(again.state) == len(opt.state) == sum(1 for _ in model.parameters())
    for name, p in model.named_parameters():  # each with its own optimizer's state
        keys = {"momentum_buffer"} if p.ndim == 2 and name.startswith("layers.") else {
            "step", "exp_avg", "exp_avg_sq"}
        assert opt.state[p].keys() == again.state[p].keys() == keys, name
        for key, value in opt.state[p].items():
            assert torch.equal(again.state[p][key], value)
    assert [len(g["params"]) for g in again.param_groups] == [12, 24]  # no empty group


def test_muon_on_shards_equals_one_process(tmp_path):
    """A 9 x 6 matrix sharded on dim 0 (unevenly) and on dim 1 (FSDP's and TP's
    placements) over 2 ranks (and the memory one orthogonalisation takes):
    ShardedMuon's update equals the one-process update exactly; torch.optim.Muon on the
    same DTensors does not (it runs Newton-Schulz on the shards)."""
    proc = run_ranks(HERE / "optim_shard_worker.py", str(tmp_path), nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, failed(proc)
    result = torch.load(tmp_path / "shards.pt")
    assert result["sharded_muon"] == {"Shard(0)": 0.0, "Shard(1)": 0.0}
    # why ShardedMuon exists: torch.optim.Muon runs on the shards, off for one placement
    assert max(result["torch_muon"].values()) > 1e-3
    # LAMB's norms are sums over the shards, in another order: rounding apart
    assert max(result["lamb"].values()) <= 1e-6
    # what the planner counts as Muon's step transient, measured by torch's MemTracker:
    # bf16 working set only on one process, plus the gathered fp32 matrix on shards
    assert result["transient"] == {"one": orthogonalisation_bytes((96, 40), 0),
                                   "Shard(0)": orthogonalisation_bytes((96, 40), 4)}


@pytest.mark.parametrize("overrides,needle", [
    (["optim=lamb", "optim.lr_rule=deepseek"],
     "optim.lr_rule=deepseek does not apply to optim=lamb (LAMB's step is lr x each "
     "tensor's norm"),
    (["optim=lars", "optim.lr_rule=deepseek"], "use optim.lr_rule=fixed|power"),
    (["optim=lars", "optim.lr_scaling=sqrt", "optim.ref_batch_tokens=4096"],
     "optim.lr_scaling=sqrt does not apply to optim=lars"),
    (["optim=lamb", "optim.lr_scaling=linear", "optim.ref_batch_tokens=4096"],
     "use optim.lr_scaling=none|sqrt"),
    (["optim=muon", "optim.momentum=1.0"], "optim.momentum=1.0 must be in [0, 1)"),
    (["optim=muon", "optim.ns_steps=0"], "optim.ns_steps=0 must be at least 1"),
])
def test_rules_an_optimizer_does_not_take_are_refused(compose, overrides, needle):
    """Before any work, naming the key, the reason and what to use."""
    found = problems(compose(["+recipe=tiny", *overrides]))
    assert any(needle in p for p in found), found


@pytest.mark.parametrize("opt", ["muon", "lamb", "lars"])
def test_rules_an_optimizer_takes_pass(compose, opt):
    from pretrain.decision.checks import check

    extra = ["optim.lr_rule=deepseek"] if opt == "muon" else ["optim.lr_rule=power",
                                                              "optim.lr_law=[1.0,-0.1]"]
    check(compose(["+recipe=tiny", f"optim={opt}", *extra]))


def test_muon_is_chosen_by_the_config_group(compose):
    cfg = compose(["optim=muon"])
    assert (cfg.optim.name, cfg.optim.momentum, cfg.optim.ns_steps) == ("muon", 0.95, 5)
    assert compose([]).optim.name == "adamw"  # the default run: AdamW as before


@pytest.mark.parametrize("saved,now,refused", [
    ({"name": "adamw"}, "muon", True),
    ({}, "lamb", True),  # a checkpoint from before optim.name: AdamW's state
    ({"name": "lars"}, "lars", False),
])
def test_a_checkpoint_of_another_optimizer_is_refused(compose, tmp_path, saved, now, refused):
    """Before DCP would fail on a missing state key, naming both fixes."""
    import json

    from pretrain.checkpoint.folder import CheckpointError
    from pretrain.checkpoint.resume import check_compatible

    cfg = compose(["+recipe=tiny", f"optim={now}"])
    (tmp_path / "meta.json").write_text(json.dumps({"config": {"optim": {"lr": 1e-3, **saved}}}))
    if not refused:
        check_compatible(tmp_path, cfg)
        return
    with pytest.raises(CheckpointError) as e:
        check_compatible(tmp_path, cfg)
    assert f"holds the state of optim={saved.get('name', 'adamw')} and this run is " \
           f"optim={now}" in str(e.value)
    assert f"checkpoint.load_weights_only={tmp_path} checkpoint.resume=false" in str(e.value)
    check_compatible(tmp_path, cfg, "weights")  # what that advice does is accepted
