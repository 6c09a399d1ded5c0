"""z-loss in the training loop, and the spike guard (optim.spike_guard): the window against
a reference computation, a guarded run that skips exactly an injected spike and nothing
else, and a resumed guarded run that ends bit for bit where the uninterrupted one does."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import read_metrics
from test_reliability import NANO

from pretrain.config.schema import ConfigError
from pretrain.decision.checks import check
from pretrain.optim.spike_guard import SpikeGuard
from pretrain.train.trainer import Trainer

GUARD = ["optim.spike_guard=true", "optim.spike_window=8", "optim.spike_warmup=4"]
SPIKE_AT = 10  # the optimizer step (1-based) whose batch is made bad


def test_the_guard_decides_as_the_reference_formula():
    """Random (loss, grad norm) pairs, some of them spikes: the guard's decision equals
    mean + k x std (unbiased) over the last ``window`` accepted steps, once ``warmup`` are in."""
    g = torch.Generator().manual_seed(0)
    guard = SpikeGuard(torch.device("cpu"), sigmas=3.0, window=8, warmup=4)
    accepted: list[tuple[float, float]] = []
    decisions = []
    for i in range(60):
        loss, norm = 3 + 0.1 * torch.randn((), generator=g), 1 + 0.1 * torch.rand((), generator=g)
        if i % 7 == 6:
            loss = loss + (2.0 if i % 2 else 0.0)
            norm = norm * (1.0 if i % 2 else 5.0)
        ok = guard.ok(loss, norm)
        window = torch.tensor(accepted[-8:])
        expect = True
        if len(accepted) >= 4:
            mean, std = window.mean(0), window.std(0)
            expect = bool((loss <= mean[0] + 3 * std[0]) & (norm <= mean[1] + 3 * std[1]))
        assert bool(ok) == expect, i
        decisions.append(expect)
        guard.record(loss, norm, torch.tensor(True), ok)
        if expect:
            accepted.append((float(loss), float(norm)))
    assert decisions.count(False) >= 6  # the spikes were caught
    assert guard.settle() == decisions.count(False)
    again = SpikeGuard(torch.device("cpu"), sigmas=3.0, window=8, warmup=4)
    again.load_state_dict(guard.state_dict())
    assert torch.equal(again.values, guard.values) and again.count == guard.count


def _guarded_trainer(compose, prepared, run_dir, *extra):
    """A nano run whose batch at step SPIKE_AT has its loss and gradients scaled by 1e3;
    returns the trainer and the list its guard's decisions land in ((step, taken))."""
    cfg = compose([*NANO, f"data.root={prepared.parent}", "budget.steps=16",
                   "logging.log_interval=1", *GUARD, *extra])
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    real = trainer.module.strategy.forward_backward

    def bad_batch(x, y, measure=False):
        loss, small = real(x, y, measure)
        if trainer.step + 1 == SPIKE_AT:
            for p in trainer.module.model.parameters():
                p.grad.mul_(1e3)
            loss = loss * 1e3
        return loss, small

    trainer.module.strategy.forward_backward = bad_batch
    decisions: list[tuple[int, bool]] = []
    record = trainer.module.guard.record

    def recorded(loss, norm, finite, ok):
        decisions.append((trainer.step + 1, bool(finite & ok)))
        record(loss, norm, finite, ok)

    trainer.module.guard.record = recorded
    return trainer, decisions


def test_the_guard_skips_exactly_the_injected_spike(compose, prepared, tmp_path):
    trainer, decisions = _guarded_trainer(compose, prepared, tmp_path / "run")
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert [s for s, taken in decisions if not taken] == [SPIKE_AT]
    assert result["spike_skipped_steps"] == 1 and result["skipped_steps"] == 0
    logged = {m["step"]: m for m in read_metrics(tmp_path / "run") if "loss" in m}
    assert logged[SPIKE_AT - 1].get("spike_skipped_steps") == 0
    assert logged[SPIKE_AT]["spike_skipped_steps"] == 1


def test_a_resumed_guarded_run_ends_where_the_uninterrupted_one_does(compose, prepared,
                                                                    tmp_path):
    """Checkpointed at step 6 (the window half full, the spike to come at step 10), resumed
    in a new process's state: the same skip, the same final losses, bit for bit. Without
    the restored window the guard would still be warming up at step 10 and take the spike."""
    ckpt = ["checkpoint.enabled=true", "checkpoint.interval_steps=6", "checkpoint.keep_last=5",
            "checkpoint.async_save=false"]
    trainer, _ = _guarded_trainer(compose, prepared, tmp_path / "straight", *ckpt)
    try:
        straight = trainer.fit()
    finally:
        trainer.close()
    saved = tmp_path / "straight" / "checkpoints" / "step_0000006"
    assert saved.is_dir()
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / "step_0000006")
    trainer, decisions = _guarded_trainer(compose, prepared, tmp_path / "resumed", *ckpt)
    try:
        assert trainer.step == 6
        resumed = trainer.fit()
    finally:
        trainer.close()
    assert [s for s, taken in decisions if not taken] == [SPIKE_AT]
    for key in ("final_loss", "final_val_loss", "spike_skipped_steps"):
        assert resumed[key] == straight[key], key


def test_z_loss_trains_the_term_and_reports_plain_losses(compose, prepared, tmp_path):
    """train.z_loss: the first step's reported loss and the starting validation loss are
    the plain cross-entropy (the same bits as without z-loss); the term is logged; from the
    second step on the updates differ."""
    base = [*NANO, f"data.root={prepared.parent}", "budget.steps=3", "logging.log_interval=1"]
    results = {}
    for z in ("0", "0.01"):
        trainer = Trainer(compose([*base, f"train.z_loss={z}"]), tmp_path / z)
        try:
            trainer.setup()
            results[z] = trainer.fit()
        finally:
            trainer.close()
    plain, zl = (read_metrics(tmp_path / z) for z in ("0", "0.01"))
    train_rows = [[m for m in rows if "loss" in m] for rows in (plain, zl)]
    assert train_rows[1][0]["loss"] == train_rows[0][0]["loss"]
    assert results["0.01"]["first_val_loss"] == results["0"]["first_val_loss"]
    assert results["0.01"]["final_val_loss"] != results["0"]["final_val_loss"]
    assert all(m["z_loss"] > 0 for m in train_rows[1])
    assert "z_loss" not in train_rows[0][0]


@pytest.mark.parametrize("overrides, says", [
    (["train.z_loss=-1"], "train.z_loss=-1.0 must be >= 0"),
    (["train.z_loss=1e-4", "parallel=tp2"], "set train.z_loss=0, or train with parallel.tp=1"),
    (["optim.spike_guard=true", "optim.spike_warmup=200"], "set optim.spike_warmup=64"),
    (["optim.spike_guard=true", "precision=fp16"], "use precision=bf16"),
])
def test_bad_stability_keys_are_refused_naming_the_fix(compose, overrides, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("(", r"\(")):
        check(compose(overrides))


@pytest.mark.slow
def test_z_loss_under_a_pipeline_is_the_one_process_z_loss(compose, prepared, tmp_path):
    """pp=2 (two processes, the loss on the last stage, the schedule's first step calling the
    loss to infer shapes too): the same reported losses and z-loss terms as one process.
    One process runs here (pretrain.train.trainer.run, what train.py calls), the pipeline
    in two forked ranks (tests/runs_worker.py): no train.py, run_local or torchrun start-up
    (test_parallel_launch.py launches those)."""
    from helpers import HERE, failed, one_thread, run_ranks, write_spec

    from pretrain.train.trainer import run

    common = [a for a in NANO if not a.startswith(("logging=", "parallel.micro"))] + [
        f"data.root={prepared.parent}", "budget.steps=3", "train.z_loss=1e-2",
        "logging.log_interval=1", "parallel.micro_batch_size=4", "logging=quiet",
        f"runs_dir={tmp_path}"]
    with one_thread():
        assert run(compose([*common, "run_name=one"]), tmp_path / "one")["exit_code"] == 0
    cfg = compose([*common, "parallel=pp2", "parallel.dp=1", "run_name=pp2"])
    spec = write_spec(tmp_path / "spec.pkl", runs=[("pp2", cfg, tmp_path / "pp2")])
    proc = run_ranks(HERE / "runs_worker.py", str(tmp_path), str(spec), nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, failed(proc)
    one, pp2 = ([m for m in read_metrics(tmp_path / n) if "loss" in m] for n in ("one", "pp2"))
    assert [m["step"] for m in pp2] == [1, 2, 3]
    for a, b in zip(one, pp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["z_loss"] == pytest.approx(a["z_loss"], rel=1e-5) and a["z_loss"] > 0


def test_a_fused_optimizer_skips_a_spike_on_the_device(compose, prepared, tmp_path):
    """With a fused AdamW (the GPU default) the spike step is decided without a host read:
    no ``.item()`` in it, parameters and optimizer state untouched."""
    trainer, decisions = _guarded_trainer(compose, prepared, tmp_path / "fused",
                                          "optim.fused=true")
    try:
        assert trainer.module.optimizer.defaults["fused"]
        for _ in range(SPIKE_AT - 1):
            trainer.train_step_local()
        params = [p.detach().clone() for p in trainer.module.model.parameters()]
        state = [v.clone() for p in trainer.module.model.parameters()
                 for v in trainer.module.optimizer.state[p].values()]
        syncs = []
        orig_item = torch.Tensor.item
        torch.Tensor.item = lambda t: syncs.append(1) or orig_item(t)
        try:
            del trainer.module.guard.record  # the test's recorder reads on the host
            trainer.train_step_local()
        finally:
            torch.Tensor.item = orig_item
        assert syncs == []
        assert all(torch.equal(p, q) for p, q in zip(trainer.module.model.parameters(), params,
                                                     strict=True))
        after = [v for p in trainer.module.model.parameters()
                 for v in trainer.module.optimizer.state[p].values()]
        assert all(torch.equal(a, b) for a, b in zip(after, state, strict=True))
        trainer._check_nonfinite()
        assert trainer.module.step_counts()["spike_skipped_steps"] == 1
        assert [s for s, taken in decisions if not taken] == []  # before the spike
    finally:
        trainer.close()
