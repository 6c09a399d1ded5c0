"""One training run is one wandb run: the id is kept in the run directory, so a resumed
(requeued) run continues its wandb run, while another run directory, or a fresh start in
the same one, gets its own."""

from __future__ import annotations

from pathlib import Path

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


def offline_run_ids(run: Path) -> list[str]:
    """wandb's offline folders are ``offline-run-<time>-<id>``, one per wandb.init."""
    return sorted(p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*"))


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
    write two offline folders with one id; another run directory gets another id."""
    run = tmp_path / "run"
    first = started(compose, prepared, run)
    first.metrics.log({"step": 1, "loss": first.train_step_local()[0].item()})
    first.save_checkpoint(block=True)
    stopped(first)
    second = started(compose, prepared, run)
    assert second.step == 1  # resumed
    second.metrics.log({"step": 2, "loss": second.train_step_local()[0].item()})
    stopped(second)
    run_id = (run / WANDB_ID).read_text().strip()
    assert offline_run_ids(run) == [run_id, run_id]
    other = started(compose, prepared, tmp_path / "other")
    stopped(other)
    assert offline_run_ids(tmp_path / "other") != [run_id]
