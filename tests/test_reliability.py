"""Nothing lost, nothing silently wrong: a finished run started again, a diverging run's
checkpoints, recipe names that are paths, a checkpoint folder that cannot take a save,
signals during start-up and to the local launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from pretrain.config.naming import RecipeNameError
from pretrain.train.trainer import Trainer, run

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


def test_a_diverged_run_names_the_checkpoint_that_really_is_the_last_good_one(
        compose, prepared, tmp_path):
    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=8",
                   "checkpoint.enabled=true", "checkpoint.interval_steps=1",
                   "checkpoint.keep_last=1", "train.stop_check_interval=1",
                   "train.max_nonfinite_steps=3"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.setup()
    real = trainer.module.strategy.forward_backward

    def diverging(x, y, measure=False):  # every step from the third on overflows
        loss, small = real(x, y, measure)
        if trainer.step >= 2:
            for p in trainer.module.model.parameters():
                p.grad.fill_(float("inf"))
        return loss, small

    trainer.module.strategy.forward_backward = diverging
    with pytest.raises(FloatingPointError, match=r"last good checkpoint \S*step_0000002 is "
                                                 "intact"):
        trainer.fit()
    trainer.close()
    kept = [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")]
    assert kept == ["step_0000002"]  # retention (keep_last=1) kept it through the skips


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_run_leaves_no_process_group_mesh_or_thread_behind(compose, prepared, tmp_path):
    """A two-process run once aborted after it had finished: a gloo thread freed the last
    all-reduce's tensors during interpreter shutdown, with the groups still alive. A run
    (bf16: one process joins a gloo group of one for FSDP2's casts; async checkpoints)
    now returns with no process group, no device mesh and no extra thread left."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.ones(256, 256) @ torch.ones(256, 256)  # the intra-op pool exists before counting
    before = _os_threads()
    # meshes an earlier test of this worker left (an in-process --simulate's) are not this run's
    earlier = {id(o) for o in gc.get_objects() if type(o) is DeviceMesh}
    cfg = compose([*NANO, "precision=bf16", f"data.root={prepared.parent}", "budget.steps=3",
                   "checkpoint.enabled=true", "checkpoint.interval_steps=1",
                   "checkpoint.async_save=true"])
    result = run(cfg, tmp_path / "run")
    assert result["steps"] == 3
    assert not dist.is_initialized()
    meshes = [o for o in gc.get_objects()  # no collect first
              if type(o) is DeviceMesh and id(o) not in earlier]
    assert not meshes, f"{len(meshes)} device meshes still alive after run() returned"
    left = _os_threads() - before
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in left
             if os.path.exists(f"/proc/self/task/{t}")]
    assert not names, f"threads left running after run() returned: {names}"  # gloo's were


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
    from pretrain.checkpoint.folder import CheckpointError

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

    from pretrain.train.run_lock import RunLock, RunLockedError

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
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from pretrain.train.run_lock import "
            "RunLock; RunLock(sys.argv[1]).acquire(); import os; os._exit(9)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"),
                           str(REPO / "src")], timeout=60)
    assert proc.returncode == 9 and (tmp_path / "b" / "run.lock").exists()
    RunLock(tmp_path / "b").acquire()


def test_an_unwritable_checkpoint_folder_is_refused_before_any_step(compose, prepared,
                                                                    tmp_path):
    """The checkpoint folder is checked at setup, not found out at the first save: here a
    file stands where the folder should be (a read-only mount fails the same check; the
    tests run as root, which writes through permissions)."""
    from pretrain.checkpoint.folder import CheckpointError

    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=3",
                   "checkpoint.enabled=true"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a directory")
    trainer = Trainer(cfg, tmp_path / "run")
    with pytest.raises(CheckpointError, match="cannot write checkpoints to .*checkpoints"):
        trainer.setup()
    trainer.close()
    assert trainer.step == 0 and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_too_little_free_space_for_one_checkpoint_is_refused_at_setup(compose, prepared,
                                                                      tmp_path, monkeypatch):
    from pretrain.checkpoint import manager
    from pretrain.checkpoint.folder import CheckpointError

    usage = manager.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(manager.shutil, "disk_usage",
                        lambda path: usage._replace(free=10_000))
    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=3",
                   "checkpoint.enabled=true"])
    trainer = Trainer(cfg, tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"0\.00 GB free, and one checkpoint of this run "
                                              r"takes about 0\.\d\d GB"):
        trainer.setup()
    trainer.close()


def test_a_signal_during_start_up_is_a_stop_request_not_a_kill(compose, prepared, tmp_path):
    """The handlers go in first thing (Trainer's constructor): a SIGTERM while the run is
    still starting up stops it with the requeue status and stopped.json, nothing lost."""
    import os
    import signal

    from pretrain.train.preemption import EXIT_REQUEUE, STOPPED

    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=3"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # before setup: model, data, process group
        trainer.setup()
        result = trainer.fit()
    finally:
        trainer.close()
    assert result == {"steps": 0, "stopped": "SIGTERM"} and trainer.exit_code == EXIT_REQUEUE
    assert json.loads((tmp_path / "run" / STOPPED).read_text())["exit_code"] == EXIT_REQUEUE
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # given back


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_run_local_passes_signals_on_to_the_run_and_waits_for_it(tmp_path, sig):
    """Stopping the launcher stops the run (torchrun and its workers) rather than leaving
    it running: the child gets the signal, and the launcher returns the child's status."""
    import os
    import signal
    import threading

    from pretrain.launch.local import run_forwarding_signals

    ready = tmp_path / "ready"
    child = (f"import signal, sys, time, pathlib\n"
             f"signal.signal(signal.{sig}, lambda *a: sys.exit(7))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)\nsys.exit(0)\n")

    def send_when_ready():
        while not ready.exists():
            threading.Event().wait(0.05)
        os.kill(os.getpid(), getattr(signal, sig))

    before = signal.getsignal(getattr(signal, sig))
    threading.Thread(target=send_when_ready, daemon=True).start()
    assert run_forwarding_signals([sys.executable, "-c", child]) == 7
    assert signal.getsignal(getattr(signal, sig)) == before  # the launcher's own, given back
