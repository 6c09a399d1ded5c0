"""A save that fails inside torch's own write (DCP's writer raises; DCP wraps it in a
CheckpointException, a BaseException) ends in the documented message naming the cause in
words, sync or async, at the next step; the older checkpoint is kept and nothing partial is
loadable."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs
from test_checkpoint_manager import Progress, trained_pair
from test_reliability import NANO

from pretrain.checkpoint.failures import cause_in_words
from pretrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    ModelOptimizer,
    complete_checkpoints,
)
from pretrain.config.schema import CheckpointConfig
from pretrain.train.trainer import Trainer

FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
CASES = {
    "read-only": (OSError(errno.EROFS, "Read-only file system"),
                  "the directory is read-only or not writable \\(read-only file system\\)"),
    "no space": (OSError(errno.ENOSPC, "No space left on device"), "no space left"),
    "quota": (OSError(errno.EDQUOT, "Disk quota exceeded"), "the disk quota is exceeded"),
    "zip writer on a full disk": (FULL, "no space left on the device"),
}


def fail_dcp_writes(monkeypatch, error: BaseException, full_disk: bool) -> None:
    """DCP's writer fails writing a shard, as the filesystem makes it (a raise inside
    torch's code, which DCP turns into a CheckpointException)."""
    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(dcp_fs, "_write_item", failing)
    if full_disk:
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(8 << 20, 8 << 20, 0))


def state(model, opt, step):
    return {"model_optim": ModelOptimizer(model, opt), "train": Progress(step)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failure_inside_dcp_write_names_its_cause(tmp_path, monkeypatch, case, async_save):
    error, words = CASES[case]
    model, opt = trained_pair(0)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(enabled=True, async_save=async_save))
    mgr.save(1, state(model, opt, 1), {"step": 1})
    mgr.wait()
    older = {f.name: f.read_bytes() for f in (tmp_path / "step_0000001").iterdir()}
    fail_dcp_writes(monkeypatch, error, full_disk=error is FULL)
    expected = f"saving checkpoint step_0000002 in .* failed: {words}.*older checkpoints"
    with pytest.raises(CheckpointError, match=expected) as raised:
        mgr.save(2, state(model, opt, 2), {"step": 2})
        assert async_save  # a blocking save raised already
        mgr.pending[0].exception()  # the write has failed in the background
        mgr.poll()  # the next step's poll raises it
    assert "Traceback" not in str(raised.value)
    monkeypatch.undo()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1]
    assert mgr.latest() == tmp_path / "step_0000001"
    assert older == {f.name: f.read_bytes() for f in (tmp_path / "step_0000001").iterdir()}
    mgr.close()


def test_a_write_stopped_short_on_a_disk_with_room_says_what_torch_said(tmp_path):
    said = cause_in_words(FULL, tmp_path)
    assert said.startswith("RuntimeError: [enforce fail") and "is the disk full?" in said


def test_a_folder_deleted_during_the_save_is_named(tmp_path):
    gone = tmp_path / "checkpoints"
    assert cause_in_words(FileNotFoundError(errno.ENOENT, "No such file or directory",
                                            str(gone / "x")), gone).startswith(
        "a folder of the save is missing")
    assert cause_in_words(RuntimeError("boom"), gone) == (
        f"a folder of the save is missing ({gone})")


def test_an_async_save_failing_in_a_run_stops_it_at_the_next_step(compose, prepared,
                                                                  tmp_path, monkeypatch):
    """Step 2's async save fails writing (read-only); the run stops after step 3 (the first
    step end after the failure) with the documented message, not at the next save."""
    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=12",
                   "checkpoint.enabled=true", "checkpoint.interval_steps=2",
                   "checkpoint.async_save=true", "train.stop_check_interval=10"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.setup()
    real = trainer.train_step_local

    def step():
        if trainer.step == 2:  # step 2 saved (in the background): let its write fail first
            trainer.ckpt.pending[0].exception()
        return real()

    def save_then_fail(*args, **kwargs):
        fail_dcp_writes(monkeypatch, CASES["read-only"][0], full_disk=False)
        return real_save(*args, **kwargs)

    real_save = trainer.save_checkpoint
    trainer.save_checkpoint = save_then_fail
    trainer.train_step_local = step
    try:
        with pytest.raises(CheckpointError, match="saving checkpoint step_0000002 .* failed: "
                                                  "the directory is read-only"):
            trainer.fit()
        assert trainer.step == 3
    finally:
        monkeypatch.undo()
        trainer.close()
    assert not complete_checkpoints(tmp_path / "run" / "checkpoints")
