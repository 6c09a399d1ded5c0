"""The planner's host term on this CPU (planning/host_check.py, ``tools/host_time.py``): the
rule that turns one model's timed steps into costs and the others' predictions. No timing
is asserted here (the table in docs/planning.md is measured by the tool)."""

from __future__ import annotations

import pytest

from pretrain.planning import host_check
from pretrain.planning.calibration import GPU_HOST
from pretrain.planning.host import graph_calls, outside_ops, outside_seconds
from pretrain.planning.params import rank_params

# made-up step times (seconds) of nano at its two depths: only their algebra is checked
MEASURED = [
    host_check.Measured("nano", False, step_s=0.020, region_s=0.012, update_s=0.004),
    host_check.Measured("nano", True, step_s=0.010, region_s=0.003, update_s=0.004,
                        launch_share=0.7),
    host_check.Measured("nano-16", False, step_s=0.080, region_s=0.050, update_s=0.020),
    host_check.Measured("nano-16", True, step_s=0.050, region_s=0.020, update_s=0.020,
                        launch_share=0.6),
]
EAGER = MEASURED[0]


def test_the_calibration_reproduces_the_models_it_was_calibrated_on():
    costs = host_check.calibrate(MEASURED)
    assert costs.per_op > 0 and costs.per_tensor > 0
    assert {m.model for m in MEASURED} == set(host_check.CALIBRATED_ON)
    for m in MEASURED:
        assert host_check.predict(m.model, m.compiled, costs) == pytest.approx(m.step_s)


def test_every_model_here_is_planned_on_the_line_through_nanos_two_depths():
    """A layer adds the same units in each (ops, tensors, launches, inputs: GPT blocks),
    so the plan is nano's fixed part plus its layers at what a layer of nano costs."""
    costs = host_check.calibrate(MEASURED)
    for compiled in (False, True):
        nano, deep = (m.step_s for m in MEASURED if m.compiled == compiled)
        for model in host_check.MODELS:
            layers = host_check.config(model, compiled)[0].model.n_layer
            line = nano + (deep - nano) * (layers - 2) / 14
            assert host_check.predict(model, compiled, costs) == pytest.approx(line)


def test_a_deeper_model_with_more_tensors_is_planned_more_host_time():
    """The host term grows with what is dispatched: blocks' ops, parameter tensors."""
    costs = host_check.calibrate(MEASURED)
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
    costs = host_check.calibrate(MEASURED)
    off = host_check.Measured("tiny", False, step_s=1.0, region_s=0.5, update_s=0.1)
    rows = host_check.rows([EAGER, off], costs)
    assert rows[0]["calibration"] and rows[0]["ok"]
    assert not rows[1]["calibration"] and not rows[1]["ok"]
    assert "calibration" in host_check.markdown(rows, costs)


def test_what_a_compiled_layer_adds_is_split_into_launches_and_inputs_by_its_profile():
    """The compiled graph's time (the step less what runs outside it): what nano's 14 more
    layers add is the deeper step's ``launch_share`` over the kernels inductor's code calls
    and the rest over the graph's inputs (each parameter tensor and the batch's two); what
    nano's graph holds besides is its fixed part."""
    costs = host_check.calibrate(MEASURED)
    (la, ia), (lb, ib) = (graph_calls(*host_check.config(m, True))
                          for m in host_check.CALIBRATED_ON)
    graph = [m.step_s - outside_seconds(*host_check.config(m.model, True), costs)
             for m in MEASURED if m.compiled]
    assert (lb - la) * costs.per_launch == pytest.approx(0.6 * (graph[1] - graph[0]))
    assert (ib - ia) * costs.per_input == pytest.approx(0.4 * (graph[1] - graph[0]))
    assert costs.per_graph + la * costs.per_launch + ia * costs.per_input == pytest.approx(
        graph[0])
    cfg, layout = host_check.config("nano", True)
    assert ia == len(rank_params(cfg.model, layout).held) + 2


def test_a_compiled_block_launches_its_heavy_ops_and_the_fused_kernels_between_them():
    """29 kernels a block (inductor's generated code for nano, tiny and 10M: 20 heavy ops,
    9 fused kernels), 7 outside: the count grows by a block's per layer."""
    (two, _), (four, _) = (graph_calls(*host_check.config(m, True)) for m in ("nano", "tiny"))
    assert two == pytest.approx(2 * 29 + 7) and four - two == pytest.approx(2 * 29)
