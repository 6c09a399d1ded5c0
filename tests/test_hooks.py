"""The loop's hook seam (train/hooks.py, called by train/trainer.py, listed in
train/services.build_hooks): a registered hook sees start, step_end, evaluate and finish in
order at the right steps, adds to what is logged and written, and its state is saved in
each checkpoint's meta.json and handed back on resume."""

from __future__ import annotations

import json

import pytest
from helpers import read_metrics, read_result

import pretrain.train.trainer as trainer_module
from pretrain.train.hooks import Hook
from pretrain.train.services import build_hooks, check_names

NANO = ["model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
        "data.name=tinytext", "data.auto_prepare=false", "data.tokenizer_vocab_size=300",
        "train.global_batch_size=8", "parallel.micro_batch_size=8", "budget=steps",
        "budget.steps=4", "logging=quiet", "logging.wandb=disabled", "logging.log_interval=2",
        "train.eval_batches=1", "train.eval_interval=2", "train.sample_tokens=0",
        "schedule.warmup_steps=1", "checkpoint.enabled=true", "checkpoint.interval_steps=2"]


class Recorder(Hook):
    """Records every call; counts the steps it saw (its state)."""

    name = "recorder"

    def __init__(self):
        self.calls: list[tuple] = []
        self.steps = 0
        self.loaded: dict | None = None

    def start(self, trainer) -> None:
        self.calls.append(("start", trainer.step))

    def step_end(self, trainer, metrics) -> None:
        self.steps += 1
        self.calls.append(("step_end", trainer.step, metrics is not None))
        if metrics is not None:
            metrics["recorder/steps"] = self.steps

    def evaluate(self, trainer, metrics) -> None:
        self.calls.append(("evaluate", trainer.step))
        metrics["recorder/eval_step"] = trainer.step

    def finish(self, trainer, result) -> None:
        self.calls.append(("finish", trainer.step))
        result["recorder_steps"] = self.steps

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = dict(state)
        self.steps = int(state["steps"])

    def close(self) -> None:
        self.calls.append(("close",))


@pytest.fixture
def registered(monkeypatch) -> list[Recorder]:
    """A Recorder appended to the registry's hooks; the list holds each run's."""
    made: list[Recorder] = []

    def build(trainer):
        made.append(Recorder())
        return check_names([*build_hooks(trainer), made[-1]])

    monkeypatch.setattr(trainer_module, "build_hooks", build)
    return made


def test_a_hook_sees_the_loop_in_order_and_adds_to_the_logs_and_the_result(
        compose, prepared, tmp_path, registered):
    run_dir = tmp_path / "run"
    result = trainer_module.run(compose([*NANO, f"data.root={prepared.parent}"]), run_dir)
    hook, = registered
    assert hook.calls == [
        ("start", 0), ("evaluate", 0),
        ("step_end", 1, True), ("step_end", 2, True), ("evaluate", 2),
        ("step_end", 3, False), ("step_end", 4, True), ("evaluate", 4),
        ("finish", 4), ("close",)]
    rows = read_metrics(run_dir)
    assert {r["step"]: r["recorder/steps"] for r in rows if "loss" in r} == {1: 1, 2: 2, 4: 4}
    assert {r["step"]: r["recorder/eval_step"] for r in rows if "val_loss" in r} == \
        {0: 0, 2: 2, 4: 4}
    assert result["recorder_steps"] == read_result(run_dir)["recorder_steps"] == 4
    metas = {p.name: json.loads((p / "meta.json").read_text())
             for p in (run_dir / "checkpoints").glob("step_*")}
    assert metas["step_0000002"]["recorder"] == {"steps": 2}
    assert metas["step_0000004"]["recorder"] == {"steps": 4}
    assert "noise_scale" in metas["step_0000002"]  # the probe's averages, on the seam too


def test_a_hooks_state_survives_a_resume(compose, prepared, tmp_path, registered):
    """Stopped after step 2 (train.exit_interval: saved, exit 75), then a fresh Trainer
    resumes: the new hook gets the saved state and ends where the uninterrupted run did."""
    cfg = compose([*NANO, f"data.root={prepared.parent}", "train.exit_interval=2"])
    first = trainer_module.run(cfg, tmp_path / "run")
    assert first["exit_code"] == 75 and first["steps"] == 2
    assert registered[0].calls[-3:] == [("step_end", 2, True), ("evaluate", 2),
                                        ("close",)]  # stopped: no finish
    resumed = trainer_module.run(cfg, tmp_path / "run")
    hook = registered[1]
    assert hook.loaded == {"steps": 2}
    assert hook.calls == [("start", 2), ("step_end", 3, False), ("step_end", 4, True),
                          ("evaluate", 4), ("finish", 4), ("close",)]
    assert resumed["steps"] == 4 and resumed["recorder_steps"] == 4


def test_a_hook_newer_than_the_checkpoint_starts_fresh(compose, prepared, tmp_path,
                                                       monkeypatch):
    """A checkpoint saved before a hook existed has no state for it: load_state_dict is
    not called, and the hook starts from its own defaults."""
    cfg = compose([*NANO, f"data.root={prepared.parent}", "train.exit_interval=2"])
    trainer_module.run(cfg, tmp_path / "run")  # the registry as it is: no Recorder
    made = []

    def build(trainer):
        made.append(Recorder())
        return [*build_hooks(trainer), made[-1]]

    monkeypatch.setattr(trainer_module, "build_hooks", build)
    assert trainer_module.run(cfg, tmp_path / "run")["recorder_steps"] == 2  # steps 3, 4
    assert made[0].loaded is None


def test_hook_names_are_their_own():
    class A(Hook):
        name = "a"

    class Step(Hook):
        name = "step"  # meta.json's own key

    with pytest.raises(ValueError, match=r"\['a'\] are taken"):
        check_names([A(), A()])
    with pytest.raises(ValueError, match=r"\['step'\] are taken"):
        check_names([Step()])
    assert [h.name for h in check_names([A()])] == ["a"]
