"""Precision policies and torch.compile against an fp32 eager reference (CPU, gloo).

A nano GPT (2 blocks, d_model 64, vocabulary 256, 64 tokens a sequence, 8 sequences a step:
N = 512 tokens) trains 50 AdamW steps on a fixed Markov-chain corpus from the same seed,
once per variant, in this process; the 2-process runs share one set of processes
(tests/precision_worker.py, helpers.run_ranks).

bf16 tolerance. bf16 keeps 8 significant bits: eps = 2^-8, unit roundoff u = 2^-9. Under
autocast the matmul inputs and outputs are rounded to bf16 (relative error <= u each), while
the loss itself (log-sum-exp over the vocabulary, mean over tokens), the master weights and
AdamW stay fp32. How that reaches the reported loss:
  * at equal weights (step 1), each logit z carries an error of a few u |z| from the chain
    of roundings before it, and a token's loss moves by (softmax - onehot) . dz. The signs
    are independent across tokens, so the mean over N tokens moves by about
    k u |z| / sqrt(N): with k ~ 5 roundings, |z| ~ 2 after some training and sqrt(512) ~ 23,
    about 4e-4 (1e-4 relative at loss 4); at initialisation the logits are ~0.02 and the
    difference is tiny. Measured: 2.0e-5 at step 1;
  * over the steps the weights drift apart: gradients differ by O(u) relative, AdamW turns
    that into O(u lr) per coordinate and step, and the loss drift stays of the order of the
    forward noise over 50 steps. Measured, worst step per 10 steps: 1.1e-4, 1.9e-4,
    3.3e-4, 2.5e-4, 3.1e-4 (absolute; at most 7.5e-5 of the fp32 loss).
The bound is BF16_RTOL = 2^-10 = u / 2 of the fp32 loss at every step: 13x the worst
measured difference, and below the error of a loss merely rounded to bf16 once (up to u,
u / 2 on average). So it also asserts that the loss and the weights stay fp32: measured
(by hand) with the cross-entropy taken in bf16 the difference reaches 3.6e-3 relative; with
bf16 master weights (updates of lr = 3e-3 vanish in a LayerNorm gain of 1, whose bf16
spacing is 2^-7), 2.1e-2. For scale: fp16 autocast (u = 2^-11, 8x finer) differs from
fp32 by at most 6.2e-5 on the same run, 6x less than bf16.

compile tolerance. Regional compile (each block compiled alone, parallel/apply.py) keeps
fp32 and changes only how the block's ops are fused and in which order they sum (Inductor
kernels for LayerNorm, softmax, GELU): a few fp32 units of roundoff (2^-24 ~ 6e-8) per
op, the same class of difference as a parallel layout (tests/test_parallel_layouts.py).
The loss, ~4, has an fp32 spacing of 4.8e-7. Measured over 50 steps: at most 9.5e-7 (two
spacings), identical at step 1. Bound: COMPILE_LOSS_ATOL = 1e-5, 10x that and still
about 20 fp32 spacings: room for reordering, none for a change to the block's maths.
Parameters: every coordinate within lr / 10 of eager after 50 steps (measured 2.9e-5; a
coordinate whose gradient nearly cancels turns rounding noise into a fraction of an Adam
step, see tests/test_parallel_layouts.py). ZeRO-3 over 2 ranks with full activation
checkpointing and compile, against one eager process: 4.8e-7 (loss), 2.3e-5 (parameters)
after 10 steps, bounded as the layouts are (1e-4) and by lr / 10.

Tensor parallelism + sequence parallelism + selective activation checkpointing + compile on
2 ranks, against the same eager process, is bounded the same way. It exercises the order
parallel/apply.py uses because torchtitan's (checkpoint, then compile) fails under TP in
torch 2.13: AOTAutograd's ``save_from_forward`` raises "expected all
tensors_saved_with_vc_check to be Tensors", the TP DeviceMesh being among the values a
checkpointed DTensor graph saves for backward.

fp16. An inf in one rank's gradient at exactly one step: that step is skipped on every rank
(parameters bit-identical before and after, gathered from all shards), the loss scale
halves there (65536 -> 32768) and only there, skipped_steps == 1 on both ranks, and the
trainer warns. Note that under FSDP2 the per-rank verdicts would agree even with a plain
GradScaler (tried): DTensor's dispatch of ``_amp_foreach_non_finite_check_and_unscale_``
max-reduces found_inf over the mesh dimensions the gradients are sharded on. The trainer
uses ShardedGradScaler, which all-reduces it over the world too; the test checks which.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from built_once import built_once
from helpers import (
    HERE,
    MARKOV_DATA,
    VOCAB,
    compose_all,
    compose_config,
    one_thread,
    run_ranks,
    write_spec,
)
from precision_worker import block_output_dtype, run_steps

from pretrain.train.trainer import Trainer

STEPS, LR = 50, 3e-3
BF16_RTOL = 2**-10
COMPILE_LOSS_ATOL = 1e-5
COMPILE_PARAM_ATOL = LR / 10
LEARNS_BY = 1.0  # nats: 5.55 -> 3.95 measured in 50 steps
FP16_STEPS, INJECT_AT = 5, 2  # the third step (logged as step 3) overflows
DP2_STEPS = 10  # zero3 + activation checkpointing + compile, against the first 10 steps
LOSS_ATOL_DP2 = 1e-4  # as tests/test_parallel_layouts.py (fp32 reduction order only)
FP16_PP_ATOL = 1e-3  # fp16 pp2 (2 microbatches of 4) vs zero2 (4 per rank): observed 3e-5

COMMON = [
    "model=nano", f"model.vocab_size={VOCAB}", "model.seq_len=64", "model.attention=sdpa",
    *MARKOV_DATA, "train.device=cpu", "train.global_batch_size=8", "train.eval_interval=1000",
    "train.sample_tokens=0", "logging=quiet", f"optim.lr={LR}", "schedule.warmup_steps=5",
    "budget=steps",
]

# 2 processes, one start-up: name -> (overrides, steps to run, injection)
DP2_JOBS = {
    "fp16_zero2_forward_inf": (
        ["precision=fp16", "parallel=zero2", f"budget.steps={FP16_STEPS}"], None,
        {"step": INJECT_AT, "rank": 1, "how": "forward"}),
    "fp16_zero3_shard_inf": (
        ["precision=fp16", "parallel=zero3", f"budget.steps={FP16_STEPS}"], None,
        {"step": INJECT_AT, "rank": 1, "how": "shard"}),
    # The pipeline schedule runs backward itself: the loss is scaled in its loss_fn.
    "fp16_pp2_forward_inf": (
        ["precision=fp16", "parallel.pp=2", "parallel.dp=1", f"budget.steps={FP16_STEPS}"],
        None, {"step": INJECT_AT, "rank": 1, "how": "forward"}),
    # Last, so that a compile failure leaves the fp16 results in place. The first steps of
    # the reference's 50-step schedule (the LR after warmup depends on the budget).
    "fp32_zero3_full_ac_compile": (
        ["precision=fp32", "parallel=zero3", "parallel.activation_checkpointing=full",
         "train.compile=true", f"budget.steps={STEPS}"], DP2_STEPS, None),
    "fp32_tp2_sp_selective_ac_compile": (
        ["precision=fp32", "parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true",
         "parallel.activation_checkpointing=selective", "train.compile=true",
         f"budget.steps={STEPS}"], DP2_STEPS, None),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory, markov_root) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("precision")
    return root, [*COMMON, f"data.root={markov_root}", f"runs_dir={root / 'runs'}"]


def train(env, name: str, extra: list[str], steps: int = STEPS, **kwargs) -> dict:
    root, common = env
    cfg = compose_config([*common, f"budget.steps={steps}", "parallel.micro_batch_size=8",
                          *extra])
    with one_thread():
        trainer = Trainer(cfg, root / name)
        trainer.setup()
        record = run_steps(trainer, **kwargs)
        record["block_dtype"] = block_output_dtype(trainer)
    return record


@pytest.fixture(scope="module")
def fp32(env, tmp_path_factory) -> dict:
    """This and the module's other runs: once per pytest run (tests/built_once.py)."""
    return built_once(tmp_path_factory, "precision-fp32", lambda _: train(
        env, "fp32", ["precision=fp32"], snapshot_at=DP2_STEPS))


@pytest.fixture(scope="module")
def bf16(env, tmp_path_factory) -> dict:
    return built_once(tmp_path_factory, "precision-bf16",
                      lambda _: train(env, "bf16", ["precision=bf16"]))


@pytest.fixture(scope="module")
def compiled(env, tmp_path_factory) -> dict:
    return built_once(tmp_path_factory, "precision-compiled", lambda _: train_compiled(env))


def train_compiled(env) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no cache entry from another test: this run compiles the block
    counters.clear()
    try:
        return train(env, "compiled", ["precision=fp32", "train.compile=true"])
    finally:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def dp2(env, tmp_path_factory) -> dict[str, list[dict] | str]:
    """Every DP2_JOBS job in one 2-process group: per job, the two ranks' records, or
    (for a job that did not finish) the run's output."""
    return built_once(tmp_path_factory, "precision-dp2", lambda _: run_dp2(env))


def run_dp2(env) -> dict[str, list[dict] | str]:
    root, common = env
    out = root / "dp2"
    out.mkdir()
    configs = compose_all({name: [*common, *overrides, "parallel.micro_batch_size=4",
                                  "run_name=test"]
                           for name, (overrides, _, _) in DP2_JOBS.items()})
    spec = write_spec(out / "spec.pkl", jobs={
        name: {"config": configs[name], "steps": steps, "inject": inject}
        for name, (_, steps, inject) in DP2_JOBS.items()})
    proc = run_ranks(HERE / "precision_worker.py", str(out), str(spec), nproc=2, cwd=root)
    results: dict[str, list[dict] | str] = {}
    for name in DP2_JOBS:
        files = [out / f"{name}.rank{r}.pt" for r in range(2)]
        if all(f.exists() for f in files):
            results[name] = [torch.load(f, weights_only=False) for f in files]
        else:
            results[name] = (f"{name} did not finish (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return results


def job(dp2: dict, name: str) -> list[dict]:
    got = dp2[name]
    assert not isinstance(got, str), got
    return got


def assert_learns(losses: list[float]) -> None:
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < losses[0] - LEARNS_BY, losses


# -- bf16 --------------------------------------------------------------------------------


def test_bf16_tracks_fp32_within_half_a_bf16_roundoff(fp32, bf16):
    assert fp32["block_dtype"] == torch.float32
    assert bf16["block_dtype"] == torch.bfloat16  # one process: autocast's bf16 matmuls
    assert_learns(fp32["losses"])
    assert_learns(bf16["losses"])
    ref, got = np.array(fp32["losses"]), np.array(bf16["losses"])
    diff = np.abs(got - ref)
    print(f"bf16 vs fp32: step 1 {diff[0]:.1e}, max {diff.max():.1e} "
          f"({(diff / ref).max():.1e} relative, bound {BF16_RTOL:.1e}); per 10 steps "
          f"{' '.join(f'{d:.1e}' for d in diff.reshape(-1, 10).max(1))}")
    assert diff[0] > 0  # the same weights give another loss: bf16 really computed it
    assert np.all(diff <= BF16_RTOL * ref), diff / ref
    assert fp32["skipped_steps"] == bf16["skipped_steps"] == 0


# -- compile -----------------------------------------------------------------------------


@pytest.mark.slow
def test_one_process_compiles_model_and_loss_as_one_graph(compiled):
    """One process: the whole model and its loss in one graph (nanoGPT's way), no block
    compiled on its own, no graph break (fullgraph would have raised)."""
    assert compiled["whole_compiled"]
    assert compiled["compiled"] == [False, False]  # no regional compile beside it
    stats = compiled["dynamo"]["stats"]
    assert stats.get("calls_captured", 0) > 0, compiled["dynamo"]
    # 50 steps, one shape: one graph, compiled once
    assert stats.get("unique_graphs") == 1, compiled["dynamo"]
    assert not compiled["dynamo"].get("graph_break"), compiled["dynamo"]


def test_compile_trains_like_eager(fp32, compiled):
    assert_learns(compiled["losses"])
    diff = np.abs(np.array(compiled["losses"]) - np.array(fp32["losses"]))
    param_diff = max((compiled["final"][k] - v).abs().max().item()
                     for k, v in fp32["final"].items())
    print(f"compile vs eager: max loss diff {diff.max():.1e}, max param diff {param_diff:.1e}")
    assert np.all(diff <= COMPILE_LOSS_ATOL), diff
    np.testing.assert_allclose(compiled["grad_norms"], fp32["grad_norms"], rtol=1e-4)
    assert compiled["final"].keys() == fp32["final"].keys()
    assert param_diff <= COMPILE_PARAM_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32_zero3_full_ac_compile",
                                  "fp32_tp2_sp_selective_ac_compile"])
def test_compile_composes_with_sharding_and_activation_checkpointing(fp32, dp2, name):
    ranks = job(dp2, name)
    ref_losses = fp32["losses"][:DP2_STEPS]
    for got in ranks:
        assert got["compiled"] == [True, True]
        assert got["dynamo"]["stats"].get("calls_captured", 0) > 0, got["dynamo"]
        diff = np.abs(np.array(got["losses"]) - np.array(ref_losses))
        assert np.all(diff <= LOSS_ATOL_DP2), diff
        np.testing.assert_allclose(got["grad_norms"], fp32["grad_norms"][:DP2_STEPS],
                                   rtol=1e-4)
        param_diff = max((got["final"][k] - v).abs().max().item()
                         for k, v in fp32["snapshot"].items())
        assert got["final"].keys() == fp32["snapshot"].keys()
        assert param_diff <= COMPILE_PARAM_ATOL
    print(f"{name} (2 ranks) vs one eager process: max loss diff "
          f"{diff.max():.1e}, max param diff {param_diff:.1e}")


# -- fp16 --------------------------------------------------------------------------------


def assert_one_skipped_step(got: dict, scaler: str) -> None:
    """The step INJECT_AT changed no parameter, halved the loss scale and was counted and
    reported; every other step updated the parameters at an unchanged scale."""
    assert got["scaler"] == scaler
    steps = got["steps"]
    assert len(steps) == FP16_STEPS
    for i, s in enumerate(steps):
        skipped = i == INJECT_AT
        assert s["full_changed"] is not skipped, (i, s)
        assert s["local_changed"] is not skipped, (i, s)
        assert s["scale"] == (2.0**15 if i >= INJECT_AT else 2.0**16), (i, s)
        assert math.isfinite(s["loss"]) or skipped, (i, s)
    assert not math.isfinite(steps[INJECT_AT]["grad_norm"])
    assert got["skipped_steps"] == 1
    overflowed = [m for m in got["warnings"] if "fp16 gradients overflowed" in m]
    assert len(overflowed) == 1, got["warnings"]
    assert f"step {INJECT_AT + 1}:" in overflowed[0] and "65536 -> 32768" in overflowed[0]


def test_fp16_skips_an_overflowed_step_one_process(env):
    got = train(env, "fp16", ["precision=fp16"], steps=FP16_STEPS,
                inject={"step": INJECT_AT, "rank": 0, "how": "forward"})
    assert got["block_dtype"] == torch.float16
    # one process under mixed precision autocasts, with no wrapper: torch's own scaler
    assert_one_skipped_step(got, "GradScaler")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp16_zero2_forward_inf", "fp16_zero3_shard_inf"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(dp2, name):
    ranks = job(dp2, name)
    for got in ranks:
        assert_one_skipped_step(got, "ShardedGradScaler")
    # the ranks agree on everything they report, and on the parameters
    for key in ("loss", "grad_norm", "scale"):  # (NaN equals NaN here)
        np.testing.assert_array_equal(*[[s[key] for s in r["steps"]] for r in ranks])
    for key, value in ranks[0]["final"].items():
        assert torch.equal(value, ranks[1]["final"][key]), key


@pytest.mark.slow
def test_fp16_with_pipeline_parallelism_skips_and_reports_unscaled_losses(dp2):
    """pp=2, the inf in the last stage's logits: both stages skip that step (the first
    stage only ever sees its gradient), and the reported losses are the unscaled ones, as
    zero2's on the same batches (a loss left multiplied by the 65536 scale would not be)."""
    ranks = job(dp2, "fp16_pp2_forward_inf")
    ref = job(dp2, "fp16_zero2_forward_inf")[0]
    for got in ranks:
        assert_one_skipped_step(got, "ShardedGradScaler")
        for i, (a, b) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
            if i != INJECT_AT:
                assert abs(a["loss"] - b["loss"]) < FP16_PP_ATOL, (i, a["loss"], b["loss"])
    print("fp16 pp2 vs zero2 losses:", [round(s["loss"], 5) for s in ranks[0]["steps"]],
          [round(s["loss"], 5) for s in ref["steps"]])
