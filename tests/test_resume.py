"""Exact resume on one process: stopped by a signal, by exit_interval, or killed after a
completed save, the continued run computes the same losses as one uninterrupted run. On two
ranks, rank 0 alone chooses the checkpoint (or finds the error) and every rank follows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from built_once import built_once
from helpers import (
    CORPUS_FILES,
    REPO,
    by_step,
    compose_config,
    one_thread,
    read_result,
    wait_for,
    write_corpus,
)
from omegaconf import OmegaConf
from two_ranks import blind_to_checkpoints, run_on_two_ranks

from pretrain.checkpoint.manager import CheckpointManager
from pretrain.checkpoint.resume import resume_path
from pretrain.config.schema import CheckpointConfig

STEPS = 24
EXIT_REQUEUE = 75


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The corpus and the runs' folder, one per pytest run (tests/built_once.py): the tests
    write runs of their own names in it, and the uninterrupted run is built once."""
    return built_once(tmp_path_factory, "resume", lambda work: (write_corpus(work), work)[1])


def command(work: Path, run: str, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "model=nano", "model.vocab_size=300",
            "data=local-text", f"data.data_files=[{','.join(CORPUS_FILES)}]",
            "data.tokenizer_vocab_size=300", "data.num_proc=1", f"data.root={work / 'data'}",
            "precision=fp32", "budget=steps", f"budget.steps={STEPS}", "schedule.warmup_steps=3",
            "train.global_batch_size=8", "parallel.micro_batch_size=4", "train.eval_interval=1000",
            "train.eval_batches=2", "train.sample_tokens=0", "logging=quiet", "train.device=cpu",
            "logging.log_interval=1", f"runs_dir={work / 'runs'}", f"run_name={run}", *extra]


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss per step, from every metrics file of the run."""
    return by_step(run_dir, pattern="metrics*.jsonl")


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(work, tmp_path_factory) -> dict[int, float]:
    return built_once(tmp_path_factory, "resume-straight", lambda _: run_straight(work))


def run_straight(work: Path) -> dict[int, float]:
    proc = run(command(work, "straight"), work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(work / "runs" / "straight")
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


@pytest.mark.slow
def test_exit_interval_requeues_until_done(work, straight):
    cmd = command(work, "chunks", "checkpoint.enabled=true", "train.exit_interval=10")
    codes = [run(cmd, work).returncode for _ in range(3)]
    assert codes == [EXIT_REQUEUE, EXIT_REQUEUE, 0]
    run_dir = work / "runs" / "chunks"
    steps = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir())
    assert steps == [10, 20, 24]
    assert losses(run_dir) == straight  # bit-identical in fp32 on one process
    assert read_result(run_dir)["steps"] == STEPS


@pytest.mark.slow
def test_signal_saves_and_resume_is_exact(work, straight):
    cmd = command(work, "signal", "checkpoint.enabled=true", "checkpoint.interval_steps=3")
    run_dir = work / "runs" / "signal"
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for(run_dir / "checkpoints" / "step_0000003", proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_REQUEUE, err[-3000:]
    assert "received SIGUSR1" in out + err
    assert not (run_dir / "result.json").exists()  # not finished: no result yet
    stopped_at = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir())
    assert 3 <= stopped_at < STEPS

    proc2 = run(cmd, work)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:07d}'}" in proc2.stdout
    assert losses(run_dir) == straight


@pytest.mark.slow
def test_kill_after_completed_save_then_resume_is_exact(work, straight):
    cmd = command(work, "killed", "checkpoint.enabled=true", "checkpoint.interval_steps=5",
                  "checkpoint.async_save=false")
    run_dir = work / "runs" / "killed"
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for(run_dir / "checkpoints" / "step_0000005", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc2 = run(cmd, work)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert "resumed from" in proc2.stdout
    assert losses(run_dir) == straight


# -- two ranks: rank 0 chooses the checkpoint, every rank gets its choice or its error -------

def _resume_paths_with_a_blind_rank_1(rank: int, cases: dict) -> dict[str, tuple[str, str]]:
    """``checkpoint.resume.resume_path`` per case. Rank 1 sees no checkpoint directory: alone it
    would start afresh, or report another problem than the one rank 0 sees."""
    if rank == 1:
        blind_to_checkpoints()
    out = {}
    for name, (cfg, run_dir) in cases.items():
        try:
            out[name] = ("ok", str(resume_path(cfg, run_dir)))
        except Exception as e:  # after the broadcast: the ranks stay in step
            out[name] = ("error", f"{type(e).__name__}: {e}")
    return out


def _fake_checkpoint(run_dir: Path, model: dict) -> Path:
    """A complete checkpoint at step 3 whose meta says it holds ``model``."""
    mgr = CheckpointManager(run_dir / "checkpoints", CheckpointConfig(async_save=False))
    mgr.save(3, {"w": torch.arange(4.0)}, {"step": 3, "config": {"model": model}})
    mgr.close()
    return run_dir / "checkpoints" / "step_0000003"


@pytest.fixture(scope="module")
def two_rank_resume(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("two_ranks")
    base = ["model=nano", "model.vocab_size=300", "data.tokenizer_vocab_size=300",
            "precision=fp32", "model.attention=eager",
            "data.auto_prepare=false", "budget=steps", "budget.steps=3",
            "train.global_batch_size=8", "parallel.micro_batch_size=8", "logging=quiet",
            "checkpoint.enabled=true"]
    cfg = compose_config(base)
    model = OmegaConf.to_container(OmegaConf.structured(cfg.model))
    good = _fake_checkpoint(tmp / "good", model)
    _fake_checkpoint(tmp / "other", {**model, "n_layer": model["n_layer"] + 1})
    broken = _fake_checkpoint(tmp / "broken", model)
    next(broken.glob("*.distcp")).unlink()
    cases = {
        "good": (cfg, tmp / "good"),
        "other_model": (cfg, tmp / "other"),
        "resume_from_incomplete": (compose_config([*base, f"checkpoint.resume_from={broken}"]),
                                   tmp / "fresh"),
    }
    got = run_on_two_ranks(_resume_paths_with_a_blind_rank_1, tmp / "store", cases)
    assert [status for status, _ in got] == ["ok", "ok"], got
    return {"ranks": [answers for _, answers in got], "good": good, "model": model}


def test_every_rank_resumes_from_rank_0s_choice(two_rank_resume):
    rank0, rank1 = two_rank_resume["ranks"]
    assert rank0["good"] == rank1["good"] == ("ok", str(two_rank_resume["good"]))


def test_incompatible_checkpoint_raises_the_same_error_on_every_rank(two_rank_resume):
    rank0, rank1 = two_rank_resume["ranks"]
    n_layer = two_rank_resume["model"]["n_layer"]
    assert rank0["other_model"] == rank1["other_model"]
    status, message = rank0["other_model"]
    assert status == "error" and message.startswith("CheckpointError")
    assert f"model.n_layer={n_layer} (checkpoint: {n_layer + 1})" in message


def test_resume_from_an_incomplete_checkpoint_fails_on_every_rank(two_rank_resume):
    rank0, rank1 = two_rank_resume["ranks"]
    assert rank0["resume_from_incomplete"] == rank1["resume_from_incomplete"]
    status, message = rank0["resume_from_incomplete"]
    assert status == "error" and "is not a complete checkpoint" in message
    assert ".distcp is missing" in message  # what rank 0 saw (rank 1 sees no directory)


def run_here(work: Path, run_name: str, *extra: str) -> int:
    """``command``'s run in this process (pretrain.train.trainer.run, what train.py calls;
    one thread, as a rank has): its exit status. No start-up of python and torch."""
    from pretrain.train.trainer import run as train

    cfg = compose_config(command(work, run_name, *extra)[2:])
    cwd = os.getcwd()
    os.chdir(work)  # data.data_files are relative to it
    try:
        with one_thread():
            return train(cfg, work / "runs" / run_name)["exit_code"]
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_completep_checkpoint_resumes_exactly(work):
    """CompleteP (muP's per-group LRs, epsilons and decay, output and attention scales, plus
    the 1/L residual branches) away from its base shape: a run stopped and resumed at step
    12 computes the losses of the straight run. In this process (each run a fresh Trainer,
    as a fresh process would build it: test_exit_interval_requeues_until_done restarts
    train.py itself)."""
    shape = ("model.parametrization=completep", "model.base_width=16", "model.base_depth=1")
    assert run_here(work, "completep-straight", *shape) == 0
    chunks = (*shape, "checkpoint.enabled=true", "train.exit_interval=12")
    assert [run_here(work, "completep-chunks", *chunks) for _ in range(2)] == [EXIT_REQUEUE, 0]
    straight = losses(work / "runs" / "completep-straight")
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert losses(work / "runs" / "completep-chunks") == straight
