"""The planner's host term on this CPU (planning/host_check.py, ``tools/host_time.py``): the
rule that turns one model's timed steps into costs and the others' predictions. No timing
is asserted here (the table in docs/planning.md is measured by the tool)."""

from __future__ import annotations

import pytest

from pretrain.planning import host_check
from pretrain.planning.calibration import GPU_HOST
from pretrain.planning.host import graph_calls, outside_ops, outside_seconds
from pretrain.planning.params import rank_params

# made-up step times (seconds): only their algebra is checked
EAGER = host_check.Measured("nano", False, step_s=0.020, region_s=0.012, update_s=0.004)
COMPILED = host_check.Measured("nano", True, step_s=0.010, region_s=0.003, update_s=0.004,
                               launch_share=0.6)


def test_the_calibration_reproduces_the_model_it_was_calibrated_on():
    costs = host_check.calibrate(EAGER, COMPILED)
    assert costs.per_op > 0 and costs.per_tensor > 0
    for m in (EAGER, COMPILED):
        assert host_check.predict(m.model, m.compiled, costs) == pytest.approx(m.step_s)


def test_a_deeper_model_with_more_tensors_is_planned_more_host_time():
    """The host term grows with what is dispatched: blocks' ops, parameter tensors."""
    costs = host_check.calibrate(EAGER, COMPILED)
    for compiled in (False, True):
        nano, tiny, ten = (host_check.predict(m, compiled, costs) for m in ("nano", "tiny", "10M"))
        assert nano < tiny < ten


def test_the_measured_shape_keeps_each_models_structure():
    """8 channels a head, the model's own layers, heads and tensors."""
    for model in host_check.MODELS:
        cfg, layout = host_check.config(model, False)
        assert cfg.model.d_model == host_check.HEAD_CHANNELS * cfg.model.n_head
        assert layout.microbatches == 1 and cfg.precision.name == "fp32"


def test_outside_the_region_each_parameter_tensor_costs_its_share():
    cfg, layout = host_check.config("tiny", True)
    ops = outside_ops(cfg, layout)
    base = outside_seconds(cfg, layout, GPU_HOST)
    assert base == pytest.approx(sum(ops.values()) * GPU_HOST.per_op + GPU_HOST.loop)


def test_the_table_marks_the_calibration_row_and_the_bar():
    costs = host_check.calibrate(EAGER, COMPILED)
    off = host_check.Measured("tiny", False, step_s=1.0, region_s=0.5, update_s=0.1)
    rows = host_check.rows([EAGER, off], costs)
    assert rows[0]["calibration"] and rows[0]["ok"]
    assert not rows[1]["calibration"] and not rows[1]["ok"]
    assert "calibration" in host_check.markdown(rows, costs)


def test_the_compiled_graph_is_split_into_launches_and_inputs_by_its_profile():
    """The compiled graph's time (the step less what runs outside it) is its launches'
    share (``launch_share``) over the kernels inductor's code calls, and the rest over the
    graph's inputs (each parameter tensor and the batch's two)."""
    costs = host_check.calibrate(EAGER, COMPILED)
    cfg, layout = host_check.config("nano", True)
    launches, inputs = graph_calls(cfg, layout)
    graph = COMPILED.step_s - outside_seconds(cfg, layout, costs)
    assert launches * costs.per_launch == pytest.approx(0.6 * graph)
    assert inputs * costs.per_input == pytest.approx(0.4 * graph)
    assert inputs == len(rank_params(cfg.model, layout).held) + 2


def test_a_compiled_block_launches_its_heavy_ops_and_the_fused_kernels_between_them():
    """29 kernels a block (inductor's generated code for nano, tiny and 10M: 20 heavy ops,
    9 fused kernels), 7 outside: the count grows by a block's per layer."""
    (two, _), (four, _) = (graph_calls(*host_check.config(m, True)) for m in ("nano", "tiny"))
    assert two == pytest.approx(2 * 29 + 7) and four - two == pytest.approx(2 * 29)
