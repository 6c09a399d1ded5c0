"""What the training loop costs between optimizer steps, on 2 processes (gloo), and that a
stop still stops every rank at the same step.

A step makes no host sync: with a fused AdamW (the GPU default, asked for here on the CPU)
every rank skips a non-finite step on the device from the global grad norm (all-reduced
inside clip_grad_norm anyway), and the skip counts are read on steps that sync. Everything else
that must be global waits for a step that needs it: the training loss is accumulated on the
device and reduced on logging steps (one all-reduce for the mean since the last log and the
last step's loss, plus the peak-memory all-reduce and the step monitor's all-gather of
each rank's step time), and the stop request (signal, time
limit) is agreed on every ``train.stop_check_interval`` steps (one all-reduce). The counts
come from tests/loop_worker.py, which wraps torch.distributed's collectives and
``Tensor.item``/``tolist`` as called from ``pretrain`` code. Before this loop, every step
made two more all-reduces (loss, stop) and two more host syncs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from built_once import built_once
from helpers import HERE, MARKOV_DATA, VOCAB, by_step, compose_all, failed, run_ranks, write_spec

STEPS, LOG_EVERY, CHECK_EVERY = 12, 6, 4
SIGNAL_AFTER = 5  # rank 1 alone gets SIGUSR1 after this step

COMMON = [
    "model=nano", "model.n_layer=4", f"model.vocab_size={VOCAB}", "model.seq_len=32",
    "model.attention=sdpa", "precision=fp32", *MARKOV_DATA, "budget=steps", f"budget.steps={STEPS}",
    "train.global_batch_size=8", "parallel.micro_batch_size=2", "train.eval_batches=2",
    "train.eval_interval=1000", "train.sample_tokens=0", "logging=quiet",
    f"logging.log_interval={LOG_EVERY}", f"train.stop_check_interval={CHECK_EVERY}",
    "logging.wandb=disabled", "schedule.warmup_steps=0", "optim.fused=true",
]
PP2 = ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=1f1b"]
RUNS = {
    "pp2": {"overrides": PP2},
    "ddp2": {"overrides": ["parallel.dp=2", "parallel.dp_mode=ddp"]},
    "pp2_signal": {"overrides": [*PP2, "checkpoint.enabled=true"],
                   "signal": [SIGNAL_AFTER, 1]},
    "pp2_signal_check_every_step": {
        "overrides": [*PP2, "checkpoint.enabled=true", "train.stop_check_interval=1"],
        "signal": [SIGNAL_AFTER, 1]},
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, markov_root) -> dict[str, list[dict]]:
    """Every run's per-rank records, from one 2-rank group of tests/loop_worker.py forked
    from one import (helpers.run_ranks); once per pytest run (tests/built_once.py)."""
    return built_once(tmp_path_factory, "loop-syncs", lambda root: train_all(root, markov_root))


def train_all(root: Path, markov_root: Path) -> dict[str, list[dict]]:
    common = [*COMMON, f"data.root={markov_root}", f"runs_dir={root / 'runs'}"]
    configs = compose_all({name: [*common, *run["overrides"], f"run_name={name}"]
                           for name, run in RUNS.items()})
    spec = write_spec(root / "spec.pkl", runs={name: {"config": configs[name],
                                                      "signal": run.get("signal")}
                                               for name, run in RUNS.items()})
    proc = run_ranks(HERE / "loop_worker.py", str(root), str(spec), nproc=2, cwd=root)
    assert proc.returncode == 0, failed(proc)
    out = {name: [json.loads((root / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
           for name in RUNS}
    for name, ranks in out.items():
        ranks[0]["run_dir"] = root / name
    return out


def loop_cost(step: int) -> int:
    """Collectives the loop makes after ``step`` (not the last): 3 on a logging step (loss,
    peak memory, the step monitor's per-rank step times), 1 on a stop-check step, none
    otherwise; after the first step also the barrier before every rank takes the train
    timeout (train/hang.py)."""
    if step == 1 or step % LOG_EVERY == 0:
        return 3 + (step % CHECK_EVERY == 0) + (step == 1)
    return int(step % CHECK_EVERY == 0)


@pytest.mark.parametrize("name", ["pp2", "ddp2"])
def test_steps_make_no_host_sync_and_quiet_steps_none_at_all(runs, name):
    for rank in runs[name]:
        assert rank["result"]["steps"] == STEPS
        steps = {int(k): v for k, v in rank["steps"].items()}
        for k in range(1, STEPS):
            after = steps[k]
            assert after.get("step_syncs", 0) == 0, (k, after)  # skip decided on the device
            assert after.get("loop_collectives", 0) == loop_cost(k), (k, after)
            if loop_cost(k) == 0:
                assert after.get("loop_syncs", 0) == 0, (k, after)
        quiet = [k for k in range(1, STEPS) if loop_cost(k) == 0]
        assert len(quiet) == 7  # most steps: no collective and no sync outside the step


def test_logged_loss_is_the_mean_since_the_last_log(runs):
    """Logging steps report the mean loss over the steps since the previous log line, and
    result.json the last step's loss. pp2, dp 1: the last stage's loss is the global one."""
    r0, r1 = runs["pp2"]
    assert r0["result"] == r1["result"]  # every rank reports the same global numbers
    per_step = r1["local_losses"]  # rank 1 holds the last stage
    assert len(per_step) == STEPS and r0["local_losses"] == [0.0] * STEPS
    assert r1["result"]["final_loss"] == pytest.approx(per_step[-1], rel=1e-6)
    logged = by_step(r0["run_dir"])
    assert sorted(logged) == [1, 6, 12]
    assert logged[1] == pytest.approx(per_step[0], rel=1e-6)
    assert logged[6] == pytest.approx(sum(per_step[1:6]) / 5, rel=1e-6)
    assert logged[12] == pytest.approx(sum(per_step[6:12]) / 6, rel=1e-6)


@pytest.mark.parametrize("name, stop_at", [("pp2_signal", 8),
                                           ("pp2_signal_check_every_step", SIGNAL_AFTER)])
def test_signal_on_one_rank_stops_every_rank_at_the_same_step(runs, name, stop_at):
    """SIGUSR1 reaches rank 1 alone right after step 5; both ranks stop at the next stop
    check (after step 8 with checks every 4 steps; after step 5 itself with
    train.stop_check_interval=1, as before there was an interval), save there, and report
    why."""
    r0, r1 = (r["result"] for r in runs[name])
    assert r0["steps"] == r1["steps"] == stop_at
    assert r1["stopped"] == "SIGUSR1" and r0["stopped"] == "signal"
