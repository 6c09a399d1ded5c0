"""Async TP (``parallel.async_tp``): what it needs, that it is refused where it cannot run,
and what the planner counts for it (planning/cost.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_parallel_validation import BASE, only_problem

from pretrain.budget.compute import resolve_budget
from pretrain.config.schema import ConfigError
from pretrain.hardware.gpus import get_gpu
from pretrain.parallel.layout import resolve_layout
from pretrain.parallel.tensor_parallel import enable_async_tp
from pretrain.planning.cost import step_cost


@pytest.mark.parametrize("overrides,missing", [
    (["train.compile=false"], "train.compile=true"),
    (["parallel.sequence_parallel=false"], "parallel.sequence_parallel=true"),
])
def test_async_tp_names_what_it_needs(compose, overrides, missing):
    msg = only_problem(compose, ["parallel.async_tp=true", "train.compile=true", *overrides])
    assert f"needs {missing}" in msg and "parallel.async_tp=false" in msg


def test_async_tp_is_accepted_with_tp_sp_and_compile(compose):
    from pretrain.parallel.rules import layout_problems

    cfg = compose([*BASE, "parallel.async_tp=true", "train.compile=true"])
    assert layout_problems(cfg, 8) == []


def test_async_tp_refused_off_cuda():
    with pytest.raises(ConfigError, match="needs CUDA .* set parallel.async_tp=false"):
        enable_async_tp(SimpleNamespace(device_type="cpu"))


def test_async_tp_hides_tp_traffic_behind_the_matmuls(compose):
    """GPT-3 175B, the recipe's layout: without async TP every TP collective is exposed;
    with it at most all but the first of t pipelined steps of the blocks' collectives are
    hidden (never more than the block matmul time), the embedding's never."""
    gpu = get_gpu("h100-80gb")
    costs = {}
    for on in (False, True):
        cfg = compose(["+recipe=gpt3-175b", f"parallel.async_tp={str(on).lower()}"])
        layout = resolve_layout(cfg, 1024)
        budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
        costs[on] = step_cost(cfg, layout, gpu, budget)
    off, on = costs[False], costs[True]
    assert off.tp_hidden == 0 and on.tp_hidden > 0
    assert on.tp_comm + on.tp_hidden == pytest.approx(off.tp_comm)
    assert on.tp_hidden < off.tp_comm * 7 / 8  # t = 8: the first step and the embedding
    assert on.total == pytest.approx(off.total - on.tp_hidden * (1 + on.pp_bubble / (
        on.compute + on.recompute + on.tp_comm)), rel=1e-9)
