"""Cooldown branches (checkpoint/branch.py): a branch continues its source's stable-phase
checkpoint exactly (weights, optimizer state, data position), decays over its own budget,
equals a from-scratch WSD run of that budget bit for bit (fp32, one process), never writes
into its source, and is refused with the fix named when it cannot be a continuation. The
source keeps its branch points whatever keep_last says. A ladder plus its branches fits
L(N, D) (analysis/branches.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import by_step, read_result

from pretrain.budget.compute import count_params
from pretrain.checkpoint.folder import CheckpointError
from pretrain.config.schema import ConfigError, ScheduleConfig
from pretrain.decision.resolve import resolve_plan
from pretrain.optim.factory import lr_multiplier, wsd_decay_start
from pretrain.train.trainer import Trainer, run

BATCH_TOKENS = 8 * 32
SOURCE_STEPS, BRANCH_STEPS = 40, 20  # the branch decays over its last 4 steps, from step 16
SHORT_STEPS = 10  # the other branch point: step 8
PEAK = 3e-3


def base(prepared: Path, runs: Path) -> list[str]:
    return ["model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
            "data.name=tinytext", f"data.root={prepared.parent}", "data.auto_prepare=false",
            "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
            "parallel.micro_batch_size=8", "schedule=wsd", "schedule.warmup_steps=2",
            "schedule.decay_shape=1-sqrt", f"optim.lr={PEAK}", "logging=quiet",
            "logging.log_interval=1", "train.eval_batches=1", "train.eval_interval=1000",
            "train.sample_tokens=0", "train.noise_scale=false", f"runs_dir={runs}"]


def tpp(compose, steps: int) -> str:
    """tokens per parameter of a budget of exactly ``steps`` steps of nano."""
    n = count_params(compose(["model=nano", "model.vocab_size=300",
                              "model.seq_len=32"]).model).total
    return repr((steps * BATCH_TOKENS - 100) / n)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared) -> dict:
    """A WSD source with branch points at 10 and 20 steps' budgets (saving every 6 steps,
    keep_last=1), a 20-step branch of it (stopped and requeued once on the way), and a
    from-scratch WSD run of 20 steps."""
    from helpers import compose_config as compose

    root = tmp_path_factory.mktemp("branches")
    common = base(prepared, root)
    source = root / "source"
    cfg = compose(common + ["budget=steps", f"budget.steps={SOURCE_STEPS}",
                            "checkpoint.enabled=true", "checkpoint.interval_steps=6",
                            "checkpoint.keep_last=1",
                            f"checkpoint.branch_tokens_per_param=[{tpp(compose, SHORT_STEPS)},"
                            f"{tpp(compose, BRANCH_STEPS)}]"])
    assert run(cfg, source)["steps"] == SOURCE_STEPS
    before = snapshot(source)
    budget = ["budget=chinchilla", f"budget.tokens_per_param={tpp(compose, BRANCH_STEPS)}"]
    branch = root / "branch"
    cfg = compose(common + budget + [f"checkpoint.branch_from={source}",
                                     "train.exit_interval=18"])
    first = run(cfg, branch)
    assert first["exit_code"] == 75 and first["steps"] == 18  # stopped, saved, requeued
    assert run(cfg, branch)["steps"] == BRANCH_STEPS  # resumed from its own checkpoint
    scratch = root / "scratch"
    run(compose(common + budget), scratch)
    return {"source": source, "branch": branch, "scratch": scratch, "before": before,
            "common": common, "budget": budget, "root": root}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.slow
def test_branch_points_survive_keep_last(runs):
    steps = sorted(int(p.name.split("_")[1])
                   for p in (runs["source"] / "checkpoints").iterdir())
    start = BRANCH_STEPS - math.ceil(0.2 * BRANCH_STEPS)
    assert steps == [SHORT_STEPS - 2, start, SOURCE_STEPS]  # keep_last=1 took 6, 12, ..., 36
    plan = json.loads((runs["source"] / "plan.json").read_text())
    assert plan["branch_points"] == [8, 16]


def test_branch_continues_the_source_and_equals_a_run_from_scratch(runs):
    source, branch, scratch = (by_step(runs[k]) for k in ("source", "branch", "scratch"))
    assert sorted(branch) == list(range(17, BRANCH_STEPS + 1))  # its own steps only
    # its first step is the source's next one: same weights, optimizer state and data
    assert branch[17] == source[17]
    # and from there, a from-scratch WSD run of its budget, bit for bit (fp32, one process)
    assert all(branch[s] == scratch[s] for s in branch)
    done = read_result(runs["branch"])
    assert done["final_val_loss"] == read_result(runs["scratch"])["final_val_loss"]
    assert done["tokens"] == BRANCH_STEPS * BATCH_TOKENS  # D counts from the source's start
    assert done["branch"]["step"] == 16 and done["branch"]["source"] == str(runs["source"])
    assert done["branch"]["checkpoint"].endswith("step_0000016")


def test_branch_lr_is_stable_then_its_own_decay(runs):
    lrs = by_step(runs["branch"], key="lr")  # the LR of the next step, logged after each
    cfg = ScheduleConfig(decay="wsd", decay_fraction=0.2, decay_shape="1-sqrt",
                         min_lr_ratio=0.0, warmup_steps=2)
    for step, lr in lrs.items():
        assert lr == pytest.approx(PEAK * lr_multiplier(step, BRANCH_STEPS, 2, cfg), abs=1e-12)
    assert lrs[17] == pytest.approx(PEAK * (1 - math.sqrt(2 / 4)))  # decaying from step 16
    source = by_step(runs["source"], key="lr")
    assert source[17] == PEAK  # the source stayed at its peak there


def test_source_untouched(runs):
    assert snapshot(runs["source"]) == runs["before"]


@pytest.mark.parametrize("shape, expected", [
    ("linear", [1.0, 1.0, 0.75, 0.5, 0.25, 0.0]),
    ("1-sqrt", [1.0, 1.0, 1 - math.sqrt(0.25), 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0]),
])
def test_wsd_decay_shapes(shape, expected):
    cfg = ScheduleConfig(decay="wsd", decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.0)
    assert wsd_decay_start(20, cfg) == 16
    got = [lr_multiplier(s, 20, 0, cfg) for s in range(14, 20)]
    assert got == pytest.approx(expected, abs=1e-12)
    lo = ScheduleConfig(decay="wsd", decay_shape=shape, min_lr_ratio=0.1)
    assert lr_multiplier(19, 20, 0, lo) == pytest.approx(0.1)


def branch_error(compose, runs, extra: list[str], name: str = "refused") -> str:
    """The error a branch with ``extra`` raises at setup, before its model is built."""
    cfg = compose(runs["common"] + runs["budget"] + extra)
    trainer = Trainer(cfg, runs["root"] / name)
    try:
        with pytest.raises((CheckpointError, ConfigError)) as e:
            trainer.setup()
        assert not hasattr(trainer, "module")  # before the model was built
    finally:
        trainer.close()
    return str(e.value)


@pytest.mark.slow
def test_refused_sources(compose, runs):
    src = runs["source"]
    ck = src / "checkpoints"
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={ck / 'step_0000016'}",
                                       f"budget.tokens_per_param={tpp(compose, SHORT_STEPS)}"])
    assert "at step 16, after this branch's decay start (step 8 of 10" in msg
    # the source's last checkpoint is inside its own decay: no longer its stable phase
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={ck / 'step_0000040'}",
                                       f"budget.tokens_per_param={tpp(compose, 50)}"])
    assert "inside its run's own decay (from step 32 of 40)" in msg
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}", "optim.lr=1e-3"])
    assert "optim.lr=0.001 (source: 0.003)" in msg
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}", "model.n_layer=3"])
    assert "different model" in msg and "model.n_layer=3" in msg
    # only what works with a branch is suggested: resume=false changes nothing for it
    assert "resume=false" not in msg and "use the checkpoint's model settings" in msg
    assert branch_error(compose, runs, [f"checkpoint.branch_from={src}", "model.n_layer=3",
                                        "checkpoint.resume=false"]) == msg
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}", "optim=lamb"])
    assert "use optim=adamw" in msg and "load_weights_only" not in msg
    # a source that is not there is named as missing, a step folder as such
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}-typo"])
    assert f"checkpoint.branch_from={src}-typo: no such path" in msg
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={ck / 'step_0000017'}"])
    assert "step_0000017: no such step folder" in msg and "at steps [8, 16, 40]" in msg
    assert ".metadata" not in msg
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}",
                                       "train.global_batch_size=16"])
    assert "train.global_batch_size=16 (source: 8)" in msg
    # a budget whose decay starts before the first branch point: no checkpoint to use
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}",
                                       f"budget.tokens_per_param={tpp(compose, 5)}"])
    assert "no complete checkpoint at or before step 4" in msg
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={src}"], name="source/sub")
    assert "never writes into its source" in msg
    cosine = runs["root"] / "cosine"  # a run whose LR decays from its warmup on
    run(compose(runs["common"] + ["schedule=cosine", "schedule.decay_shape=linear",
                                  "budget=steps", "budget.steps=4", "checkpoint.enabled=true"]),
        cosine)
    msg = branch_error(compose, runs, [f"checkpoint.branch_from={cosine}"])
    assert "schedule.decay=cosine" in msg and "no stable phase" in msg


def test_refused_configs(compose, tmp_path):
    cases = {
        "schedule=cosine": "it needs schedule=wsd",
        "checkpoint.resume_from=x": "checkpoint.resume_from both name a starting point",
        "optim.lr_rule=deepseek": "optim.lr_rule=fixed",
    }
    for extra, words in cases.items():
        schedule = [] if extra.startswith("schedule=") else ["schedule=wsd"]
        cfg = compose([f"checkpoint.branch_from={tmp_path}", *schedule, extra])
        with pytest.raises(ConfigError, match=words):
            resolve_plan(cfg)
    cfg = compose(["schedule=wsd", "budget=steps", "budget.steps=100",
                   "checkpoint.branch_tokens_per_param=[1e9]"])
    with pytest.raises(ConfigError, match="stable phase ends"):
        resolve_plan(cfg)
    with pytest.raises(ConfigError, match="needs a stable phase"):
        resolve_plan(compose(["schedule=cosine", "checkpoint.branch_tokens_per_param=[1]"]))
    with pytest.raises(ConfigError, match="shapes WSD's decay only"):
        resolve_plan(compose(["schedule=cosine", "schedule.decay_shape=1-sqrt"]))


# -- L(N, D) from a ladder and its branches -------------------------------------------------

TRUE = {"E": 1.8, "A": 400.0, "alpha": 0.34, "B": 2000.0, "beta": 0.28}


def write_run(folder: Path, n: float, d: float, final_lr: float, branch: dict | None) -> None:
    loss = TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(json.dumps({"n_params": n, "n_params_active": n,
                                                  "tokens": d, "lr": 1e-3}))
    result = {"final_val_loss": loss, "tokens": d, "final_lr": final_lr,
              **({"branch": branch} if branch else {})}
    (folder / "result.json").write_text(json.dumps(result))


def test_ladder_plus_branches_identify_l_of_n_d(tmp_path):
    from pretrain.analysis.branches import collect_cooldowns
    from pretrain.analysis.scaling import NotIdentifiable, check_identifiable, fit_chinchilla_law

    sizes = [1e6, 3e6, 1e7, 3e7, 1e8]
    for n in sizes:  # each size: a WSD run at 20 tokens/param with branches at 2.5, 5, 10
        source = tmp_path / "ladder" / f"n={n:g}"
        write_run(source, n, 20 * n, 0.0, None)
        for k in (2.5, 5, 10):
            write_run(tmp_path / "branches" / f"n={n:g},k={k}", n, k * n, 0.0,
                      {"source": str(source), "step": 1})
        write_run(tmp_path / "stable" / f"n={n:g}", n, 40 * n, 1e-3, None)  # never decayed
    ladder = collect_cooldowns([tmp_path / "ladder"])
    with pytest.raises(NotIdentifiable):  # a ladder alone: one ratio D/N
        check_identifiable(np.array([p.n_params for p in ladder.points]),
                           np.array([p.tokens for p in ladder.points]))
    got = collect_cooldowns([tmp_path / "ladder", tmp_path / "branches", tmp_path / "stable"])
    assert len(got.points) == 20 and len(got.branches) == 15 and len(got.stable) == 5
    law = fit_chinchilla_law([p.n_params for p in got.points], [p.tokens for p in got.points],
                             [p.loss for p in got.points])
    for key, value in TRUE.items():
        assert getattr(law, key) == pytest.approx(value, rel=0.02), key


def test_scaling_law_tool_reads_branches(tmp_path, capsys):
    from pretrain.tools.scaling_law import main

    for n in (1e6, 1e7, 1e8):
        write_run(tmp_path / f"n={n:g}", n, 20 * n, 0.0, None)
        for k in (2.5, 10):
            write_run(tmp_path / f"n={n:g},k={k}", n, k * n, 0.0, {"source": f"n={n:g}"})
    write_run(tmp_path / "stable", 1e6, 4e7, 1e-3, None)
    assert main([str(tmp_path), "--no-plots", "--bootstrap", "0"]) == 0
    out = capsys.readouterr().out
    assert "9 cooled-down runs, 6 of them cooldown branches (from 3 source runs)" in out
    assert "left out (never decayed" in out and "L(N, D) = E + A/N^alpha" in out
    fit = json.loads((tmp_path / "scaling_law" / "fit.json").read_text())
    assert len(fit["runs"]) == 9 and "chinchilla_law" in fit


def test_only_a_run_that_ends_at_its_peak_lr_is_left_out():
    """A constant-LR (stable) run ends at its peak and is left out; a decayed run and a run
    too short to leave its warmup (the tiny ladder's smallest point) are each their own
    D's loss and count."""
    from pretrain.analysis.branches import cooled_down

    plan = {"lr": 1e-3}
    assert not cooled_down(plan, {"final_lr": 1e-3})
    assert cooled_down(plan, {"final_lr": 1e-4})
    assert cooled_down(plan, {"final_lr": 8e-4})  # still in warmup at its last step
    assert cooled_down(plan, {})  # before result.json recorded final_lr
