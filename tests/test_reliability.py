"""Nothing lost, nothing silently wrong: a finished run started again, a diverging run's
checkpoints, recipe names that are paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from pretrain.naming import RecipeNameError
from pretrain.trainer import Trainer, run

NANO = ["model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "data.name=tinytext", "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
        "train.global_batch_size=8", "parallel.micro_batch_size=8", "budget=steps",
        "logging=quiet", "logging.wandb=disabled", "train.eval_batches=1",
        "train.sample_tokens=0", "schedule.warmup_steps=1"]


def test_a_finished_run_started_again_leaves_result_json_as_it_was(compose, prepared,
                                                                     tmp_path):
    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=3",
                   "checkpoint.enabled=true"])
    first = run(cfg, tmp_path / "run")
    written = (tmp_path / "run" / "result.json").read_bytes()
    again = run(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "result.json").read_bytes() == written
    assert again["already_finished"] and again["final_val_loss"] == first["final_val_loss"]
    assert json.loads(written)["final_loss"] == first["final_loss"]  # not NaN, not redone


def test_no_checkpoint_is_saved_while_steps_are_skipped(compose, prepared, tmp_path):
    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=6",
                   "checkpoint.enabled=true", "checkpoint.interval_steps=1",
                   "checkpoint.keep_last=2", "train.stop_check_interval=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.setup()
    real = trainer.module.strategy.forward_backward

    def poisoned(x, y, measure=False):  # steps 3 and 4 overflow
        loss, small = real(x, y, measure)
        if trainer.step in (2, 3):
            for p in trainer.module.model.parameters():
                p.grad.fill_(float("nan"))
        return loss, small

    trainer.module.strategy.forward_backward = poisoned
    trainer.fit()
    steps = sorted(int(p.name.split("_")[1]) for p in
                   (tmp_path / "run" / "checkpoints").glob("step_*") if "." not in p.name)
    assert 3 not in steps and 4 not in steps, steps  # nothing saved from a diverged state
    assert steps[-1] == 6 and trainer.module.skipped_steps == 2


@pytest.mark.parametrize("recipe", ["../../evil", "sub/tiny", "/abs/tiny", ".hidden"])
def test_a_recipe_is_a_name_not_a_path(compose, recipe):
    with pytest.raises(RecipeNameError, match="not a path"):
        compose([f"+recipe={recipe}"])


def test_train_py_refuses_a_recipe_path_before_hydra_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "+recipe=../../evil",
                           f"runs_dir={tmp_path}"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "not a path" in proc.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no .hydra, nothing written


def test_resume_across_loss_scaling_is_refused_naming_both_precisions(compose, prepared,
                                                                        tmp_path):
    from pretrain.checkpoint.manager import CheckpointError

    base = [*NANO, f"data.root={prepared.parent}", "budget.steps=2", "checkpoint.enabled=true",
            "run_name=prec"]
    run(compose([*base, "precision=fp32"]), tmp_path / "run")
    cfg = compose([*base, "precision=fp16", "budget.steps=4"])
    with pytest.raises(CheckpointError, match="precision=fp32.*precision=fp16.*load_weights_only"):
        run(cfg, tmp_path / "run")


@pytest.mark.parametrize("damage", ["truncate", "odd", "empty", "index"])
def test_damaged_data_is_refused_naming_the_file(prepared_copy, damage):
    from pretrain.data.loader import TokenWindows
    from pretrain.data.prepare import DataError

    shard = next(prepared_copy.glob("train_*.bin"))
    if damage == "index":
        (prepared_copy / "index.json").write_text("{not json")
        target = "index.json"
    else:
        data = shard.read_bytes()
        shard.write_bytes({"truncate": data[: len(data) // 2], "odd": data[:-1],
                           "empty": b""}[damage])
        target = shard.name
    with pytest.raises(DataError, match=target) as err:
        TokenWindows(prepared_copy, "train", 16)
    assert "prepare_data.py" in str(err.value)


def test_a_second_run_in_the_same_directory_is_refused_and_a_dead_ones_lock_is_not(
        tmp_path):

    from pretrain.run_lock import RunLock, RunLockedError

    first = RunLock(tmp_path)
    first.acquire()
    RunLock(tmp_path).acquire()  # the same process again (an abandoned trainer): allowed
    # held by another process (its pid in the file): refused, naming it
    (tmp_path / "run.lock").write_text('{"user": "x", "host": "other", "pid": 1}')
    with pytest.raises(RunLockedError, match='"pid": 1'):
        RunLock(tmp_path).acquire()
    first.release()
    RunLock(tmp_path).acquire()  # released: free again
    # a process that dies holding the lock: the kernel drops it
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from pretrain.run_lock import "
            "RunLock; RunLock(sys.argv[1]).acquire(); import os; os._exit(9)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"),
                           str(REPO / "src")], timeout=60)
    assert proc.returncode == 9 and (tmp_path / "b" / "run.lock").exists()
    RunLock(tmp_path / "b").acquire()
