"""The loop's hook seam (train/hooks.py, called by train/trainer.py, the services found by
train/services.build_hooks): a registered hook sees start, before_step, step_end, evaluate
and finish in order at the right steps through a LoopContext (never the trainer), adds to
what is logged and written with ``record``, and its state is saved in each checkpoint's
meta.json and handed back on resume. A module dropped into the services package is found
and built with no other edit."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import read_metrics, read_result

import pretrain.train.trainer as trainer_module
from pretrain.train import hooks as hooks_module
from pretrain.train.hooks import Hook, LoopContext
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
        self.before: int | None = None

    def start(self, ctx: LoopContext) -> None:
        assert isinstance(ctx, LoopContext)
        self.calls.append(("start", ctx.step))

    def before_step(self, ctx: LoopContext) -> None:
        self.before = ctx.step  # the step about to run is ctx.step + 1

    def step_end(self, ctx: LoopContext) -> None:
        assert self.before == ctx.step - 1 and ctx.tokens == ctx.step * ctx.batch_tokens
        self.steps += 1
        self.calls.append(("step_end", ctx.step, ctx.logging))
        if ctx.logging:
            ctx.record("recorder/steps", self.steps)
        else:
            with pytest.raises(RuntimeError, match="outside a logging point"):
                ctx.record("recorder/steps", self.steps)

    def evaluate(self, ctx: LoopContext) -> None:
        self.calls.append(("evaluate", ctx.step))
        ctx.record("recorder/eval_step", ctx.step)

    def finish(self, ctx: LoopContext) -> None:
        self.calls.append(("finish", ctx.step))
        ctx.record("recorder_steps", self.steps)

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

    def build(ctx):
        made.append(Recorder())
        return check_names([*build_hooks(ctx), made[-1]])

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

    def build(ctx):
        made.append(Recorder())
        return [*build_hooks(ctx), made[-1]]

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


def test_a_module_in_the_services_package_is_found_and_built(compose, prepared, tmp_path,
                                                             monkeypatch):
    """A new hook is one file: a module of the package, registering itself, is imported and
    built by build_hooks in its order, with no line anywhere else."""
    import pretrain.train.services as services

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "probe_hook.py").write_text(
        "from pretrain.train.hooks import Hook, register\n\n"
        "@register(order=1)\n"
        "class ProbeHook(Hook):\n"
        "    name = 'probe'\n\n"
        "    def finish(self, ctx):\n"
        "        ctx.record('probe_steps', ctx.step)\n")
    monkeypatch.setattr(services, "__path__", [*services.__path__, str(package)])
    monkeypatch.setattr(hooks_module, "REGISTRY", dict(hooks_module.REGISTRY))
    result = trainer_module.run(compose([*NANO, f"data.root={prepared.parent}",
                                         "checkpoint.enabled=false"]), tmp_path / "run")
    sys.modules.pop("pretrain.train.services.probe_hook", None)
    assert result["probe_steps"] == 4
    order = [f.__qualname__ for f in hooks_module.registered()]
    assert order[0] == "ProbeHook" and "NoiseScaleHook" in order
