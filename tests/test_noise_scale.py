"""The gradient noise scale: the estimator recovers a known B_simple on a synthetic problem
(tests/noise_problem.py: B_simple = 17 samples), measured the way the trainer does (the
first micro batch's gradient vs the whole step's) in one process with accumulation and on
2 data-parallel ranks (FSDP2, and DDP with the first micro batch reduced at once); and real
training runs log it at every logging step.

Tolerance: 10% of B_simple. At these sizes (256 independent regressions per step, 150
steps, EMA 0.98) the estimate's standard deviation over seeds is about 3%.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import (
    HERE,
    MARKOV_DATA,
    VOCAB,
    by_step,
    compose_config,
    failed,
    read_result,
    run_ranks,
    write_spec,
)
from noise_problem import B_SIMPLE, SIGMA, D, Regressions, measure, w_star

from pretrain.train.noise_scale import NoiseScale, compare_batch, estimates

TOL = 0.10


def test_estimator_on_exact_per_sample_gradients():
    """The unbiased estimates from per-sample gradients drawn directly (no autograd)."""
    rng = np.random.default_rng(0)
    bs, bb, k = 4, 16, 20_000
    x = rng.standard_normal((k, bb, D))
    eps = SIGMA * rng.standard_normal((k, bb))
    g = (x[..., 0] - eps)[..., None] * x  # delta = e_1
    small, big = (g[:, :bs].mean(1) ** 2).sum(-1), (g.mean(1) ** 2).sum(-1)
    grad_sq, trace = estimates(small, big, bs, bb)
    assert grad_sq.mean() == pytest.approx(1.0, rel=TOL)  # |G|^2 = |delta|^2
    assert trace.mean() == pytest.approx(B_SIMPLE, rel=TOL)  # tr(Sigma) = 17
    with pytest.raises(ValueError):
        estimates(1.0, 1.0, 16, 16)


def test_noise_scale_ema_and_messages():
    ns = NoiseScale(0.5)
    assert ns.value is None
    assert not ns.update(math.nan, 1.0, 1, 2)  # an overflowed step changes nothing
    ns.update(small_sq=3.0, big_sq=2.0, b_small=1, b_big=2)  # |G|^2 1, tr 2
    assert ns.value == pytest.approx(2.0)
    assert not ns.update(small_sq=300.0, big_sq=200.0, b_small=1, b_big=2)  # a spike
    assert ns.spikes == 1 and ns.value == pytest.approx(2.0)
    assert "larger batch" in compare_batch(100, 1e4)
    assert "smaller batch" in compare_batch(10**5, 1e3)


def test_one_process_with_accumulation():
    """4 micro batches of 4 samples: B_small = 4, B_big = 16."""
    value = measure(Regressions(), 4, 4, torch.Generator().manual_seed(0), w_star(), dp=1)
    assert value == pytest.approx(B_SIMPLE, rel=TOL)


@pytest.mark.slow
def test_two_data_parallel_ranks(tmp_path):
    """2 ranks x 4 micro batches of 2 samples, FSDP2 (ZeRO-3) and DDP: B_small = the first
    micro batch over both ranks = 4, B_big = 16. The ranks are forked from one import
    (helpers.run_ranks, tests/noise_problem.py's main)."""
    proc = run_ranks(HERE / "noise_problem.py", str(tmp_path), nproc=2, cwd=tmp_path,
                     timeout=300)
    assert proc.returncode == 0, failed(proc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for mode in ("zero3", "ddp"):
        for out in results:
            assert out[mode]["value"] == pytest.approx(B_SIMPLE, rel=TOL), mode
            assert out[mode]["grad_error"] < 1e-5, mode
        assert results[0][mode]["value"] == pytest.approx(results[1][mode]["value"])


# -- real training runs ---------------------------------------------------------------------

COMMON = [
    "model=nano", "model.n_layer=2", f"model.vocab_size={VOCAB}", "model.seq_len=32",
    "model.attention=sdpa", "precision=fp32", *MARKOV_DATA, "budget=steps", "budget.steps=9",
    "train.global_batch_size=8", "train.eval_batches=1", "train.eval_interval=1000",
    "train.sample_tokens=0", "logging=quiet", "logging.log_interval=3",
    "schedule.warmup_steps=2",
]


@pytest.mark.slow
@pytest.mark.parametrize("name, nproc, extra", [
    ("dp2", 2, ["parallel.dp=2", "parallel.micro_batch_size=4"]),  # one micro batch: halves
    ("accum2", 1, ["parallel.micro_batch_size=4"]),  # one process, 2 micro batches
])
def test_training_logs_noise_scale_at_every_logging_step(tmp_path, markov_root, name, nproc,
                                                        extra):
    """The run as train.py trains it (pretrain.train.trainer's setup and fit): in this
    process, and on 2 ranks forked from one import (tests/runs_worker.py; train.py's own
    start-up and torchrun are tests/test_train_e2e.py's and tests/test_parallel_launch.py's)."""
    overrides = [*COMMON, *extra, "train.device=cpu", f"data.root={markov_root}",
                 f"runs_dir={tmp_path / 'runs'}", f"run_name={name}"]
    run_dir = tmp_path / "runs" / name
    if nproc == 1:
        from pretrain.train.trainer import run

        assert run(compose_config(overrides), run_dir)["exit_code"] == 0
    else:
        spec = write_spec(tmp_path / "runs.pkl",
                          runs=[(name, compose_config(overrides), run_dir)])
        proc = run_ranks(HERE / "runs_worker.py", str(tmp_path), str(spec), nproc=nproc,
                         cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, failed(proc)
    logged = by_step(run_dir, "noise_scale")
    assert sorted(logged) == [1, 3, 6, 9]
    for step, value in logged.items():
        assert value is not None and math.isfinite(value) and value > 0, (step, value)
    assert read_result(run_dir)["noise_scale"] == pytest.approx(logged[9])


def test_a_resumed_run_keeps_measuring_where_it_stopped(tmp_path, markov_root, compose):
    """The averages are saved with each checkpoint and restored on resume: a run stopped
    (train.exit_interval) and resumed ends with the uninterrupted run's noise scale."""
    from pretrain.train.trainer import run

    common = [*COMMON, "parallel.micro_batch_size=4", "budget.steps=8",
              "logging.log_interval=1", f"data.root={markov_root}", "checkpoint.enabled=true",
              f"runs_dir={tmp_path}"]
    straight = run(compose(common), tmp_path / "straight")
    stopped = compose([*common, "train.exit_interval=5"])
    assert run(stopped, tmp_path / "resumed")["exit_code"] == 75  # saved at step 5
    resumed = run(stopped, tmp_path / "resumed")
    assert resumed["steps"] == straight["steps"] == 8
    assert by_step(tmp_path / "resumed") == by_step(tmp_path / "straight")  # same training
    assert straight["noise_scale"] is not None
    assert resumed["noise_scale"] == straight["noise_scale"]
    assert read_result(tmp_path / "resumed")["noise_scale"] == straight["noise_scale"]
