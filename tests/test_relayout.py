"""Re-layout: a checkpoint saved by two zero3 ranks resumes on tp=2, on pp=2 and on one
process, and every layout computes the same next loss as the original would (fp32, 1e-4).
Also: an exact (1e-5) resume at dp=2 itself, since the original layout continues too.
Multi-process runs go through tools/run_local.py (torchrun); the one-process resumes run
in pytest's process, through the same pretrain.train.trainer.run train.py calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from built_once import built_once
from helpers import (
    CORPUS_FILES,
    REPO,
    by_step,
    compose_config,
    launch_env,
    one_thread,
    read_metrics,
    write_corpus,
)

K = 4  # steps before the save
RUN_LOCAL = str(REPO / "tools" / "run_local.py")
COMMON = [
    "model=nano",
    "model.vocab_size=300",
    "data=local-text",
    f"data.data_files=[{','.join(CORPUS_FILES)}]",
    "data.tokenizer_vocab_size=300",
    "data.num_proc=1",
    "precision=fp32",
    "train.device=cpu",
    "budget=steps",
    f"budget.steps={K + 2}",
    "schedule.warmup_steps=2",
    "train.global_batch_size=8",
    "parallel.micro_batch_size=2",
    "train.eval_interval=1000",
    "train.eval_batches=2",
    "train.sample_tokens=0",
    "logging=quiet",
    "logging.log_interval=1",
    "checkpoint.enabled=true",
]
LAYOUTS = {
    "one": ["parallel=single"],
    "tp2": ["parallel=tp2", "parallel.dp=1"],
    "pp2": ["parallel=pp2", "parallel.dp=1", "parallel.pp_schedule=1f1b"],
}


def launch(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, RUN_LOCAL, *COMMON, f"data.root={work / 'data'}",
                           f"runs_dir={work / 'runs'}", *args], cwd=work, capture_output=True,
                          text=True, env=launch_env(), timeout=600)


def resume_here(work: Path, name: str, *args: str) -> dict:
    """A one-process resume in this process (pretrain.train.trainer.run, what train.py
    calls; one thread, as torchrun gives a rank), into runs/<name>: its losses by step.
    Saves run_local's, torchrun's and train.py's start-ups (three imports of torch) each."""
    from pretrain.train.trainer import run

    cfg = compose_config([*COMMON, f"data.root={work / 'data'}", f"runs_dir={work / 'runs'}",
                          *args, f"run_name={name}"])
    cwd = os.getcwd()
    os.chdir(work)  # data.data_files are relative to it
    try:
        with one_thread():
            result = run(cfg, work / "runs" / name)
    finally:
        os.chdir(cwd)
    assert result["exit_code"] == 0, result
    return by_step(work / "runs" / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """dp=2 zero3: K steps, stop (exit 75) with a checkpoint; then the same command resumes
    and finishes (steps K+1, K+2), as the reference for every other layout. Built once per
    pytest run (tests/built_once.py); each test writes runs of its own names beside it."""
    return built_once(tmp_path_factory, "relayout", save_and_finish)


def save_and_finish(work: Path) -> dict:
    write_corpus(work)
    args = ["parallel=zero3", "parallel.dp=2", "run_name=dp2"]
    first = launch(work, *args, f"train.exit_interval={K}")
    assert first.returncode == 75, first.stderr[-4000:]
    ckpt = work / "runs" / "dp2" / "checkpoints" / f"step_{K:07d}"
    assert (ckpt / "meta.json").exists()
    second = launch(work, *args)
    assert second.returncode == 0, second.stderr[-4000:]
    return {"work": work, "ckpt": ckpt, "losses": by_step(work / "runs" / "dp2")}


@pytest.mark.slow
def test_dp2_resume_matches_uninterrupted(saved, tmp_path):
    work = saved["work"]
    proc = launch(work, "parallel=zero3", "parallel.dp=2", "run_name=dp2-straight",
                  "checkpoint.enabled=false")
    assert proc.returncode == 0, proc.stderr[-4000:]
    straight = by_step(work / "runs" / "dp2-straight")
    assert sorted(straight) == sorted(saved["losses"]) == list(range(1, K + 3))
    for step, loss in straight.items():
        assert abs(saved["losses"][step] - loss) <= 1e-5, step


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_resume_on_another_layout(saved, name):
    work = saved["work"]
    resume = [*LAYOUTS[name], f"checkpoint.resume_from={saved['ckpt']}"]
    if name == "one":
        got = resume_here(work, name, *resume)
    else:
        proc = launch(work, *resume, f"run_name={name}")
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = by_step(work / "runs" / name)
    assert sorted(got) == [K + 1, K + 2]  # continued from the checkpoint's step
    for step in (K + 1, K + 2):
        assert abs(got[step] - saved["losses"][step]) <= 1e-4, (step, got, saved["losses"])


MOE = ["model.mlp=swiglu", "model.bias=false", "model.moe_experts=4", "model.moe_top_k=2",
       "model.moe_d_ff=32", "model.moe_balance=aux_free", "model.moe_bias_rate=0.01"]


@pytest.fixture(scope="module")
def saved_moe(saved, tmp_path_factory) -> dict:
    """The same with a mixture of experts whose aux_free biases (model state, not
    parameters) have moved: saved by two zero3 ranks at step K, then finished there."""
    return built_once(tmp_path_factory, "relayout-moe", lambda _: save_moe(saved["work"]))


def save_moe(work: Path) -> dict:
    args = [*MOE, "parallel=zero3", "parallel.dp=2", "run_name=moe-dp2"]
    first = launch(work, *args, f"train.exit_interval={K}")
    assert first.returncode == 75, first.stderr[-4000:]
    second = launch(work, *args)
    assert second.returncode == 0, second.stderr[-4000:]
    return {"ckpt": work / "runs" / "moe-dp2" / "checkpoints" / f"step_{K:07d}",
            "losses": by_step(work / "runs" / "moe-dp2")}


EP2 = ["parallel=zero3", "parallel.dp=2", "parallel.ep=2"]  # 2 experts on each rank


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one", "pp2", "ep2"])
def test_a_mixture_of_experts_resumes_on_another_layout(saved, saved_moe, name):
    """Saved without expert parallelism (EP=1), resumed on one process, on a pipeline,
    and with the experts split over two ranks (EP=2)."""
    layout = EP2 if name == "ep2" else LAYOUTS[name]
    resume = [*MOE, *layout, f"checkpoint.resume_from={saved_moe['ckpt']}"]
    if name == "one":
        got = resume_here(saved["work"], f"moe-{name}", *resume)
    else:
        proc = launch(saved["work"], *resume, f"run_name=moe-{name}")
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = by_step(saved["work"] / "runs" / f"moe-{name}")
    assert sorted(got) == [K + 1, K + 2]
    # Every stage's layers in the log (a pipeline gathers them from both stages)
    logged = [m for m in read_metrics(saved["work"] / "runs" / f"moe-{name}") if "loss" in m][-1]
    assert {"moe/max_load_0", "moe/max_load_1"} <= logged.keys(), logged
    for step in (K + 1, K + 2):
        assert abs(got[step] - saved_moe["losses"][step]) <= 1e-4, (step, got, saved_moe)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_on_one_process(saved, saved_moe):
    """EP=2 -> EP=1: saved by two ranks holding two experts each (DCP keeps whole expert
    tensors), resumed by one process holding all four; the continuation is the EP=1 run's."""
    work = saved["work"]
    first = launch(work, *MOE, *EP2, "run_name=moe-ep2-saved", f"train.exit_interval={K}")
    assert first.returncode == 75, first.stderr[-4000:]
    ckpt = work / "runs" / "moe-ep2-saved" / "checkpoints" / f"step_{K:07d}"
    got = resume_here(work, "moe-from-ep2", *MOE, *LAYOUTS["one"],
                      f"checkpoint.resume_from={ckpt}")
    assert sorted(got) == [K + 1, K + 2]
    for step in (K + 1, K + 2):
        assert abs(got[step] - saved_moe["losses"][step]) <= 1e-4, (step, got, saved_moe)
