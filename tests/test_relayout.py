"""Re-layout: a checkpoint saved by two zero3 ranks resumes on tp=2, on pp=2 and on one
process, and every layout computes the same next loss as the original would (fp32, 1e-4).
Also: an exact (1e-5) resume at dp=2 itself, since the original layout continues too.

The first run goes through tools/run_local.py (torchrun, train.py): it prepares the data,
stops at step K and the launcher exits 75. Every other 2-process run (the resumes, the
uninterrupted run, the mixture of experts' runs) is trained in one set of 2 processes,
one run after the other (tests/runs_worker.py: setup, fit and close as
pretrain.train.trainer.run does, the process group kept), built once per pytest run: one
start-up instead of ten of run_local + torchrun + 2 x train.py (about 14 s of CPU each,
issue 69). The one-process resumes run in pytest's process, through the same
pretrain.train.trainer.run train.py calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from built_once import built_once
from helpers import (
    CORPUS_FILES,
    HERE,
    REPO,
    by_step,
    compose_all,
    compose_config,
    failed,
    launch_env,
    one_thread,
    read_metrics,
    run_ranks,
    write_corpus,
    write_spec,
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


MOE = ["model.mlp=swiglu", "model.bias=false", "model.moe_experts=4", "model.moe_top_k=2",
       "model.moe_d_ff=32", "model.moe_balance=aux_free", "model.moe_bias_rate=0.01"]
EP2 = ["parallel=zero3", "parallel.dp=2", "parallel.ep=2"]  # 2 experts on each rank
DP2 = ["parallel=zero3", "parallel.dp=2"]


def step_k(work: Path, run: str) -> Path:
    return work / "runs" / run / "checkpoints" / f"step_{K:07d}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """dp=2 zero3: K steps, stop (exit 75) with a checkpoint; then the same command resumes
    and finishes (steps K+1, K+2), as the reference for every other layout. The same with
    a mixture of experts whose aux_free biases (model state, not parameters) have moved.
    And every other 2-process run the tests read. Built once per pytest run
    (tests/built_once.py); the one-process resumes write runs of their own names beside."""
    return built_once(tmp_path_factory, "relayout", train_all)


def train_all(work: Path) -> dict:
    write_corpus(work)
    first = launch(work, *DP2, "run_name=dp2", f"train.exit_interval={K}")
    assert first.returncode == 75, first.stderr[-4000:]
    ckpt = step_k(work, "dp2")
    assert (ckpt / "meta.json").exists()
    moe_ckpt = step_k(work, "moe-dp2")
    runs = [  # (key, run directory, overrides), in order
        ("dp2", "dp2", DP2),  # the same command again: resumes and finishes
        ("dp2-straight", "dp2-straight", [*DP2, "checkpoint.enabled=false"]),
        ("tp2", "tp2", [*LAYOUTS["tp2"], f"checkpoint.resume_from={ckpt}"]),
        ("pp2", "pp2", [*LAYOUTS["pp2"], f"checkpoint.resume_from={ckpt}"]),
        ("moe-dp2-stopped", "moe-dp2", [*MOE, *DP2, f"train.exit_interval={K}"]),
        ("moe-dp2", "moe-dp2", [*MOE, *DP2]),
        ("moe-pp2", "moe-pp2", [*MOE, *LAYOUTS["pp2"], f"checkpoint.resume_from={moe_ckpt}"]),
        ("moe-ep2", "moe-ep2", [*MOE, *EP2, f"checkpoint.resume_from={moe_ckpt}"]),
        ("moe-ep2-saved", "moe-ep2-saved", [*MOE, *EP2, f"train.exit_interval={K}"]),
    ]
    base = [*COMMON, f"data.root={work / 'data'}", f"runs_dir={work / 'runs'}"]
    configs = compose_all({key: [*base, *o, f"run_name={run}"] for key, run, o in runs})
    spec = write_spec(work / "runs.pkl", runs=[(key, configs[key], work / "runs" / run)
                                               for key, run, _ in runs])
    proc = run_ranks(HERE / "runs_worker.py", str(work), str(spec), nproc=2, cwd=work)
    assert proc.returncode == 0, failed(proc)
    results = json.loads((work / "results.json").read_text())
    stopped = {"moe-dp2-stopped", "moe-ep2-saved"}
    assert {k: r["exit_code"] for k, r in results.items()} == {
        key: 75 if key in stopped else 0 for key, _, _ in runs}
    return {"work": work, "ckpt": ckpt, "losses": by_step(work / "runs" / "dp2"),
            "moe": {"ckpt": moe_ckpt, "losses": by_step(work / "runs" / "moe-dp2")},
            "ep2_ckpt": step_k(work, "moe-ep2-saved")}


@pytest.mark.slow
def test_dp2_resume_matches_uninterrupted(saved):
    straight = by_step(saved["work"] / "runs" / "dp2-straight")
    assert sorted(straight) == sorted(saved["losses"]) == list(range(1, K + 3))
    for step, loss in straight.items():
        assert abs(saved["losses"][step] - loss) <= 1e-5, step


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_resume_on_another_layout(saved, name):
    work = saved["work"]
    if name == "one":
        got = resume_here(work, name, *LAYOUTS[name], f"checkpoint.resume_from={saved['ckpt']}")
    else:  # trained in saved's processes
        got = by_step(work / "runs" / name)
    assert sorted(got) == [K + 1, K + 2]  # continued from the checkpoint's step
    for step in (K + 1, K + 2):
        assert abs(got[step] - saved["losses"][step]) <= 1e-4, (step, got, saved["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one", "pp2", "ep2"])
def test_a_mixture_of_experts_resumes_on_another_layout(saved, name):
    """Saved without expert parallelism (EP=1), resumed on one process, on a pipeline,
    and with the experts split over two ranks (EP=2)."""
    moe, work = saved["moe"], saved["work"]
    if name == "one":
        got = resume_here(work, f"moe-{name}", *MOE, *LAYOUTS[name],
                          f"checkpoint.resume_from={moe['ckpt']}")
    else:  # trained in saved's processes
        got = by_step(work / "runs" / f"moe-{name}")
    assert sorted(got) == [K + 1, K + 2]
    # Every stage's layers in the log (a pipeline gathers them from both stages)
    logged = [m for m in read_metrics(work / "runs" / f"moe-{name}") if "loss" in m][-1]
    assert {"moe/max_load_0", "moe/max_load_1"} <= logged.keys(), logged
    for step in (K + 1, K + 2):
        assert abs(got[step] - moe["losses"][step]) <= 1e-4, (step, got, moe)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_on_one_process(saved):
    """EP=2 -> EP=1: saved by two ranks holding two experts each (DCP keeps whole expert
    tensors), resumed by one process holding all four; the continuation is the EP=1 run's."""
    ckpt = saved["ep2_ckpt"]
    assert (ckpt / "meta.json").exists()
    got = resume_here(saved["work"], "moe-from-ep2", *MOE, *LAYOUTS["one"],
                      f"checkpoint.resume_from={ckpt}")
    assert sorted(got) == [K + 1, K + 2]
    for step in (K + 1, K + 2):
        assert abs(got[step] - saved["moe"]["losses"][step]) <= 1e-4, (step, got, saved["moe"])
