"""The batch ramp (budget/batch_ramp.py, conf/batch_ramp/): the batches a ``tokens`` ramp
takes, the LR rule per optimizer family, the schedule in tokens (equal to the one in steps
at a fixed batch), the sample stream (the fixed-batch run's, grouped otherwise), a resume in
the middle of a ramp (bit-identical on the same layout, the same samples and losses to
1e-5 on another), the ``noise_scale`` ramp's rule and its state, a mixture's per-batch
shares at every batch size, and what the dry run says."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import read_metrics, read_result

import pretrain.train.trainer as trainer_module
from pretrain.budget.batch_ramp import BatchRamp, RampError, RampSpec, lr_factor, tokens_stages
from pretrain.config.decision import WeightStage
from pretrain.config.schema import ScheduleConfig
from pretrain.data.mixer import BatchMixer, RampMixer
from pretrain.decision.resolve import dry_run
from pretrain.optim.factory import lr_multiplier, lr_multiplier_tokens, warmup_steps
from pretrain.optim.specs import OPTIMIZERS
from pretrain.optim.specs import spec as optimizer_spec
from pretrain.train.train_module import TrainModule

SEQ = 32
# nano, 4 full-batch steps of 8 sequences = 32 samples; the ramp from 2 sequences (64
# tokens, micro batch 2) to 8 over the first 16 samples: batches 2 2 2 4 4 6 8 4 (the last
# cut to what is left)
BASE = ["model=nano", "model.vocab_size=300", f"model.seq_len={SEQ}", "precision=fp32",
        "data.name=tinytext", "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
        "train.global_batch_size=8", "parallel.micro_batch_size=2", "budget=steps",
        "budget.steps=4", "logging=quiet", "logging.wandb=disabled", "logging.log_interval=1",
        "train.eval_batches=1", "train.eval_interval=1000", "train.sample_tokens=0",
        "schedule.warmup_steps=1", "train.device=cpu"]
RAMP = [*BASE, "batch_ramp=tokens", f"batch_ramp.start_tokens={2 * SEQ}",
        f"batch_ramp.ramp_tokens={16 * SEQ}"]
RAMP_BATCHES = [2, 2, 2, 4, 4, 6, 8, 4]


def spec(**kw) -> RampSpec:
    base = dict(kind="tokens", unit=2, start=2, full=8, total_samples=32, seq_len=SEQ,
                lr_rule="sqrt", ramp_samples=16)
    return RampSpec(**{**base, **kw})


def test_a_tokens_ramp_grows_in_whole_start_batches_to_the_full_batch_and_ends_on_the_budget():
    s = spec()
    batches, samples = [], 0
    while samples < s.total_samples:
        batches.append(s.tokens_batch(samples))
        samples += batches[-1]
    assert batches == RAMP_BATCHES and samples == 32
    staged = spec(stages=2, total_samples=64)  # half way through the ramp: (2 + 8) / 2 -> 4
    assert [(st["batch"], st["steps"]) for st in tokens_stages(staged)] == \
        [(2, 4), (4, 2), (8, 6)]
    big = spec(unit=4, start=12, full=512, total_samples=512 * 100, ramp_samples=5000)
    stages = tokens_stages(big)
    assert all(st["batch"] % 4 == 0 for st in stages)  # whole micro batches x dp
    *ramp, last = stages  # the last step cut to what is left
    assert all(st["batch"] % 12 == 0 or st["batch"] == 512 for st in ramp)
    assert [st["batch"] for st in ramp] == sorted(st["batch"] for st in ramp)
    assert sum(st["samples"] for st in stages) == big.total_samples


def test_each_optimizer_family_states_its_lr_rule():
    rules = {name: optimizer_spec(name).ramp_lr for name in OPTIMIZERS}
    assert rules == {"adamw": "sqrt", "adafactor": "sqrt", "lamb": "sqrt", "muon": "sqrt",
                     "sgd": "linear", "lars": "linear"}
    assert lr_factor("sqrt", 2, 8) == 0.5 and lr_factor("linear", 2, 8) == 0.25
    assert lr_factor("none", 2, 8) == 1.0 and lr_factor("sqrt", 8, 8) == 1.0


@pytest.mark.parametrize("sched", [
    {"decay": "cosine"}, {"decay": "linear"}, {"decay": "constant"},
    {"decay": "wsd"}, {"decay": "wsd", "decay_shape": "1-sqrt"},
    {"decay": "cosine", "warmup_steps": None, "warmup_tokens": 2500}])
def test_the_schedule_in_tokens_is_the_schedule_in_steps_at_a_fixed_batch(sched):
    cfg = ScheduleConfig(**{"warmup_steps": 7, **sched})
    batch, total = 1000, 60
    warm = warmup_steps(cfg, batch)
    for step in range(total):
        assert lr_multiplier_tokens((step + 1) * batch, total, batch, warm, cfg) == \
            pytest.approx(lr_multiplier(step, total, warm, cfg), rel=1e-12, abs=1e-15)


def test_the_noise_scale_ramp_doubles_after_enough_measurements_above_the_factor():
    s = spec(kind="noise_scale", ramp_samples=0, factor=2.0, min_measurements=2)
    ramp = BatchRamp(s)
    assert ramp.batch(0) == 2
    assert not ramp.observe(1, 2, None)  # not defined yet: not counted
    assert not ramp.observe(2, 4, 4 * 2 * SEQ)  # one measurement: not enough
    assert ramp.observe(3, 6, 4 * 2 * SEQ)  # 2 of them, B_simple = 2 x the batch
    assert ramp.batch(6) == 4 and ramp.changes == [[3, 6, 4]]
    assert not ramp.observe(4, 10, 7 * SEQ) and not ramp.observe(5, 14, 7 * SEQ)  # < 2x4
    again = BatchRamp(s)
    again.load_state_dict(json.loads(json.dumps(ramp.state_dict())))
    assert again.state_dict() == ramp.state_dict()
    for r in (ramp, again):
        assert r.observe(6, 18, 100 * SEQ) and r.current == 8  # capped at the full batch
        assert not r.observe(7, 26, 1e9) and r.batch(26) == 6  # the end: what is left


def test_a_mixtures_batches_hold_their_shares_at_every_batch_size():
    stages = (WeightStage(0, (0.5, 0.3, 0.2)), WeightStage(3, (0.1, 0.6, 0.3)))
    fixed, same = BatchMixer(stages, 10, seed=5), RampMixer(stages, 10, 5, lambda s: 10)
    for b in range(8):  # a constant size: BatchMixer, position for position
        assert [x.tolist() for x in fixed.layout(b)] == [x.tolist() for x in same.layout(b)]
    ramp = spec(unit=1, start=3, full=10, total_samples=200, ramp_samples=40)
    mixer = RampMixer(stages, 10, 5, ramp.tokens_batch)
    seen = [0, 0, 0]
    sample, b = 0, 0
    while sample < 200:
        size = ramp.tokens_batch(sample)
        assert mixer.locate(sample) == (b, 0) and mixer.locate(sample + size - 1) == (b, size - 1)
        weights = stages[0 if sample < 30 else 1].weights
        labels, local = mixer.layout(b)
        counts = np.bincount(labels, minlength=3)
        assert counts.sum() == size
        for s in range(3):
            assert abs(counts[s] - weights[s] * size) < 1  # within a sample, every size
            assert sorted(local[labels == s]) == list(range(seen[s], seen[s] + counts[s]))
            seen[s] += counts[s]
        sample, b = sample + size, b + 1


def record_steps(monkeypatch) -> list[dict]:
    """Every optimizer step's inputs, LR and samples consumed after it."""
    steps: list[dict] = []
    original = TrainModule.step

    def step(self, x, y, n, measure=False, samples_after=None):
        out = original(self, x, y, n, measure, samples_after)
        steps.append({"x": x.clone(), "lr": self.optimizer.param_groups[0]["lr"],
                      "samples_after": samples_after})
        return out

    monkeypatch.setattr(TrainModule, "step", step)
    return steps


def run(compose, prepared, run_dir, overrides):
    return trainer_module.run(compose([*overrides, f"data.root={prepared.parent}"]), run_dir)


def test_a_ramp_reads_the_fixed_batch_runs_samples_and_its_lr_follows_the_rule(
        compose, prepared, tmp_path, monkeypatch):
    fixed = record_steps(monkeypatch)
    assert run(compose, prepared, tmp_path / "fixed", BASE)["steps"] == 4
    monkeypatch.undo()
    ramped = record_steps(monkeypatch)
    result = run(compose, prepared, tmp_path / "ramp", RAMP)
    assert result["steps"] == len(RAMP_BATCHES) and result["tokens"] == 32 * SEQ
    assert [len(s["x"]) for s in ramped] == RAMP_BATCHES
    assert torch.equal(torch.cat([s["x"] for s in ramped]), torch.cat([s["x"] for s in fixed]))
    cfg = compose(RAMP)
    peak = cfg.optim.lr
    for s in ramped:  # sqrt(B / full) x the fixed run's schedule, in tokens
        want = peak * math.sqrt(len(s["x"]) / 8) * lr_multiplier_tokens(
            s["samples_after"] * SEQ, 4, 8 * SEQ, 1, cfg.schedule)
        assert s["lr"] == pytest.approx(want, rel=1e-12)
    rows = [r for r in read_metrics(tmp_path / "ramp") if "loss" in r]
    assert [r["batch_tokens"] for r in rows] == [b * SEQ for b in RAMP_BATCHES]
    plan = json.loads((tmp_path / "ramp" / "plan.json").read_text())["batch_ramp"]
    assert plan["steps"] == len(RAMP_BATCHES) and plan["steps_fixed_batch"] == 4
    assert [st["batch"] for st in plan["stages"]] == [2, 4, 6, 8, 4]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "metrics*.jsonl") if "loss" in r}


@pytest.mark.parametrize("kind", ["tokens", "noise_scale"])
def test_a_run_resumed_in_the_middle_of_a_ramp_is_bit_identical(compose, prepared, tmp_path,
                                                                  kind):
    over = RAMP if kind == "tokens" else [
        *BASE, "batch_ramp=noise_scale", f"batch_ramp.start_tokens={2 * SEQ}",
        "batch_ramp.factor=1.01", "batch_ramp.min_measurements=1"]
    straight = run(compose, prepared, tmp_path / "straight", over)
    stopped = run(compose, prepared, tmp_path / "resumed",
                  [*over, "checkpoint.enabled=true", "train.exit_interval=3"])
    assert stopped["exit_code"] == 75 and stopped["steps"] == 3
    resumed = run(compose, prepared, tmp_path / "resumed", [*over, "checkpoint.enabled=true"])
    assert resumed["steps"] == straight["steps"]
    assert resumed["batch_ramp"] == straight["batch_ramp"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    if kind == "noise_scale":  # it grew, as the measurements said
        assert straight["batch_ramp"]["changes"], straight["batch_ramp"]


def test_a_run_resumed_on_another_layout_reads_the_same_samples(compose, prepared, tmp_path,
                                                                 monkeypatch):
    """Stopped mid-ramp with micro batches of 2, resumed with micro batches of 1 (another
    accumulation count, the same ramp: both units divide the start batch)."""
    straight = record_steps(monkeypatch)
    run(compose, prepared, tmp_path / "straight", RAMP)
    monkeypatch.undo()
    parts = record_steps(monkeypatch)
    run(compose, prepared, tmp_path / "moved",
        [*RAMP, "checkpoint.enabled=true", "train.exit_interval=4"])
    run(compose, prepared, tmp_path / "moved",
        [*RAMP, "checkpoint.enabled=true", "parallel.micro_batch_size=1"])
    assert [len(s["x"]) for s in parts] == RAMP_BATCHES
    assert torch.equal(torch.cat([s["x"] for s in parts]), torch.cat([s["x"] for s in straight]))
    assert [s["lr"] for s in parts] == [s["lr"] for s in straight]
    got, want = losses(tmp_path / "moved"), losses(tmp_path / "straight")
    assert sorted(got) == sorted(want)
    assert [got[k] for k in sorted(got)] == pytest.approx([want[k] for k in sorted(want)],
                                                          rel=1e-5)
    assert read_result(tmp_path / "moved")["steps"] == len(RAMP_BATCHES)


def test_the_gpt3_dry_run_states_brown_et_als_ramp(compose, capsys):
    plan = dry_run(compose(["+recipe=gpt3-1.3b", "dry_run=true"]))
    ramp = plan["batch_ramp"]
    assert ramp["start_tokens"] == 32_768 and ramp["full_tokens"] == 512 * 2048
    assert ramp["ramp_tokens"] >= 7_000_000_000 and ramp["lr_scaling"] == "sqrt"
    assert ramp["steps"] > ramp["steps_fixed_batch"] == plan["steps"]
    assert sum(st["tokens"] for st in ramp["stages"]) == plan["tokens"]
    err = capsys.readouterr().err
    assert "batch ramp (tokens, linear): from 32,768 to 1,048,576 tokens" in err


@pytest.mark.parametrize("overrides, words", [
    (["batch_ramp=tokens", "batch_ramp.ramp_tokens=null"], "batch_ramp.ramp_tokens"),
    (["batch_ramp=tokens", "batch_ramp.start_tokens=null"], "batch_ramp.start_tokens"),
    (["batch_ramp=noise_scale", "train.noise_scale=false"], "train.noise_scale=true"),
    (["batch_ramp=noise_scale", "batch_ramp.factor=1"], "batch_ramp.factor > 1"),
])
def test_a_ramp_that_cannot_work_is_refused_before_any_work(compose, overrides, words):
    with pytest.raises(RampError, match=words.replace(".", r"\.")):
        dry_run(compose([*overrides, "dry_run=true"]))


@pytest.mark.slow
def test_every_layout_takes_the_ramp_like_one_process(tmp_path, markov_root):
    """A pipeline (more pipeline micro batches a step) and ZeRO-2 over two ranks (more
    accumulation) take the same ramp as one process, with its losses (fp32, 1e-4)."""
    from helpers import MARKOV_DATA, VOCAB, run_group

    common = ["model=nano", "model.n_layer=2", f"model.vocab_size={VOCAB}", "model.seq_len=32",
              "model.attention=sdpa", "precision=fp32", *MARKOV_DATA, "budget=steps",
              "budget.steps=3", "train.global_batch_size=16", "parallel.micro_batch_size=2",
              "train.eval_batches=8", "train.eval_interval=1000", "train.sample_tokens=0",
              "logging=quiet", "schedule.warmup_steps=0", "batch_ramp=tokens",
              f"batch_ramp.start_tokens={4 * 32}", f"batch_ramp.ramp_tokens={32 * 32}",
              f"data.root={markov_root}", f"runs_dir={tmp_path / 'runs'}"]
    one = run_group(tmp_path, common, 1, {"single": ["parallel.dp=1"]})["single"]
    two = run_group(tmp_path, common, 2, {
        "pp2": ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=1f1b"],
        "zero2": ["parallel.dp=2", "parallel.dp_mode=zero2"]})
    assert one["batches"] == [4, 4, 4, 8, 8, 12, 8]  # 48 samples: 3 full-batch steps
    for name, got in two.items():
        assert got["batches"] == one["batches"], name
        assert got["losses"] == pytest.approx(one["losses"], abs=1e-4), name


def test_a_compiled_model_compiles_nothing_more_for_a_ramp(compose, prepared, tmp_path,
                                                          monkeypatch):
    """The ramp changes the number of micro batches, never their shape: a compiled run
    with a ramp compiles as many graphs as the same run at the fixed batch (dynamo's own
    count; the ``eager`` backend, so no kernels are generated)."""
    from functools import partial

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    graphs = {}
    for name, over in (("fixed", BASE), ("ramp", RAMP)):
        torch._dynamo.reset()
        counters.clear()
        result = run(compose, prepared, tmp_path / name, [*over, "train.compile=true"])
        graphs[name] = (counters["stats"]["unique_graphs"], result["steps"])
    torch._dynamo.reset()
    assert graphs["ramp"][0] == graphs["fixed"][0] > 0, graphs
    assert graphs["ramp"][1] == len(RAMP_BATCHES)


@pytest.mark.parametrize("name", ["125m", "350m", "1.3b", "1.3b-chinchilla", "2.7b", "6.7b",
                                  "175b"])
def test_the_gpt3_recipes_carry_brown_et_als_ramp(compose, name):
    """From 32k tokens over 4-12B tokens, growing with the full batch (Brown et al. app. B)."""
    cfg = compose([f"+recipe=gpt3-{name}"])
    r = cfg.batch_ramp
    assert (r.name, r.start_tokens, r.lr_scaling) == ("tokens", 32_768, "auto")
    assert 4e9 <= r.ramp_tokens <= 12e9
    full = cfg.train.global_batch_size * cfg.model.seq_len
    assert r.ramp_tokens == {524_288: 4e9, 1_048_576: 7e9, 2_097_152: 10e9,
                             3_145_728: 12e9}[full]
