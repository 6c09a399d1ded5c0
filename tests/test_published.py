"""The planner against published runs (src/pretrain/planning/published.py, the table in
docs/benchmarks.md): memory of the anchors' own layouts, and time at the calibrated
kernel efficiency."""

from __future__ import annotations

import pytest

from pretrain.planning.published import RUNS, compare

ROWS = {r.name: r for r in RUNS}
TORCHTITAN = [r.name for r in RUNS if r.name.startswith("torchtitan")]
MEGATRON = [r.name for r in RUNS if r.name.startswith("Megatron")]
# Megatron-LM rows the planner does not predict within 20% (docs/benchmarks.md): Megatron-LM
# ran them faster than this project's kernels would run with every transfer and bubble
# hidden (Transformer Engine's kernels against torch's, at the torchtitan-calibrated
# efficiency), so no overlap model closes the gap.
MEGATRON_GAPS = ["Megatron-LM GPT 32B", "Megatron-LM GPT 70B", "Megatron-LM GPT 119B",
                 "Megatron-LM GPT 314B", "Megatron-LM GPT 462B"]


@pytest.fixture(scope="module")
def compared() -> dict[str, dict]:
    return {r.name: compare(r) for r in RUNS}


@pytest.mark.slow
def test_every_published_layout_fits_in_the_memory_it_ran_in(compared):
    for name, row in compared.items():
        assert row["fits"], (name, row["predicted_gib"], row["capacity_gib"])
        if row["published_gib"]:
            assert row["predicted_gib"] <= 1.15 * row["published_gib"], name


def test_torchtitan_8b_row_within_1_15_of_its_reserved_memory(compared):
    row = compared["torchtitan 8B FSDP 8"]
    assert row["gpu"] == "h100-96gb"
    assert 0.8 * 82.4 <= row["predicted_gib"] <= 1.15 * 82.4


@pytest.mark.parametrize("name", TORCHTITAN + [n for n in MEGATRON if n not in MEGATRON_GAPS])
def test_tokens_per_second_within_20_percent(compared, name):
    assert 0.8 <= compared[name]["ratio"] <= 1.2, compared[name]


@pytest.mark.parametrize("name", MEGATRON_GAPS)
def test_megatron_gaps_are_kernel_speed(compared, name):
    """0.6-0.8 of what Megatron-LM ran, and even with no exposed transfer and no bubble
    the prediction would not exceed Megatron-LM's throughput."""
    row = compared[name]
    assert 0.6 <= row["ratio"] < 0.8 and row["compute_bound_ratio"] <= 1.005, row


def test_megatron_177b_and_gpt3_175b_recipe_fit():
    from pretrain.config.compose import compose_config
    from pretrain.hardware.gpus import get_gpu
    from pretrain.parallel.layout import resolve_layout
    from pretrain.planning.memory import estimate_memory

    assert compare(ROWS["Megatron-LM GPT 177B"])["fits"]
    cfg = compose_config(["+recipe=gpt3-175b"])
    assert estimate_memory(cfg, resolve_layout(cfg, 1024), get_gpu("h100-80gb")).fits
