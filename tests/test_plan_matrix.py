"""The planner's memory at the step's peak, by phase (planning/phases.py), against the
simulation (``tools/plan.py --check-matrix``; the whole matrix is documented in
docs/planning.md): a few fast rows here, and the phase rules the planner's users share."""

from __future__ import annotations

import pytest

from pretrain.config.compose import compose_config
from pretrain.model.gpt import padded_vocab_size
from pretrain.parallel.layout import layout_world_size, resolve_layout
from pretrain.planning import matrix
from pretrain.planning.memory import rank_memory
from pretrain.planning.phases import KINDS, by_kind
from pretrain.planning.simulate import predicted


@pytest.mark.parametrize("row", [r for r in matrix.ROWS if r.fast], ids=lambda r: r.name)
def test_a_fast_row_of_the_matrix_is_within_five_percent(row):
    """Planned / simulated peak in [0.95, 1.05], the kinds side by side within 5% of it."""
    result = matrix.run_row(row)
    assert result["ok"], matrix.markdown([result])
    assert set(result["measured_by_kind"]) == set(KINDS)
    assert result["worst_kind_share"] <= matrix.TOLERANCE, matrix.markdown([result])


def _zero3(gbs: int):
    cfg = compose_config(["+recipe=gpt3-1.3b", "precision=bf16", "parallel=zero3",
                          "parallel.dp=8", "parallel.micro_batch_size=2",
                          f"train.global_batch_size={gbs}", "train.compile=false"])
    return cfg, resolve_layout(cfg, 8)


def test_one_micro_batch_peaks_before_any_gradient_exists_accumulation_after():
    """The issue's 1.3B zero3 rank: with one micro batch (set_to_none) no gradient and no
    gradient buffer is at the peak; with two, the first's sharded gradients are."""
    one = rank_memory(*_zero3(16), 0, device="cpu")
    assert one.at_peak["gradients"] == 0 and one.at_peak["gradient buffers"] == 0
    assert one.total < sum(one.parts.values())  # not every part's own peak added
    two = rank_memory(*_zero3(32), 0, device="cpu")
    assert two.at_peak["gradients"] == two.parts["gradients"] > 0


def test_the_plan_the_simulation_and_the_kinds_read_the_same_phases():
    """One rule, three users: the plan's total is the largest phase, the simulation's
    prediction is the largest backward phase, its kinds sum to it."""
    cfg, layout = _zero3(16)
    rm = rank_memory(cfg, layout, 0, device="cpu")
    pred = predicted(cfg, layout, 0, 0)
    assert pred["step_peak_bytes"] == int(sum(rm.phases[pred["step_peak_phase"]].values()))
    assert rm.peak_phase == pred["step_peak_phase"]
    assert sum(pred["step_peak_by_kind"].values()) == pytest.approx(
        pred["step_peak_bytes"], abs=8)
    assert by_kind(rm.at_peak) == pytest.approx(pred["step_peak_by_kind"], abs=8)


def _row(name: str):
    row = next(r for r in matrix.ROWS if r.name == name)
    cfg = compose_config(list(row.overrides))
    return cfg, resolve_layout(cfg, layout_world_size(cfg.parallel))


def test_groups_reduced_as_they_finish_hold_a_timeline_not_every_gradient():
    """ZeRO-3 with one micro batch: at the blocks' backward only the blocks already reduced
    hold gradient shards, and one reduce-scatter input is in flight, not one per block."""
    cfg, layout = _row("6.7B zero3, full recompute")
    rm = rank_memory(cfg, layout, 0, device="cpu")
    blocks = rm.phases["blocks backward"]
    assert 0 < blocks["gradients"] < rm.parts["gradients"]
    assert rm.phases["backward end"]["gradients"] == rm.parts["gradients"]
    assert {"root backward", "blocks backward"} <= set(rm.phases)


def test_under_tp_the_embeddings_backward_makes_the_whole_vocabularys_gradient():
    """DTensor's embedding backward replicates the gradient: the root's backward holds the
    whole vocabulary's in the compute dtype, more than the TP shard of the table."""
    cfg, layout = _row("6.7B tp4 SP zero3")
    rm = rank_memory(cfg, layout, 0, device="cpu")
    whole = 2 * padded_vocab_size(cfg.model) * cfg.model.d_model  # bf16
    assert rm.phases["root backward"]["backward transient"] >= whole
    assert rm.peak_phase == "root backward"


def test_an_interleaved_rank_peaks_in_its_last_forward_with_one_stage_gathered():
    """Interleaved 1F1B under ZeRO-3: the fifth forward in flight, on stage 0, holds its
    root and one block gathered (Parameter) and two all-gather outputs (FSDP2 keeps the
    previous group's past its copy-out in forward: Activation), four chunks saved before
    it; the backward holds the stage's root and block, not every weight."""
    cfg, layout = _row("6.7B pp2 interleaved x2")
    rm = rank_memory(cfg, layout, 0, device="cpu")
    forward = rm.phases["forward"]
    assert rm.peak_phase == "forward"
    assert forward["compute-dtype weight copies"] < rm.parts["compute-dtype weight copies"]
    assert forward["all-gather outputs"] == forward["compute-dtype weight copies"]
    assert forward["activations"] < rm.parts["activations"]
    kinds = by_kind(forward, phase="forward")
    assert kinds["Activation"] >= forward["activations"] + forward["all-gather outputs"]
    assert by_kind(rm.phases["blocks backward"])["Temp"] >= rm.phases["blocks backward"][
        "all-gather outputs"] > 0


def test_a_pipeline_rank_without_zero3_keeps_every_weight_gathered_in_its_forward():
    """ZeRO-2 keeps the weights gathered after forward: the forward phase holds all of
    them and no all-gather output."""
    cfg = compose_config([*matrix._67B, "parallel=zero2", "parallel.pp=2", "parallel.dp=2",
                          "parallel.micro_batch_size=1", "train.global_batch_size=8",
                          "parallel.pp_schedule=1f1b"])
    layout = resolve_layout(cfg, layout_world_size(cfg.parallel))
    rm = rank_memory(cfg, layout, 0, device="cpu")
    forward = rm.phases["forward"]
    assert forward["compute-dtype weight copies"] == rm.parts["compute-dtype weight copies"]
    assert forward.get("all-gather outputs", 0.0) == 0.0
