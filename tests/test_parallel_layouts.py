"""Every parallel layout trains exactly like one process (CPU, gloo, fp32).

A 4-layer nano GPT (tied embeddings, learned positions, biases) trains 3 AdamW steps on the
same global batches, once in one process (the reference) and once per layout on 2, 4 or 8
ranks. The runs of one world size share one set of processes (tests/parallel_worker.py,
helpers.run_group), forked from one that imported torch and the project once
(tests/forked_ranks.py), so the module costs three imports, not 14 plus torchrun's (the
one-process runs use pytest's own). Compared per step: the loss (1e-4,
the project's bound; observed <= 5e-7), the global grad norm and the validation loss (over the
same 8 batches everywhere; pipelines evaluate whole steps, see EVAL_BATCHES); after
training, every parameter, gathered from all shards and stages.

Parameter tolerance. In fp32 the layouts differ from one process only in reduction order
(all-reduce, reduce-scatter, matmuls split over ranks): ~1e-7 relative in each gradient. AdamW
normalises every coordinate's step (m / sqrt(v)), so most coordinates end up ~lr * 1e-7
apart, but a coordinate whose gradient nearly cancels over the batch keeps only rounding
noise of its own size, and Adam turns that into a visible fraction of a step. Hence two
bounds, one per coordinate and one per tensor:
  * every parameter within PARAM_ATOL = lr / 4 (a quarter of one step) of the reference
    (observed <= 2.1e-6 after 3 steps, in a TP layout; 5.2e-5 = lr / 20 after 5);
  * every tensor's update (final - initial) within UPDATE_RTOL = 1e-3 of the reference's,
    relative, in L2 norm (observed <= 1.7e-5 after 3 steps, 2.4e-4 after 5): a wrong
    gradient (a missing or doubled reduction, a wrong shard) moves a whole tensor's update
    by O(1), never by 1e-3.
The key projection's bias is the exception: its true gradient is exactly zero (q.b_k shifts
every score of a query equally and softmax ignores that), so its update is pure noise. It
can differ by up to one step per step: 2 * lr * steps (param_atol), no relative bound.
Initial parameters must be identical, bit for bit.

Three steps, not five (issue 69: the TP layouts' DTensor steps were a third of the module's
time): a wrong gradient shows in the first step, a wrong optimizer state (sharded, gathered,
carried over) from the second on, and the reference still learns (5.558 -> 5.485, the
bound's 0.05 with a margin of 0.02). tests/test_moe_layouts.py and tests/test_optimizers.py
train LAYOUT_STEPS too, with bounds of their own on how much their references learn; COMMON
(STEPS = 5) is left for a module that needs five.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from built_once import built_once
from helpers import MARKOV_DATA, VOCAB, run_group

from pretrain import torch_compat

STEPS, LR = 5, 1e-3  # COMMON's budget (no module trains it now: the docstring)
LAYOUT_STEPS = 3  # this module's runs (the docstring says why)
LOSS_ATOL = 1e-4
PARAM_ATOL = LR / 4
UPDATE_RTOL = 1e-3
# Every pipeline layout below evaluates whole steps of dp x microbatches = 8 batches (pp2:
# 1 x 8; tp2 x pp2 x dp2: 2 x 4): with 8 every layout evaluates the same batches as one
# process. A second evaluation asks for 3: one process and non-PP layouts evaluate 3 (DP
# pads with weight-0 repeats), pipelines round up to their 8.
EVAL_BATCHES, FEWER_EVAL_BATCHES = 8, 3

BASE = [
    "model=nano", "model.n_layer=4", f"model.vocab_size={VOCAB}", "model.seq_len=64",
    "model.attention=sdpa", "precision=fp32", *MARKOV_DATA, "budget=steps",
    "train.global_batch_size=16", "parallel.micro_batch_size=2",
    f"train.eval_batches={EVAL_BATCHES}",
    "train.eval_interval=1000", "train.sample_tokens=0", "logging=quiet",
    f"optim.lr={LR}", "schedule.warmup_steps=0",
]
COMMON = [*BASE, f"budget.steps={STEPS}"]

# name -> (processes, overrides). Each layout keeps the global batch of 16 sequences.
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "parallel.dp=1"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true"]),
    "pp2_gpipe": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=1f1b"]),
    "pp2_interleaved_1f1b": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.virtual_stages=2",
                                 "parallel.pp_schedule=interleaved_1f1b"]),
    "pp2_zbv": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.virtual_stages=2",
                    "parallel.pp_schedule=zbv"]),
    "ddp2": (2, ["parallel.dp=2", "parallel.dp_mode=ddp"]),
    "zero2_dp2": (2, ["parallel.dp=2", "parallel.dp_mode=zero2"]),
    "zero3_dp2": (2, ["parallel.dp=2", "parallel.dp_mode=zero3"]),
    # FSDP2's CPUOffloadPolicy (a no-op move on the CPU: the same FSDP path, pinned nothing)
    "zero3_dp2_offload": (2, ["parallel.dp=2", "parallel.dp_mode=zero3",
                              "parallel.offload=params"]),
    # activation checkpointing composed with TP+SP and with a pipeline
    "tp2_sp_full_ac": (2, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true",
                           "parallel.activation_checkpointing=full"]),
    "pp2_selective_ac": (2, ["parallel.pp=2", "parallel.dp=1",
                             "parallel.activation_checkpointing=selective"]),
    "hsdp_2x2": (4, ["parallel.dp=4", "parallel.dp_replicate=2", "parallel.dp_shard=2",
                     "parallel.dp_mode=zero3"]),
    "zero3_dp4": (4, ["parallel.dp=4", "parallel.dp_mode=zero3"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                        "parallel.sequence_parallel=true", "parallel.dp_mode=zero3"]),
}

PIPELINE_LAYOUTS = [n for n, (_, o) in LAYOUTS.items() if "parallel.pp=2" in o]
# ZBV on gloo needs torch 2.13 (pipeline.check_schedule_runs_here): not run on torch 2.11.
RUNS_HERE = {n for n in LAYOUTS if n != "pp2_zbv" or torch_compat.at_least("2.13")}


def _params(names) -> list:
    skip = pytest.mark.skip(reason=f"ZBV on gloo needs torch 2.13, this is {torch.__version__}")
    return [n if n in RUNS_HERE else pytest.param(n, marks=skip) for n in names]

# CompleteP away from its base shape (width 2x, depth 2x): every multiplier is not 1 and the
# optimizer has muP's groups. Compared with the one-process CompleteP run: TP (the scales
# on sharded activations and the vocabulary-parallel logits) and a pipeline (the output
# multiplier on the last stage, the tied head's copy in the vector-like group there) and
# ZeRO-3.
COMPLETEP = ["model.parametrization=completep", "model.base_width=32", "model.base_depth=2"]
MUP_LAYOUTS = {
    "tp2_completep": (2, ["parallel.tp=2", "parallel.dp=1", *COMPLETEP]),
    "pp2_1f1b_completep": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=1f1b",
                               *COMPLETEP]),
    # FSDP2: muP's groups over DTensor shards, the LR and epsilon per group
    "zero3_dp2_completep": (2, ["parallel.dp=2", "parallel.dp_mode=zero3", *COMPLETEP]),
}

# One process, activation checkpointing: must change no number at all.
AC_VARIANTS = {
    "ac_selective_attention": ["parallel.activation_checkpointing=selective"],
    "ac_selective_every_2": ["parallel.activation_checkpointing=selective",
                             "parallel.ac_every_n_layers=2"],
    "ac_full": ["parallel.activation_checkpointing=full"],
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def layout_env(tmp_path_factory, markov_root) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("layouts")
    return root, [*BASE, f"budget.steps={LAYOUT_STEPS}", f"data.root={markov_root}",
                  f"runs_dir={root / 'runs'}"]


@pytest.fixture(scope="session")
def reference(layout_env, tmp_path_factory) -> dict[str, dict]:
    """One process: the plain run and its activation-checkpointing variants."""
    single = {"single": ["parallel.dp=1"]}
    single.update({name: ["parallel.dp=1", *extra] for name, extra in AC_VARIANTS.items()})
    single["offload_params"] = ["parallel.dp=1", "parallel.offload=params"]
    single["single_completep"] = ["parallel.dp=1", *COMPLETEP]
    return built_once(tmp_path_factory, "layouts-reference", lambda root: run_group(
        root, layout_env[1], 1, single, [FEWER_EVAL_BATCHES]))


@pytest.fixture(scope="session")
def groups(layout_env, tmp_path_factory) -> Callable[[int], dict[str, dict]]:
    """groups(n): the results of every n-process layout, run once per pytest run (whichever
    worker asks first: tests/built_once.py) on demand."""

    @functools.cache
    def group(nproc: int) -> dict[str, dict]:
        layouts = {n: overrides for n, (procs, overrides) in {**LAYOUTS, **MUP_LAYOUTS}.items()
                   if procs == nproc and (n in RUNS_HERE or n in MUP_LAYOUTS)}
        return built_once(tmp_path_factory, f"layouts-{nproc}", lambda root: run_group(
            root, layout_env[1], nproc, layouts, [FEWER_EVAL_BATCHES]))

    return group


def param_atol(name: str, steps: int) -> float:
    """The key bias's bound, up to one step per step; every other parameter's, PARAM_ATOL."""
    return 2 * LR * steps if name.endswith("attn.wk.bias") else PARAM_ATOL


def assert_same_training(got: dict, ref: dict,
                         update_rtol: Callable[[str, torch.Tensor], float] | None = None
                         ) -> dict[str, float]:
    """The comparison every layout must pass; returns the observed differences.
    ``update_rtol(name, tensor)``: another per-tensor update bound (Muon's bf16
    orthogonalisation, tests/test_optimizers.py) instead of UPDATE_RTOL. Both ran the same
    budget: LAYOUT_STEPS here, STEPS in the modules that share COMMON."""
    steps = len(ref["losses"])
    assert len(got["losses"]) == steps and steps in (STEPS, LAYOUT_STEPS)
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    assert loss_diff <= LOSS_ATOL, (got["losses"], ref["losses"])
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], atol=1e-4)
    assert got["val_batches"] == ref["val_batches"] == EVAL_BATCHES
    assert got["val_loss"] == pytest.approx(ref["val_loss"], abs=LOSS_ATOL)
    assert got["init"].keys() == ref["init"].keys() == got["final"].keys()
    for key, value in ref["init"].items():
        assert torch.equal(got["init"][key], value), f"initial {key} differs"
    param_diff = update_diff = 0.0
    for key, value in ref["final"].items():
        diff = (got["final"][key] - value).abs().max().item()
        assert diff <= param_atol(key, steps), f"{key}: {diff:.2e}"
        if key.endswith("attn.wk.bias"):
            continue
        ref_update = value - ref["init"][key]
        if not ref_update.any():  # state that did not move (an unused MoE bias): nor here
            assert not (got["final"][key] - got["init"][key]).any(), key
            continue
        update = (got["final"][key] - got["init"][key] - ref_update).norm() / ref_update.norm()
        bound = update_rtol(key, value) if update_rtol else UPDATE_RTOL
        assert update <= bound, f"{key}: update differs by {update:.2e} (relative)"
        param_diff, update_diff = max(param_diff, diff), max(update_diff, update.item())
    return {"loss": loss_diff, "param": param_diff, "update": update_diff}


def test_reference_learns(reference):
    losses = reference["single"]["losses"]
    assert losses[-1] < losses[0] - 0.05  # the comparisons below are of a run that trains


@pytest.mark.parametrize("name", list(AC_VARIANTS))
def test_activation_checkpointing_changes_no_number(reference, name):
    got, ref = reference[name], reference["single"]
    assert got["losses"] == ref["losses"]
    assert got["grad_norms"] == ref["grad_norms"]
    for key, value in ref["final"].items():
        assert torch.equal(got["final"][key], value), key


def test_offloading_changes_no_number_on_one_process(reference):
    """parallel.offload=params on one process: FSDP2 over a group of one with its
    CPUOffloadPolicy, against the plain run (on the CPU the host is the device: what this
    shows is the offload path's numbers, not its copies)."""
    got, ref = reference["offload_params"], reference["single"]
    assert got["losses"] == ref["losses"]
    assert got["grad_norms"] == ref["grad_norms"]
    for key, value in ref["final"].items():
        assert torch.equal(got["final"][key], value), key


@pytest.mark.parametrize("name", _params(LAYOUTS))
def test_layout_trains_like_one_process(reference, groups, name):
    got = groups(LAYOUTS[name][0])[name]
    diffs = assert_same_training(got, reference["single"])
    print(f"{name}: max loss diff {diffs['loss']:.1e}, max param diff {diffs['param']:.1e}, "
          f"max relative update diff {diffs['update']:.1e}")


@pytest.mark.parametrize("name", list(MUP_LAYOUTS))
def test_completep_layout_trains_like_one_process(reference, groups, name):
    assert_same_training(groups(MUP_LAYOUTS[name][0])[name], reference["single_completep"])
    # and the parametrisation changed the run: not the standard one's numbers
    assert reference["single_completep"]["losses"] != reference["single"]["losses"]


def _state_bytes(m: dict) -> int:
    return m["params"] + m["grads"] + m["optimizer"]


def test_zero3_over_4_ranks_holds_a_quarter(reference, groups):
    one = reference["single"]["memory"][0]
    ranks = groups(4)["zero3_dp4"]["memory"]
    assert len(ranks) == 4
    for m in ranks:
        for key in ("params", "grads", "optimizer"):
            assert m[key] == pytest.approx(one[key] / 4, rel=0.02), key
        assert _state_bytes(m) / _state_bytes(one) == pytest.approx(0.25, rel=0.02)
    print("peak RSS per rank (MB): dp=1", one["peak_rss"] >> 20,
          "| zero3 dp=4", [m["peak_rss"] >> 20 for m in ranks])


@pytest.mark.parametrize("name", _params(PIPELINE_LAYOUTS))
def test_pipeline_keeps_no_microbatch_outputs(groups, name):
    """The trainer runs the schedule with return_outputs=False: after a step no rank holds a
    microbatch's logits (torch's default keeps all of them on the last stage, 4.9 GB on
    gpt3-175b), as planning/memory.py assumes."""
    ranks = groups(LAYOUTS[name][0])[name]["memory"]
    assert [m["pipeline_outputs"] for m in ranks] == [0] * len(ranks)


@pytest.mark.parametrize("name", _params(PIPELINE_LAYOUTS))
def test_pipeline_receive_buffers_are_bounded_by_the_microbatches_in_flight(groups, name):
    """parallel/pipeline.BoundedStage: a stage holds receive buffers only for the microbatches
    in flight (torch's PipelineStage keeps one per microbatch of the step: 8 here), at most
    what the planner counts (planning/activations.inflight_chunks)."""
    from pretrain.config.compose import compose_config
    from pretrain.parallel import pipeline
    from pretrain.parallel.layout import resolve_layout
    from pretrain.planning.activations import live_recv_buffers

    if pipeline.stage_class() is not pipeline.BoundedStage:
        pytest.skip(f"torch {torch.__version__} runs torch's own PipelineStage (BoundedStage's "
                    "private hooks are torch 2.13's): one buffer per microbatch")
    processes, overrides = LAYOUTS[name]
    layout = resolve_layout(compose_config([*COMMON, *overrides]), processes)
    ranks = groups(processes)[name]["memory"]
    for rank, m in enumerate(ranks):
        pp_rank = rank // (layout.world_size // layout.pp)
        bound = live_recv_buffers(layout.pp_schedule, layout.pp, layout.virtual_stages,
                                  layout.microbatches, pp_rank)
        assert m["pipeline_recv_peak"] <= bound, (rank, m, bound)  # what the planner counts
        if layout.pp_schedule != "gpipe":  # GPipe runs every forward first: all in flight
            assert m["pipeline_recv_peak"] < layout.microbatches, (rank, m)
    assert max(m["pipeline_recv_peak"] for m in ranks) > 0  # measured, not absent


@pytest.mark.parametrize("name", _params(LAYOUTS))
def test_eval_counts_every_batch_it_computes(reference, groups, name):
    """eval_batches=3 after training. A pipeline computes a whole step (8 batches) and now
    counts all of them: its loss is one process's mean over those 8 distinct batches, not
    over 3 (padding weight-0 repeats, as it used to). Other layouts evaluate 3, like one
    process."""
    ref = reference["single"]
    (ref_count, ref_fewer), = ref["extra_eval"]
    assert ref_count == FEWER_EVAL_BATCHES
    assert abs(ref_fewer - ref["val_loss"]) > 10 * LOSS_ATOL  # 3 and 8 batches tell apart
    (count, loss), = groups(LAYOUTS[name][0])[name]["extra_eval"]
    if name in PIPELINE_LAYOUTS:
        assert count == EVAL_BATCHES
        assert loss == pytest.approx(ref["val_loss"], abs=LOSS_ATOL)
    else:
        assert count == FEWER_EVAL_BATCHES
        assert loss == pytest.approx(ref_fewer, abs=LOSS_ATOL)


def test_tp2_halves_block_parameters(reference, groups):
    one = reference["single"]["memory"][0]["block_params"]
    for m in groups(2)["tp2"]["memory"]:
        # Norms and the row-parallel biases (6 x d_model per block) stay replicated: 0.4% here.
        assert m["block_params"] / one == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("name", ["zero3_dp2", "tp2", "pp2_1f1b"])
def test_first_step_starts_from_the_one_process_weights(reference, groups, name):
    """Each rank initialises only its own shards (pretrain.model.initialization), yet the first
    step's loss is that of one process to fp32 rounding: the same weights, bit for bit."""
    got = groups(2)[name]
    assert abs(got["losses"][0] - reference["single"]["losses"][0]) <= 1e-6
