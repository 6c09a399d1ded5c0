"""One training run is one wandb run: the id is kept in the run directory, so a resumed
(requeued) run continues its wandb run, while another run directory, or a fresh start in
the same one, gets its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.train.metrics import WANDB_ID, wandb_run_id
from pretrain.train.trainer import Trainer


def test_the_id_is_kept_for_a_resume_and_new_for_a_fresh_start(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = wandb_run_id(run, fresh=True)
    assert (run / WANDB_ID).read_text().strip() == first
    assert len(first) == 8 and first.isalnum() and first == first.lower()
    assert wandb_run_id(run, fresh=False) == first  # every later attempt
    other = tmp_path / "other"
    other.mkdir()
    assert wandb_run_id(other, fresh=True) != first  # another run directory
    assert wandb_run_id(other, fresh=False) == wandb_run_id(other, fresh=False)
    again = wandb_run_id(run, fresh=True)  # a fresh start (step 0) in the same directory
    assert again != first and wandb_run_id(run, fresh=False) == again
    legacy = tmp_path / "legacy"  # resumed, but made before ids were kept: a new one, kept
    legacy.mkdir()
    assert wandb_run_id(legacy, fresh=False) == (legacy / WANDB_ID).read_text().strip()


def offline_folders(run: Path) -> list[Path]:
    """wandb's offline folders, one per wandb.init; their names (``offline-run-<time>-<id>``,
    ``-1`` and so on added when two start in the same second) are not read for the id."""
    return sorted((run / "wandb").glob("offline-run-*"))


def started(compose, prepared, run_dir: Path) -> Trainer:
    """A trainer set up in ``run_dir`` (resumed if it holds a checkpoint), wandb offline."""
    trainer = Trainer(compose([
        "model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "data.name=tinytext", f"data.root={prepared.parent}", "data.auto_prepare=false",
        "data.tokenizer_vocab_size=300", "train.global_batch_size=4",
        "parallel.micro_batch_size=4", "budget=steps", "budget.steps=3", "logging=quiet",
        "logging.wandb=offline"]), run_dir)
    trainer.setup()
    return trainer


def stopped(trainer: Trainer) -> None:
    trainer.ckpt.close()
    trainer.metrics.close()
    trainer.stop.restore()


def test_a_resumed_run_logs_to_the_same_offline_wandb_run(compose, prepared, tmp_path):
    """Two trainer starts in one run directory (the second resumes the first's checkpoint)
    continue one wandb run, by wandb's own account (``Run.id``), in two offline folders;
    another run directory gets another id. Whether the starts fall in the same second
    (wandb then names the second folder ``...-<id>-1``) does not matter."""
    run = tmp_path / "run"
    first = started(compose, prepared, run)
    first.metrics.log({"step": 1, "loss": first.train_step_local()[0].item()})
    first.save_checkpoint(block=True)
    ids = [first.metrics.wandb.id]
    stopped(first)
    second = started(compose, prepared, run)
    assert second.step == 1  # resumed
    second.metrics.log({"step": 2, "loss": second.train_step_local()[0].item()})
    ids.append(second.metrics.wandb.id)
    stopped(second)
    run_id = (run / WANDB_ID).read_text().strip()
    assert ids == [run_id, run_id] and len(offline_folders(run)) == 2
    other = started(compose, prepared, tmp_path / "other")
    assert other.metrics.wandb.id != run_id
    stopped(other)
    assert len(offline_folders(tmp_path / "other")) == 1


def test_two_attempts_in_the_same_second_are_one_run(compose, prepared, tmp_path, caplog):
    """Issue 62's failure made certain: both starts in one second (a frozen clock for
    wandb's folder name), so wandb adds ``-1`` to the second folder's name; the run's
    attempts still report one id, the one its wandb_id file keeps."""
    from datetime import datetime

    import wandb.sdk.wandb_settings as settings

    class Frozen(datetime):
        @classmethod
        def fromtimestamp(cls, t, tz=None):
            return datetime(2026, 11, 28, 12, 0, 0, tzinfo=tz)

    run = tmp_path / "run"
    caplog.set_level("INFO", logger="pretrain")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "datetime", Frozen)
        first = started(compose, prepared, run)
        first.train_step_local()
        first.save_checkpoint(block=True)
        stopped(first)
        second = started(compose, prepared, run)
        assert second.step == 1  # resumed
        stopped(second)
    run_id = (run / WANDB_ID).read_text().strip()
    names = [p.name for p in offline_folders(run)]
    reported = [r.getMessage().split()[2] for r in caplog.records
                if r.getMessage().startswith("wandb run ")]
    assert reported == [run_id, run_id], (reported, names)
    assert names == [f"offline-run-20261128_120000-{run_id}",
                     f"offline-run-20261128_120000-{run_id}-1"]  # what broke the old reader
